"""python -m bench.parity EXPORT_DIR: greedy ids of every backend against PyTorch on dev sentences.

The export's own verification runs 16 sentences; this is the larger check a user runs before
shipping: by default the first 100 English sentences of data/dev.tsv.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backends import APPROXIMATE, BACKEND_NAMES, REFERENCE, SessionConfig, load_backends
from backends.divergence import parity_report
from corpus import DEV_TSV, read_pairs


def run(
    export_dir: Path,
    sentences: list[str],
    max_new_tokens: int,
    batch_size: int,
    threads: int | None,
    names: tuple[str, ...] = BACKEND_NAMES,
    **decode,
) -> dict:
    """The report of `backends.divergence.parity_report` (the export's own greedy check, at a larger
    size); `decode` options go to `Backend.translate` with `max_new_tokens`."""
    if REFERENCE not in names:
        names = (REFERENCE, *names)
    backends = load_backends(export_dir, names=names, session=SessionConfig(threads=threads))
    try:
        report = parity_report(backends, sentences, REFERENCE, batch_size, max_new_tokens=max_new_tokens, **decode)
    finally:
        for backend in backends.values():
            backend.close()
    return {"export": str(export_dir), **report}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("--tsv", type=Path, default=DEV_TSV, help="TSV with an `en` column")
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--backends", default=",".join(BACKEND_NAMES), help="comma-separated; pytorch is always run")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    names = tuple(n for n in args.backends.split(",") if n)
    sentences = [p.en for p in read_pairs(args.tsv, limit=args.sentences)]
    report = run(args.export_dir, sentences, args.max_new_tokens, args.batch_size, args.threads, names)
    for name, r in report["backends"].items():
        print(
            f"{name}: identical ids {r['identical_ids']}/{report['sentences']}, "
            f"identical text {r['identical_text']}/{report['sentences']} ({r['seconds']} s; pytorch {report['reference_seconds']} s)"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
    fp32 = [r for n, r in report["backends"].items() if n not in APPROXIMATE]
    return 0 if all(r["identical_ids"] == report["sentences"] for r in fp32) else 1


if __name__ == "__main__":
    raise SystemExit(main())
