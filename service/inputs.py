"""Sentences for the spot-check, from pasted text or an uploaded file; every problem named up front.

Pasted text is one English sentence per line, or a tab-separated table whose first line is a header
naming an `en` column (and `zh` for references), as copied from a corpus TSV. Files: `.txt`, one
sentence per line; `.tsv`, a header row with `en` and optionally `zh`. A table is read by the one
corpus reader (`corpus.parse_tsv_lines`), so it follows the corpus format (data/SOURCES.md): the
columns `source`, `en`, `zh`, every row with as many fields as the header. Blank lines are skipped;
nothing else is dropped or cut: a row without text, or without a reference when the table has a
`zh` column, is an error with its line number, and every such row is named at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from corpus import CorpusError, parse_tsv_lines

FILE_TYPES = (".txt", ".tsv")
MAX_FILE_BYTES = 1_000_000  # far above 200 sentences; keeps a wrong upload from being read whole
SHOWN = 10  # problems listed in one message before "and N more"

HOW = (
    "paste English sentences, one per line (or a tab-separated table with a header row naming `en` and `zh`), "
    "or upload a .txt (one sentence per line) or .tsv file (header row with `en`, optionally `zh`)"
)


@dataclass(frozen=True)
class Sentences:
    en: list[str]
    zh: list[str] | None  # one reference per sentence when the input has a `zh` column
    source: str  # where they came from, said in the report


def _listed(problems: list[str]) -> str:
    more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return "; ".join(problems[:SHOWN]) + more


def from_text(text: str | None, source: str = "pasted text") -> Sentences:
    lines = (text or "").lstrip("\ufeff").splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is None:
        raise ValueError(f"no sentences: {HOW}")
    if "\t" in lines[first]:  # a table copied from a TSV: its first line must be the header
        return _table(lines, source)
    tabbed = [str(i + 1) for i, line in enumerate(lines) if "\t" in line]
    if tabbed:
        raise ValueError(
            f"{source}: line(s) {', '.join(tabbed[:SHOWN])} hold tabs but the first line is not a header; "
            "for references give a header row naming the `en` and `zh` columns, else one sentence per line"
        )
    return Sentences([line.strip() for line in lines if line.strip()], None, source)


def _table(lines: list[str], source: str) -> Sentences:
    """A table: its first non-blank line is the header row; with a `zh` column every row needs a reference."""
    header = next(line for line in lines if line.strip())
    has_zh = "zh" in [h.strip() for h in header.split("\t")]
    problems: list[str] = []
    try:
        pairs = list(parse_tsv_lines(lines, source, require_zh=has_zh, skip_blank=True, problems=problems))
    except CorpusError as e:  # the header row
        raise ValueError(f"{e}. A table's first line is its header row: name the columns `en`, and `zh` for "
                         "references") from None
    if problems:
        raise ValueError(_listed(problems))
    if not pairs:
        raise ValueError(f"{source}: a header row and no sentences")
    return Sentences([p.en for p in pairs], [p.zh for p in pairs] if has_zh else None, source)


def from_file(path: str | Path) -> Sentences:
    path = Path(path)
    name, suffix = path.name, path.suffix.lower()
    if suffix not in FILE_TYPES:
        raise ValueError(f"{name}: expected one of {', '.join(FILE_TYPES)}: {HOW}")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{name} is {size / 1e6:.1f} MB; files up to {MAX_FILE_BYTES / 1e6:.0f} MB are read")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name} is not UTF-8 text (undecodable byte at offset {e.start}); save it as UTF-8") from e
    if suffix == ".tsv":
        lines = text.lstrip("\ufeff").splitlines()
        if not any(line.strip() for line in lines):
            raise ValueError(f"{name} is empty: {HOW}")
        return _table(lines, name)
    if "\t" in text:  # a table saved as .txt: reading it as sentences would translate the other columns too
        line = next(i + 1 for i, x in enumerate(text.splitlines()) if "\t" in x)
        raise ValueError(f"{name}: line {line} holds a tab; a table with references goes in a .tsv with a header row")
    if not text.strip():
        raise ValueError(f"{name} is empty: {HOW}")
    return from_text(text, name)


def read(text: str | None, file: str | Path | None) -> Sentences:
    """The one input the user gave: pasted text or a file, not both (which one was meant is unclear)."""
    if file and text and text.strip():
        raise ValueError("both pasted text and a file were given: clear one of them")
    if file:
        return from_file(file)
    return from_text(text)
