"""Filtering the parallel corpus (read through `corpus`, the project's one reader)."""
from __future__ import annotations

import logging
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

from corpus import Pair

logger = logging.getLogger(__name__)

_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_LATIN = re.compile(r"[A-Za-z]")


@dataclass(frozen=True)
class FilterOptions:
    # Character limits: dev is 6–40 English words; the long tail (up to 1000+ chars of licence
    # text) costs quadratic attention time for little gain on this budget.
    max_en_chars: int = 400
    max_zh_chars: int = 250
    # zh/en character ratio is about 0.35 for real translations; outside these bounds rows are
    # mostly misalignments (a paragraph id pointing at a heading) in libreoffice_help.
    min_ratio: float = 0.08
    max_ratio: float = 2.0
    # The ratio test is noisy for short UI labels ("Tip" → "小技巧"), so only apply it above this.
    ratio_min_en_chars: int = 20


def _norm(text: str) -> str:
    # NFC only: NFKC would turn Chinese full-width punctuation (，：？) into ASCII, unlike the references.
    return " ".join(unicodedata.normalize("NFC", text).split())


def filter_pairs(pairs: list[Pair], opts: FilterOptions = FilterOptions()) -> tuple[list[Pair], dict]:
    """Return kept pairs and a count of why the others were dropped.

    Kept deliberately: placeholders (`%s`, `{0}`, `%(name)s`) so the model learns to copy them
    unchanged, and LibreOffice's 「」 around UI names, because the LibreOffice dev references use
    them too (33 of 500 dev rows).
    """
    dropped: Counter = Counter()
    seen: set[tuple[str, str]] = set()
    kept = []
    for p in pairs:
        en, zh = _norm(p.en), _norm(p.zh)
        if not en or not zh:
            dropped["empty"] += 1
            continue
        if len(en) > opts.max_en_chars or len(zh) > opts.max_zh_chars:
            dropped["too_long"] += 1
            continue
        if not _CJK.search(zh) and len(en.split()) >= 3:
            # An untranslated string (the catalog fell back to English) teaches copying.
            dropped["untranslated"] += 1
            continue
        if len(en) >= opts.ratio_min_en_chars:
            ratio = len(zh) / len(en)
            if not opts.min_ratio <= ratio <= opts.max_ratio:
                dropped["length_ratio"] += 1
                continue
        key = (en.lower(), zh)
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        kept.append(Pair(en, zh, p.source))
    stats = {"read": len(pairs), "kept": len(kept), "dropped": dict(sorted(dropped.items()))}
    logger.info("filter: %s", stats)
    return kept, stats


def dev_key(text: str) -> str:
    """A side folded for the train/dev disjointness check: NFKC, lower case, no spaces or punctuation.

    No training pair may share a folded English or a folded Chinese side with a dev pair.
    """
    return re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", text).lower())


def is_tatoeba(source: str) -> bool:
    return source == "tatoeba"
