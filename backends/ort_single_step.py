"""ORT fp32 single-step: the `full` graph recomputes encoder and decoder over all tokens each step.

The naive migration, kept as the baseline the KV cache is measured against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ort_session import SessionConfig, create_session, session_info


@dataclass
class _State:
    input_ids: np.ndarray  # (b, s)
    attention_mask: np.ndarray  # (b, s)


class FullGraphStepModel:
    def __init__(self, manifest, config: SessionConfig, tables=None):
        path = manifest.verify_graph("full")
        # No arena: every step's tensors are larger than the last (logits are (b, t, V)), so an arena
        # only grows, and keeps its largest size after the request.
        self.session = create_session(path, config, memory_arena=False, tables=tables)
        self.info = session_info(self.session, path, config, "fp32")

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> _State:
        # Nothing to cache: the full graph re-encodes the source at every step.
        return _State(input_ids, attention_mask)

    def expand(self, state: _State, n: int) -> None:
        """Each sentence n times ([s0 x n, s1 x n, ...]) for beam search."""
        state.input_ids = np.repeat(state.input_ids, n, axis=0)
        state.attention_mask = np.repeat(state.attention_mask, n, axis=0)

    def reorder(self, state: _State, beam_idx: np.ndarray) -> None:
        """Nothing cached: every step reads the reordered decoder ids whole. Rows of one sentence
        share its source, so the source rows need no reordering either."""

    def keep(self, state: _State, rows: np.ndarray, parents: np.ndarray | None = None) -> None:
        """Only `rows` go on (finished sentences are dropped). Nothing is cached, so `parents` (the
        rows they continue, of the same sentences) changes nothing here."""
        state.input_ids, state.attention_mask = state.input_ids[rows], state.attention_mask[rows]

    def step(self, state: _State, decoder_ids: np.ndarray) -> np.ndarray:
        (logits,) = self.session.run(
            ["logits"],
            {
                "input_ids": state.input_ids,
                "attention_mask": state.attention_mask,
                "decoder_input_ids": decoder_ids,  # (b, t): every token so far
            },
        )  # (b, t, V)
        return logits[:, -1, :]
