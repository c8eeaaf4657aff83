"""Text of any length -> sentence-sized segments the model can read, and back.

Marian models translate sentences: the text is split at sentence ends and line breaks, a
sentence over the model's source limit is cut into chunks at word boundaries (or, for one
endless "word", at characters), the segments run as one batch, and the outputs are joined in
order. Nothing is dropped: every character of the input lies in exactly one segment, apart from
the whitespace between them, and the segments are returned so the user sees the split.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Callable

# A sentence ends after . ! ? ; … (or their full-width forms) plus any closing quotes/brackets,
# where whitespace follows; full-width enders end a sentence even without whitespace. Line
# breaks always end a segment.
_BOUNDARY = re.compile(r"(?<=[.!?;…])[\"'”’)\]]*\s+|(?<=[。！？；])[”’」』）]*\s*|\n+")


@dataclass(frozen=True)
class Segment:
    text: str
    start: int  # character offsets in the original text
    end: int
    chunked: bool = False  # a piece of a sentence that alone exceeded the source limit


def clean(text: str) -> str:
    """Drop control characters (NUL included) that carry no meaning for translation; keep newlines
    and tabs as whitespace. Everything else, emoji and right-to-left text included, goes through."""
    return "".join(
        ch if ch in "\n\t" or unicodedata.category(ch)[0] != "C" or unicodedata.category(ch) == "Cf" else " "
        for ch in text
    )


def _sentences(text: str) -> list[tuple[int, int]]:
    spans, start = [], 0
    for m in _BOUNDARY.finditer(text):
        end = m.start() if m.group(0).isspace() else m.end()
        spans.append((start, end))
        start = m.end()
    spans.append((start, len(text)))
    out = []
    for s, e in spans:
        while s < e and text[s].isspace():
            s += 1
        while e > s and text[e - 1].isspace():
            e -= 1
        if e > s:
            out.append((s, e))
    return out


def _largest_prefix(units: list[tuple[int, int]], fits: Callable[[int], bool]) -> int:
    """The most leading units that fit (binary search; at least 1)."""
    lo, hi = 1, len(units)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _chunk(text: str, start: int, end: int, count_tokens: Callable[[str], int], max_tokens: int) -> list[Segment]:
    """Cut text[start:end] into pieces of at most max_tokens tokens, at spaces where possible."""
    pieces = []
    while start < end:
        if count_tokens(text[start:end]) <= max_tokens:
            pieces.append(Segment(text[start:end], start, end, chunked=True))
            break
        words = [(m.start() + start, m.end() + start) for m in re.finditer(r"\S+", text[start:end])]
        n = _largest_prefix(words, lambda k: count_tokens(text[start : words[k - 1][1]]) <= max_tokens)
        if n == 1 and count_tokens(text[start : words[0][1]]) > max_tokens:
            # One "word" longer than the limit: cut it at characters.
            chars = [(i, i + 1) for i in range(words[0][0], words[0][1])]
            n_chars = _largest_prefix(chars, lambda k: count_tokens(text[start : chars[k - 1][1]]) <= max_tokens)
            cut = chars[n_chars - 1][1]
        else:
            cut = words[n - 1][1]
        pieces.append(Segment(text[start:cut], start, cut, chunked=True))
        start = cut
        while start < end and text[start].isspace():
            start += 1
    return pieces


def split_text(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> list[Segment]:
    """Sentences of `text`, each within `max_tokens` (eos included), in order."""
    segments = []
    for s, e in _sentences(text):
        if count_tokens(text[s:e]) <= max_tokens:
            segments.append(Segment(text[s:e], s, e))
        else:
            segments.extend(_chunk(text, s, e, count_tokens, max_tokens))
    return segments


def join_translations(texts: list[str]) -> str:
    """Chinese needs no space between sentences; keep one where two Latin-script ends would touch."""
    out = ""
    for t in texts:
        if out and t and out[-1].isascii() and out[-1].isalnum() and t[0].isascii() and t[0].isalnum():
            out += " "
        out += t
    return out
