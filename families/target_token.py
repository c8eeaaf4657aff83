"""Families whose target language is a token before the source text (MADLAD-400: "<2zh> " + text):
the codes a vocabulary holds, and a tokenizer that puts the chosen token first.

Standard library only (see `family.py`): the exporter, the backends and the peers' environment
(another transformers) all tokenize through it.
"""

from __future__ import annotations

import re


def target_codes(vocabulary: dict[str, int], template: str) -> dict[str, int]:
    """{code: id} of the vocabulary's tokens of the form `template` ("<2{}>": <2zh>, <2de>...), sorted by code."""
    prefix, suffix = template.split("{}")
    form = re.compile(re.escape(prefix) + r"([A-Za-z][A-Za-z0-9_-]*)" + re.escape(suffix))
    found = {}
    for token, i in vocabulary.items():
        match = form.fullmatch(token)
        if match:
            found[match.group(1)] = int(i)
    return dict(sorted(found.items()))


def source_prefix(template: str, tgt_lang: str) -> str:
    """The text before every source: the target's token and a space, as MADLAD-400 is prompted."""
    return template.format(tgt_lang) + " "


class TargetPrefixed:
    """A transformers tokenizer with `prefix` before every text it encodes; everything else is the
    tokenizer's own (decoding, ids, save_pretrained)."""

    def __init__(self, tokenizer, prefix: str):
        self._tokenizer = tokenizer
        self.prefix = prefix

    def __call__(self, text, *args, **kwargs):
        texts = self.prefix + text if isinstance(text, str) else [self.prefix + t for t in text]
        return self._tokenizer(texts, *args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)
