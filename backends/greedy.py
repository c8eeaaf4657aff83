"""Greedy search, the token decoder for num_beams=1 (as whisper's GreedyDecoder).

Each step `decode` hands it the (rows, V) logits; it applies the processors to the raw logits and
takes the argmax, as transformers 5.24 `generate()`'s `_sample` does, token for token.
"""

from __future__ import annotations

import numpy as np

from .generation import GenerationDefaults, SpecialTokens
from .options import DecodeOptions
from .processors import logits_processors, prepare
from .results import RowResult, StepScore, longest_run
from .scoring import greedy_scores


class GreedyDecoder:
    """generate(num_beams=1): the processors act on the raw logits, then the argmax."""

    width = 1

    def __init__(self, batch: int, special: SpecialTokens, options: DecodeOptions, rules: GenerationDefaults, threads: int):
        self.special, self.options, self.threads = special, options, threads
        self.processors = logits_processors(special, options, rules, beams=False)
        self.batch = batch
        self.finished = np.zeros(batch, dtype=bool)
        # Per step, arrays over the rows that were still running: (batch rows, tokens, non-finite,
        # top ids, top log-probs). Per-row objects are built once, in `finish`: built per step
        # they would cost a visible share of a batched step.
        self.records: list[tuple[np.ndarray, ...]] = []

    def update(
        self, step: int, decoder_ids: np.ndarray, logits: np.ndarray, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, None, bool]:
        """logits (r, V), a fresh array (a view of the engine's output) masked and consumed in
        place, for the rows `rows` of decoder_ids (None: all b of them; the loop drops finished
        rows from the engine) -> (decoder ids (b, t + 1), no reordering, whether every row is finished)."""
        special = self.special
        ids = decoder_ids if rows is None else decoder_ids[rows]  # (r, t)
        finished = self.finished if rows is None else self.finished[rows]  # (r,) a copy when rows is given
        prepare(self.processors, step, ids)
        bad_rows, top, top_logprobs = greedy_scores(
            logits, finished, self.processors, self.options.top_k, self.threads, self.options.output_scores
        )  # (r,), (r, k), (r, k) float64 or None
        picked = top[:, 0].copy()
        picked[finished] = special.pad
        index = np.arange(len(picked)) if rows is None else rows  # each computed row's row of the batch
        live = np.flatnonzero(~finished)
        self.records.append((
            index[live], picked[live], bad_rows[live],
            None if top_logprobs is None else top[live], None if top_logprobs is None else top_logprobs[live],
        ))
        next_ids = np.full(decoder_ids.shape[0], special.pad, dtype=decoder_ids.dtype)
        next_ids[index] = picked
        self.finished[index] |= picked == special.eos
        return np.concatenate([decoder_ids, next_ids[:, None]], axis=1), None, bool(self.finished.all())

    def alive_rows(self) -> np.ndarray:
        """The rows the engine must still compute: every unfinished sentence's."""
        return np.flatnonzero(~self.finished)

    def _per_row(self) -> tuple[list[list[int]], list[list[StepScore]], list[list[int]]]:
        """The step records regrouped by sentence: token ids, StepScores (empty without scores),
        non-finite steps."""
        b = self.batch
        ids: list[list[int]] = [[] for _ in range(b)]
        steps: list[list[StepScore]] = [[] for _ in range(b)]
        non_finite: list[list[int]] = [[] for _ in range(b)]
        if not self.records:
            return ids, steps, non_finite
        rows = np.concatenate([r[0] for r in self.records])
        order = np.argsort(rows, kind="stable")  # by sentence, steps in order within each
        step_of = np.concatenate([np.full(len(r[0]), i) for i, r in enumerate(self.records)])[order]
        tokens = np.concatenate([r[1] for r in self.records])[order].tolist()
        bad = np.concatenate([r[2] for r in self.records])[order]
        edges = np.searchsorted(rows[order], np.arange(b + 1)).tolist()
        if self.options.output_scores:
            top = np.concatenate([r[3] for r in self.records])[order]
            top_lp = np.concatenate([r[4] for r in self.records])[order]
            records = [
                StepScore(t, lp[0], ti, lp)
                for t, ti, lp in zip(tokens, top.tolist(), top_lp.tolist())
            ]
        for row in range(b):
            lo, hi = edges[row], edges[row + 1]
            ids[row] = tokens[lo:hi]
            if self.options.output_scores:
                steps[row] = records[lo:hi]
            non_finite[row] = step_of[lo:hi][bad[lo:hi]].tolist()
        return ids, steps, non_finite

    def finish(self, timings: dict[str, float]) -> list[RowResult]:
        eos, penalty = self.special.eos, self.options.length_penalty
        results = []
        for ids, steps, non_finite in zip(*self._per_row()):
            score = sum(s.logprob for s in steps) / len(ids) ** penalty if steps else None
            results.append(
                RowResult(
                    token_ids=ids,
                    scores=steps,
                    stop_reason="eos" if ids and ids[-1] == eos else "max_new_tokens",
                    timings_ms=timings,
                    non_finite_steps=non_finite,
                    repeated_run=longest_run(ids),
                    score=score,
                    hypotheses=[(ids, score)],
                )
            )
        return results
