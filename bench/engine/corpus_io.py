"""The corpus engine's input: TSV (through `corpus.iter_pairs`), JSONL and Parquet, cut into shards.

A sentence is named by (file, row): its file's position among the input files (a folder's files
sorted by name) and its 0-based data row there. A shard is `shard_size` consecutive rows of one
file; its id (`0000-0000000128`: file 0 from row 128) is fixed by the input and the shard size
alone, so a rerun finds the shards a previous run finished, and the set of ids a run must produce
is known before it starts. Every row is checked before anything is translated (`count_rows`): a
bad row raises `CorpusError` with its file and line (TSV, JSONL) or row (Parquet).

Formats: `.tsv`/`.tsv.gz` with an `en` and a `zh` header (corpus.py's format), `.jsonl`/`.jsonl.gz`
with one object a line holding `en` and `zh` strings, `.parquet` with `en` and `zh` string
columns. Every format needs the reference (`zh`), as `python -m bench quality` always has.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from corpus import CorpusError, Pair, iter_pairs

SUFFIXES = {".tsv": "tsv", ".tsv.gz": "tsv", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet"}
PARQUET_BATCH = 8192  # rows read (and checked) at a time


def file_format(path: Path) -> str | None:
    name = path.name.lower()
    for suffix, fmt in SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    return None


def input_files(path: str | Path) -> list[Path]:
    """The files of one input: a file, or a folder's files in any supported format, sorted by name."""
    path = Path(path).resolve()
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and file_format(p))
        if not files:
            raise CorpusError(f"{path} holds no corpus file; expected any of: {', '.join(SUFFIXES)}")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    if file_format(path) is None:
        raise CorpusError(f"{path}: unknown corpus format; expected any of: {', '.join(SUFFIXES)}")
    return [path]


def _field_problem(value) -> str | None:
    if value is None:
        return "missing"
    if not isinstance(value, str):
        return f"a {type(value).__name__}, not text"
    return None if value.strip() else "empty"


def _jsonl_pairs(path: Path) -> Iterator[Pair]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{number}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict):
                raise CorpusError(f"{path}:{number}: expected a JSON object with `en` and `zh`, got {type(row).__name__}")
            for key in ("en", "zh"):
                if problem := _field_problem(row.get(key)):
                    raise CorpusError(f"{path}:{number}: the `{key}` field is {problem}")
            yield Pair(row["en"].strip(), row["zh"].strip())


def _parquet_pairs(path: Path) -> Iterator[Pair]:
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    names = file.schema_arrow.names
    missing = [c for c in ("en", "zh") if c not in names]
    if missing:
        raise CorpusError(f"{path}: no column {', '.join(missing)} (found: {', '.join(names) or 'nothing'})")
    row = 0
    for batch in file.iter_batches(batch_size=PARQUET_BATCH, columns=["en", "zh"]):
        en, zh = batch.column("en").to_pylist(), batch.column("zh").to_pylist()
        for e, z in zip(en, zh):
            row += 1
            for key, value in (("en", e), ("zh", z)):
                if problem := _field_problem(value):
                    raise CorpusError(f"{path}: row {row}: the `{key}` field is {problem}")
            yield Pair(e.strip(), z.strip())


def iter_file_pairs(path: Path) -> Iterator[Pair]:
    """Every pair of one file, in order; raises CorpusError at the first bad row."""
    fmt = file_format(path)
    if fmt == "tsv":
        return iter_pairs(path, require_zh=True)
    if fmt == "jsonl":
        return _jsonl_pairs(path)
    if fmt == "parquet":
        return _parquet_pairs(path)
    raise CorpusError(f"{path}: unknown corpus format; expected any of: {', '.join(SUFFIXES)}")


def count_rows(files: list[Path], limit: int | None = None) -> list[int]:
    """Rows taken from each file (the first `limit` over all files), every one of them checked."""
    counts, total = [], 0
    for path in files:
        n = 0
        if limit is None or total < limit:
            for _ in iter_file_pairs(path):
                n += 1
                if limit is not None and total + n >= limit:
                    break
        if n == 0 and (limit is None or total < limit):
            raise CorpusError(f"{path} holds no sentences")
        counts.append(n)
        total += n
    return counts


def shard_id(file: int, start: int) -> str:
    return f"{file:04d}-{start:010d}"


def expected_shards(counts: list[int], shard_size: int) -> list[tuple[str, int, int, int]]:
    """(id, file, start, rows) of every shard a run over these files must produce, in corpus order."""
    return [(shard_id(f, start), f, start, min(shard_size, n - start))
            for f, n in enumerate(counts) for start in range(0, n, shard_size)]


def iter_shards(files: list[Path], counts: list[int], shard_size: int, skip: frozenset[str] = frozenset(),
                only_file: int | None = None) -> Iterator[dict]:
    """The shards not in `skip`, in corpus order: {"shard", "file", "start", "en": [...], "zh": [...]}.
    Streams: one shard's rows in memory at a time."""
    for f, (path, n) in enumerate(zip(files, counts)):
        if n == 0 or (only_file is not None and f != only_file):
            continue
        en, zh, start = [], [], 0
        for row, pair in enumerate(iter_file_pairs(path)):
            if row >= n:
                break
            en.append(pair.en)
            zh.append(pair.zh)
            if len(en) == shard_size or row == n - 1:
                if shard_id(f, start) not in skip:
                    yield {"shard": shard_id(f, start), "file": f, "start": start, "en": en, "zh": zh}
                en, zh, start = [], [], row + 1
