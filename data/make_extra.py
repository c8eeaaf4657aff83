"""Rebuild data/extra.tsv.gz from the Debian game packages' Simplified Chinese catalogs.

    apt-get download wesnoth-1.16-data freeciv-data
    for f in *.deb; do dpkg -x "$f" x/; done
    python data/make_extra.py x/usr/share/games/wesnoth/1.16/locale/zh_CN/LC_MESSAGES/*.mo \
        x/usr/share/locale/zh_CN/LC_MESSAGES/freeciv-*.mo

Each msgid/msgstr pair is cleaned (Wesnoth's `context^` and Freeciv's `?context:` prefixes,
GTK mnemonics `_F` / `(_F)`), rows with markup are dropped, the rest go through the training
filter (train/data.py); then every pair whose normalised English OR Chinese side equals one of
data/dev.tsv's is dropped, and so is every pair already in data/train.tsv.gz.
Written with gzip -9 and no timestamp, so the same input gives the same bytes.
"""
from __future__ import annotations

import gettext
import gzip
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from corpus import DATA, DEV_TSV, TRAIN_TSV, Pair, read_pairs  # noqa: E402
from train.data import dev_key, filter_pairs  # noqa: E402

OUT = DATA / "extra.tsv.gz"
_MARKUP = re.compile(r"[<>\[\]~{}@#\\|]|&\w+;")
_CJK = re.compile(r"[\u3400-\u9fff]")


def catalog_pairs(mo: Path):
    with mo.open("rb") as f:
        catalog = gettext.GNUTranslations(f)._catalog
    for en, zh in catalog.items():
        if isinstance(en, tuple):  # plural forms: keep the singular
            if en[1] != 0:
                continue
            en = en[0]
        if en and zh:
            yield en.split("\x04", 1)[-1], zh


def clean(source: str, en: str, zh: str) -> tuple[str, str]:
    if source == "deb_wesnoth" and "^" in en:
        en = en.split("^", 1)[1]
    if source == "deb_freeciv" and en.startswith("?") and ":" in en:
        en = en.split(":", 1)[1]
    zh = re.sub(r"\(_[A-Za-z0-9]\)", "", zh).replace("_", "")
    en = re.sub(r"_(?=[A-Za-z0-9])", "", en)
    return " ".join(en.split()), " ".join(zh.split())


def main(mo_files: list[str]) -> None:
    rows = []
    for name in mo_files:
        source = "deb_wesnoth" if "wesnoth" in name else "deb_freeciv"
        for en, zh in catalog_pairs(Path(name)):
            en, zh = clean(source, en, zh)
            if en and zh and en != zh and not _MARKUP.search(en + zh) and _CJK.search(zh) \
                    and re.search(r"[A-Za-z]{2}", en):
                rows.append(Pair(en, zh, source))
    kept, stats = filter_pairs(rows)
    dev = read_pairs(DEV_TSV, require_zh=True)
    dev_en, dev_zh = {dev_key(p.en) for p in dev}, {dev_key(p.zh) for p in dev}
    train = {(p.en.lower(), p.zh) for p in read_pairs(TRAIN_TSV, require_zh=True)}
    out = [p for p in kept if dev_key(p.en) not in dev_en and dev_key(p.zh) not in dev_zh
           and (p.en.lower(), p.zh) not in train]
    print(stats, f"{len(kept) - len(out)} dropped (dev overlap or in train.tsv), {len(out)} written", file=sys.stderr)
    with gzip.GzipFile(OUT, "wb", compresslevel=9, mtime=0) as f:
        f.write(("source\ten\tzh\n" + "".join(f"{p.source}\t{p.en}\t{p.zh}\n" for p in out)).encode())


if __name__ == "__main__":
    main(sys.argv[1:])
