"""python -m bench.peers {worker,quantize,ct2-convert}: the peer environment's entry points,
driven by `python -m bench speed --peers`."""

from __future__ import annotations

import sys

COMMANDS = ("worker", "quantize", "ct2-convert")


def main(argv: list[str]) -> int:
    command = argv[0] if argv else None
    if command == "worker":
        from .worker import main as worker
        return worker(argv[1:])
    if command == "quantize":
        from .hf import quantize
        return quantize(argv[1:])
    if command == "ct2-convert":
        from .ct2_convert import main as ct2_convert
        return ct2_convert(argv[1:])
    raise SystemExit("usage: python -m bench.peers worker --peer NAME ... (driven by `python -m bench speed --peers`)")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
