"""The engine contract every backend implements: `StepModel`.

A backend is a tokenizer plus a `StepModel` (how next-token logits are produced). Everything else,
the decoding loop (greedy and beam search), stop rules, masks, timings and scores, lives in
`decoding.py` and is written once.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class StepModel(Protocol):
    """The engine behind a backend: encode once, then produce next-token logits per step.

    Beam search also needs `expand` and `reorder`; both searches call `keep` where the engine has it.
    """

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Any:
        """input_ids, attention_mask: (b, s) int64 -> an opaque per-batch decoding state."""

    def step(self, state: Any, decoder_ids: np.ndarray) -> np.ndarray:
        """decoder_ids: (b, t) every token so far, start token first -> logits (b, V) float32."""

    def expand(self, state: Any, n: int) -> None:
        """Repeat each sentence's state n times, once, before the first step: rows [s0 x n, s1 x n, ...]."""

    def reorder(self, state: Any, beam_idx: np.ndarray) -> None:
        """beam_idx: (rows,) int64; row i continues from row beam_idx[i] (its cache and positions)."""

    def keep(self, state: Any, rows: np.ndarray, parents: np.ndarray | None = None) -> None:
        """Optional: only these rows (ascending indices into the current ones) go on; the others'
        sentences are finished (beam search: every beam of a sentence together). Without it,
        finished rows are computed to the end. `parents` (beam search): kept row i continues from
        current row parents[i] of the same sentence, i.e. `reorder` in the same copy."""


def sentences_of(rows: np.ndarray, n: int) -> np.ndarray | None:
    """The sentences of `rows` (ascending indices into rows [s0 x n, s1 x n, ...]) when they are every
    beam of each of them, in order; None when a sentence is there with only some of its beams."""
    sentences = rows[::n] // n
    whole = np.array_equal(rows, (sentences[:, None] * n + np.arange(n)).reshape(-1))
    return sentences if whole else None


def beams_are_copies(decoder_ids: np.ndarray, n: int) -> bool:
    """Whether each sentence's n rows of decoder_ids ([s0 x n, s1 x n, ...]) are one row n times:
    before a beam has chosen a token they are, and an engine may run a step once per sentence."""
    return n > 1 and np.array_equal(decoder_ids, np.repeat(decoder_ids[::n], n, axis=0))
