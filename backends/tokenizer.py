"""The one tokenizer wrapper every backend uses: MarianTokenizer from the export folder.

transformers' MarianTokenizer needs sentencepiece, not torch, so the ONNX Runtime backends stay
torch-free while tokenizing exactly as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


class InputError(ValueError):
    """The user's text cannot be translated as given; the message says why."""


@dataclass(frozen=True)
class EncodedBatch:
    input_ids: np.ndarray  # (b, s) int64, right-padded with pad
    attention_mask: np.ndarray  # (b, s) int64, 1 = token, 0 = pad
    lengths: list[int]  # real tokens per row, eos included


class MarianTokenizerWrapper:
    def __init__(self, folder: str | Path):
        try:
            from transformers import MarianTokenizer
        except ImportError as e:  # pragma: no cover - the pinned environment has it
            raise RuntimeError("tokenizing requires the transformers and sentencepiece packages") from e
        self._tok = MarianTokenizer.from_pretrained(str(folder))
        self.pad_id = self._tok.pad_token_id
        self.eos_id = self._tok.eos_token_id

    def encode(self, texts: list[str], max_tokens: int) -> EncodedBatch:
        """Tokenize a batch; raise InputError for empty text or text over `max_tokens` (never truncate)."""
        if isinstance(texts, str):
            raise TypeError("texts must be a list of strings, not one string")
        if not texts:
            raise InputError("no text given")
        rows = []
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise InputError(f"text {i + 1} is empty or whitespace only: nothing to translate")
            ids = self._tok(text).input_ids  # ends with eos
            if len(ids) > max_tokens:
                raise InputError(
                    f"text {i + 1} is {len(ids)} tokens long; the model reads at most {max_tokens} "
                    "(split it into sentences first)"
                )
            rows.append(ids)
        width = max(len(r) for r in rows)
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
        return EncodedBatch(input_ids, attention_mask, [len(r) for r in rows])

    def count_tokens(self, text: str) -> int:
        # Counting text over the limit is the point (to split it): no "longer than the maximum" warning.
        return len(self._tok(text, verbose=False).input_ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def pieces(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)
