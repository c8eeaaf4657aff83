"""The one tokenizer wrapper every backend uses: the model's own transformers tokenizer, loaded
from the export folder.

The tokenizer classes the families use (sentencepiece or transformers 5's `tokenizers`-backed)
need no torch, so the ONNX Runtime backends stay torch-free while tokenizing exactly as the
reference does. Which class, and the source language whose code prefixes every source, come from
the sidecar (`manifest.json`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from families import DEFAULT_FAMILY, FAMILIES, tokenizer_classes

from .manifest import source_prefix

# The classes the families use (families/); anything else in a sidecar is refused.
TOKENIZER_CLASSES = tokenizer_classes()


class InputError(ValueError):
    """The user's text cannot be translated as given; the message says why."""


@dataclass(frozen=True)
class EncodedBatch:
    input_ids: np.ndarray  # (b, s) int64, right-padded with pad
    attention_mask: np.ndarray  # (b, s) int64, 1 = token, 0 = pad
    lengths: list[int]  # real tokens per row, eos included


def _sidecar_tokenizer(folder: Path) -> tuple[str, str | None, str | None]:
    """(tokenizer class, source language, source prefix) recorded in the folder's sidecar; without
    one, a model folder of the default family."""
    path = folder / "manifest.json"
    if not path.is_file():
        return FAMILIES[DEFAULT_FAMILY].tokenizer_classes[0], None, None
    data = json.loads(path.read_text(encoding="utf-8"))
    languages = data.get("languages") or {}
    return (data.get("tokenizer") or {}).get("class"), languages.get("src_lang"), source_prefix(languages)


class TokenizerWrapper:
    """`folder`: an export folder (its sidecar names the class and source language) or a model
    folder. `src_lang`: overrides the sidecar's source language (a code the tokenizer knows).
    `source_prefix`: overrides the sidecar's text before every source, the target-language token
    of a family that names its target there (MADLAD-400's "<2zh> ")."""

    def __init__(self, folder: str | Path, src_lang: str | None = None, tokenizer_class: str | None = None,
                 source_prefix: str | None = None):
        folder = Path(folder)
        recorded_class, recorded_lang, recorded_prefix = _sidecar_tokenizer(folder)
        self.source_prefix = source_prefix or recorded_prefix or ""
        self.tokenizer_class = tokenizer_class or recorded_class
        if self.tokenizer_class not in TOKENIZER_CLASSES:
            raise ValueError(
                f"{folder}: tokenizer class {self.tokenizer_class!r} is not supported; "
                f"expected one of: {', '.join(TOKENIZER_CLASSES)}"
            )
        try:
            import transformers
        except ImportError as e:  # pragma: no cover - the pinned environment has it
            raise RuntimeError("tokenizing requires the transformers, tokenizers and sentencepiece packages") from e
        self.src_lang = src_lang or recorded_lang
        cls = getattr(transformers, self.tokenizer_class)
        kwargs = {"src_lang": self.src_lang} if self.src_lang else {}
        self._tok = cls.from_pretrained(str(folder), **kwargs)
        if self.src_lang and self._tok.convert_tokens_to_ids(self.src_lang) in (None, self._tok.unk_token_id):
            raise ValueError(f"{folder}: the tokenizer does not know the source language {self.src_lang!r}")
        self.pad_id = self._tok.pad_token_id
        self.eos_id = self._tok.eos_token_id

    def encode(self, texts: list[str], max_tokens: int) -> EncodedBatch:
        """Tokenize a batch; raise InputError for empty text or text over `max_tokens` (never truncate)."""
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings, not one string")
        if not texts:
            raise InputError("no text given")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise InputError(f"text {i + 1} is empty or whitespace only: nothing to translate")
        # One call for the batch: the same ids as one call per text (tested), in less time. Each
        # row ends with eos (families with language codes: the source's code first).
        rows = self._tok([self.source_prefix + t for t in texts], verbose=False).input_ids
        for i, ids in enumerate(rows):
            if len(ids) > max_tokens:
                raise InputError(
                    f"text {i + 1} is {len(ids)} tokens long; the model reads at most {max_tokens} "
                    "(split it into sentences first)"
                )
        width = max(len(r) for r in rows)
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
        return EncodedBatch(input_ids, attention_mask, [len(r) for r in rows])

    def count_tokens(self, text: str) -> int:
        # Counting text over the limit is the point (to split it): no "longer than the maximum" warning.
        return len(self._tok(self.source_prefix + text, verbose=False).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def pieces(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)


# The name every caller used before other families existed.
MarianTokenizerWrapper = TokenizerWrapper
