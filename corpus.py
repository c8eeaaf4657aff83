"""The one reader of parallel-corpus files: TSV (optionally gzip-compressed) and plain text.

Every part of the project (export verification, fixtures, benchmarks, training, the app's
examples and spot-check uploads, the tests) reads sentences through here, so a bad row is
treated the same everywhere: it raises `CorpusError` naming the file and the line, never skipped.

Format (data/SOURCES.md): UTF-8, tab-separated, one header line naming the columns; `en` is
required, `zh` (a reference translation) and `source` (where the pair came from) are optional.
No quoting: fields may hold `"` but never tabs or newlines. Plain-text files (`.txt`) hold one
English sentence per non-empty line.

The repository's own data lives in data/ (dev.tsv, train.tsv.gz, their licences): nothing here
reads a folder outside the repository.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent
DATA = REPO / "data"
DEV_TSV = DATA / "dev.tsv"  # 500 held-out pairs: checkpoint selection, verification, benchmarks
TRAIN_TSV = DATA / "train.tsv.gz"  # 148,834 training pairs; never overlaps dev.tsv
REFERENCE_CONFIG = DATA / "reference" / "opus-mt-en-zh" / "config.json"  # the published model's shape

KNOWN_COLUMNS = ("source", "en", "zh")


class CorpusError(ValueError):
    """A corpus file (or pasted text) that does not follow the format; names the file and line."""


@dataclass(frozen=True)
class Pair:
    en: str
    zh: str | None = None  # the reference translation, when the file has one
    source: str | None = None  # where the pair came from (train.tsv's `source` column)


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open(encoding="utf-8")


def parse_tsv_lines(
    lines: Iterable[str],
    name: str,
    *,
    require_zh: bool = False,
    skip_blank: bool = False,
    problems: list[str] | None = None,
) -> Iterator[Pair]:
    """Pairs from TSV lines (header first); raises CorpusError at the first bad row.

    A row must have exactly as many fields as the header and a non-empty `en` (and `zh` when
    `require_zh`). Blank lines are errors too: in a corpus they mean a broken file.

    For text a person pasted or uploaded (the app's spot-check): `skip_blank` skips blank lines,
    before the header too, while line numbers still count them; `problems`, when given, collects
    every bad row's message (the row left out) instead of raising at the first, so the caller can
    name them all at once. A bad header always raises.
    """
    numbered: Iterator[tuple[int, str]] = enumerate(lines, start=1)
    if skip_blank:
        numbered = ((n, line) for n, line in numbered if line.strip())
    try:
        head, first = next(numbered)
    except StopIteration:
        raise CorpusError(f"{name}: the file is empty; expected a header row naming an `en` column") from None
    header = [h.strip() for h in first.rstrip("\r\n").lstrip("\ufeff").split("\t")]
    if "en" not in header:
        raise CorpusError(f"{name}:{head}: the header has no `en` column (found: {', '.join(header) or 'nothing'})")
    if require_zh and "zh" not in header:
        raise CorpusError(f"{name}:{head}: the header has no `zh` column with reference translations")
    unknown = [h for h in header if h not in KNOWN_COLUMNS]
    if unknown:
        raise CorpusError(
            f"{name}:{head}: unknown column(s) {', '.join(unknown)}; expected any of: {', '.join(KNOWN_COLUMNS)}"
        )
    index = {h: i for i, h in enumerate(header)}
    for number, line in numbered:
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) != len(header):
            error = f"expected {len(header)} tab-separated fields ({', '.join(header)}), got {len(fields)}"
        elif not fields[index["en"]].strip():
            error = "the `en` field is empty"
        elif require_zh and not fields[index["zh"]].strip():
            error = "the `zh` field is empty"
        else:
            zh = fields[index["zh"]].strip() if "zh" in index else None
            yield Pair(fields[index["en"]].strip(), zh, fields[index["source"]] if "source" in index else None)
            continue
        if problems is None:
            raise CorpusError(f"{name}:{number}: {error}")
        problems.append(f"{name}:{number}: {error}")


def iter_pairs(path: str | Path, *, require_zh: bool = False) -> Iterator[Pair]:
    """Stream the pairs of a `.tsv` / `.tsv.gz` file, one at a time (never the whole file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    with _open_text(path) as f:
        yield from parse_tsv_lines(f, str(path), require_zh=require_zh)


def read_pairs(path: str | Path, *, require_zh: bool = False, limit: int | None = None) -> list[Pair]:
    """Every pair of a TSV file (or the first `limit`); raises CorpusError on a bad row."""
    out = []
    for pair in iter_pairs(path, require_zh=require_zh):
        if limit is not None and len(out) >= limit:
            break
        out.append(pair)
    return out


def read_sentences(path: str | Path) -> list[Pair]:
    """A `.tsv`/`.tsv.gz` with an `en` header (and maybe `zh`), or plain text, one sentence a line."""
    path = Path(path)
    if path.name.endswith((".tsv", ".tsv.gz")):
        pairs = read_pairs(path)
    else:
        if not path.is_file():
            raise FileNotFoundError(f"sentence file not found: {path}")
        with _open_text(path) as f:
            pairs = [Pair(line.strip()) for line in f if line.strip()]
    if not pairs:
        raise CorpusError(f"{path} holds no sentences")
    return pairs


def dev_pairs(limit: int | None = None) -> list[Pair]:
    """The held-out dev set (data/dev.tsv), in file order."""
    return read_pairs(DEV_TSV, require_zh=True, limit=limit)


def dev_sentences(limit: int | None = None) -> list[str]:
    """The English side of the first `limit` dev pairs."""
    return [p.en for p in dev_pairs(limit)]


def train_pairs() -> Iterator[Pair]:
    """The training pairs (data/train.tsv.gz), streamed."""
    return iter_pairs(TRAIN_TSV, require_zh=True)


SAMPLE_WORDS = (10, 40)  # inclusive range of English words per sentence of `default_sample`


def default_sample(count: int = 200, tsv: str | Path = DEV_TSV, seed: int = 0) -> list[Pair]:
    """`count` pairs of 10-40 English words from `tsv` (the dev set), drawn with a fixed seed;
    fewer if the file has fewer. The sentences `python -m bench speed` and `bench load` send, and
    the app's quick benchmark starts with."""
    import random

    eligible = [p for p in read_pairs(tsv) if SAMPLE_WORDS[0] <= len(p.en.split()) <= SAMPLE_WORDS[1]]
    if not eligible:
        raise ValueError(f"{tsv} has no sentence of {SAMPLE_WORDS[0]}-{SAMPLE_WORDS[1]} words")
    return random.Random(seed).sample(eligible, min(count, len(eligible)))
