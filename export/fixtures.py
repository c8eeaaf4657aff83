"""Local model folders for tests and benchmarks, one recipe per fixture: no hub needed.

Each family lists its recipes in its registry entry (families/): random weights with the
family's configuration and a working tokenizer trained on a corpus sample.
- `tiny` (Marian): a two-layer model small enough to export in seconds, for the test suite.
- `opus-mt-random` (Marian): opus-mt-en-zh's exact configuration and a 65001-id tokenizer, the
  speed and memory fixture at real scale.
- `nllb-tiny`, `nllb-600m-random` (M2M100/NLLB), `mbart50-tiny` (mBART-50).

`python -m export.fixtures NAME --out DIR` writes one.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from corpus import TRAIN_TSV, read_pairs as read_corpus

from families import fixtures

# name -> recipe (`sample_pairs`, `build(folder, pairs, seed)`), every family's.
FIXTURES = fixtures()


def read_pairs(path: Path, limit: int, seed: int = 0) -> list[tuple[str, str]]:
    """Sample `limit` (en, zh) pairs of a corpus TSV (data/train.tsv.gz by default) with a fixed seed."""
    pairs = [(p.en, p.zh) for p in read_corpus(path, require_zh=True)]
    random.Random(seed).shuffle(pairs)
    return pairs[:limit]


def build(name: str, out: Path, corpus: Path = TRAIN_TSV, seed: int = 0, force: bool = False) -> Path:
    """Build fixture `name` into `out` (written to a temporary folder, then renamed)."""
    if name not in FIXTURES:
        raise ValueError(f"unknown fixture {name!r}; expected one of: {', '.join(FIXTURES)}")
    recipe = FIXTURES[name]
    out = Path(out)
    if out.exists():
        if not force:
            raise FileExistsError(f"{out} exists; pass --force to replace it")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        recipe.build(tmp, read_pairs(corpus, recipe.sample_pairs, seed), seed)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.fixtures", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(FIXTURES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, default=TRAIN_TSV, help="training pairs TSV (default data/train.tsv.gz)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = build(args.name, args.out, args.corpus, args.seed, args.force)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import numpy as np
    from safetensors import safe_open

    # Counted from the file's tensor shapes (tied weights stored once), without loading the model.
    with safe_open(str(path / "model.safetensors"), "np") as f:
        n = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    print(f"wrote {args.name} to {path}: {n / 1e6:.1f}M parameters ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
