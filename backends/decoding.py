"""The one decoding loop every backend shares, and teacher-forced scoring.

Backends differ only in how a `StepModel` turns the tokens so far into next-token logits. The
start token, the logits processors (`processors.py`), eos / length stops, per-step scores and
timings are decided by the loop and its token decoders (`greedy.py`, `beam_search.py`), so a
difference between backends is a difference in their numbers.

`decode` is the loop (as whisper's `DecodingTask.run`): encode once, expand per beam, then one
`step` per token; a token decoder picks the next tokens and says which rows continue which; the
engine reorders its cache by that index and drops finished sentences (`RowCompaction`), while
`EngineClock` keeps the time spent inside the engine apart from the loop's own.
"""

from __future__ import annotations

import time

import numpy as np

from .base import StepModel
from .beam_search import BeamSearchDecoder
from .generation import GenerationDefaults, SpecialTokens
from .greedy import GreedyDecoder
from .options import DecodeOptions
from .results import ForcedScores, RowResult
from .scoring import _top_k, log_softmax

__all__ = ["RowResult", "decode", "forced_scores"]

# Finished sentences leave the engine once they are a quarter of the rows it still computes (at
# least one sentence): each drop copies every cache tensor, which costs more than computing a
# finished row for a few more steps, and sentences of a length-sorted batch end steps apart. Beam
# search copies its self-attention cache at every step anyway (the reorder), so its drops ride on
# that copy and happen as soon as one sentence is done.
_KEEP_FRACTION = 4


class EngineClock:
    """Seconds spent inside the engine (its graphs / modules), the loop's own work excluded."""

    def __init__(self):
        self.seconds = 0.0

    def run(self, fn, *args):
        t = time.perf_counter()
        out = fn(*args)
        self.seconds += time.perf_counter() - t
        return out


class RowCompaction:
    """Which rows of decoder_ids the engine still computes, and dropping the finished ones.

    A finished sentence is dropped from the engine (as CTranslate2 does): greedy search's row would
    only produce pad, beam search's beams nothing its result reads (`BeamSearchDecoder.alive_rows`).
    Rows are independent, so the others' numbers do not change.
    """

    def __init__(self, model: StepModel, batch: int):
        self.model = model
        self.enabled = batch > 1 and callable(getattr(model, "keep", None))
        self.rows: np.ndarray | None = None  # ascending; None: all of them

    def ids(self, decoder_ids: np.ndarray) -> np.ndarray:
        return decoder_ids if self.rows is None else decoder_ids[self.rows]

    def advance(self, state, decoder, beam_idx: np.ndarray | None, total_rows: int, clock: EngineClock) -> None:
        """After a step: beam search's reorder (beam_idx over every row of decoder_ids; a row's
        parent is a row of the same sentence, so among those the engine holds), and the drop of
        finished sentences, in one call to the engine when both are due."""
        current = np.arange(total_rows) if self.rows is None else self.rows
        local = None if beam_idx is None else np.searchsorted(current, beam_idx[current])
        if self.enabled:
            alive = decoder.alive_rows()
            finished = len(current) - len(alive)
            least = 1 if local is not None else max(1, len(current) // _KEEP_FRACTION)
            if finished >= least:
                kept = np.searchsorted(current, alive)
                clock.run(self.model.keep, state, kept, None if local is None else local[kept])
                self.rows = alive
                return
        if local is not None and not np.array_equal(local, np.arange(len(local))):
            clock.run(self.model.reorder, state, local)


def _timings(start: float, encoded: float, first_token: float | None, end: float, steps: int, engine: float):
    return {
        "encode": (encoded - start) * 1e3,
        "first_token": ((first_token or end) - start) * 1e3,
        "decode": (end - encoded) * 1e3,
        "total": (end - start) * 1e3,
        "per_token": (end - encoded) * 1e3 / max(steps, 1),
        "steps": float(steps),
        # What the engine alone took (encoder, steps, cache reorders): total minus this is the
        # decoding loop's own cost, which a faster graph cannot remove.
        "engine": engine * 1e3,
    }


def decode(
    model: StepModel,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    special: SpecialTokens,
    options: DecodeOptions,
    threads: int = 1,
    rules: GenerationDefaults = GenerationDefaults(),
) -> list[RowResult]:
    """Decode a batch: greedy or beam search by `options.num_beams` (options already `resolved`).

    `rules`: the model's fixed rules from the sidecar (bad words, forced BOS / EOS, renormalizing);
    `threads`: how many threads may score a step's logits (the backend's own thread count).
    """
    decoder = _token_decoder(model, input_ids.shape[0], special, options, rules, threads)
    clock, compaction = EngineClock(), RowCompaction(model, input_ids.shape[0])
    start = time.perf_counter()
    state = clock.run(model.encode, input_ids, attention_mask)
    if decoder.width > 1:
        clock.run(model.expand, state, decoder.width)  # (b, ...) -> (b * n, ...): rows [s0 x n, s1 x n, ...]
    encoded = time.perf_counter()
    decoder_ids = np.full((input_ids.shape[0] * decoder.width, 1), special.decoder_start, dtype=np.int64)  # (rows, t)
    first_token = None
    for step in range(options.max_new_tokens):
        # A fresh (rows, V) array each step (a view of the engine's output): processed in place.
        logits = clock.run(_step_logits, model, state, compaction.ids(decoder_ids))
        decoder_ids, beam_idx, done = decoder.update(step, decoder_ids, logits, compaction.rows)
        first_token = first_token or time.perf_counter()
        if done:
            break
        compaction.advance(state, decoder, beam_idx, decoder_ids.shape[0], clock)
    end = time.perf_counter()
    return decoder.finish(_timings(start, encoded, first_token, end, decoder_ids.shape[1] - 1, clock.seconds))


def _step_logits(model: StepModel, state, ids: np.ndarray) -> np.ndarray:
    return np.asarray(model.step(state, ids), dtype=np.float32)  # (rows, V)


def _token_decoder(model, batch, special, options, rules, threads) -> GreedyDecoder | BeamSearchDecoder:
    if options.num_beams is None or options.min_new_tokens is None:
        raise ValueError("decode() takes resolved options: DecodeOptions(...).resolved(limit, defaults)")
    strategy = GreedyDecoder if options.num_beams == 1 else BeamSearchDecoder
    decoder = strategy(batch, special, options, rules, threads)
    if decoder.width > 1:
        missing = [m for m in ("expand", "reorder") if not callable(getattr(model, m, None))]
        if missing:
            raise TypeError(f"beam search needs {' and '.join(missing)}() on {type(model).__name__} (see StepModel)")
    return decoder


def forced_scores(
    model: StepModel,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    special: SpecialTokens,
    target_ids: list[int],
    top_k: int = 5,
) -> ForcedScores:
    """Feed `target_ids` one step at a time (batch of one) and score each given token."""
    if input_ids.shape[0] != 1:
        raise ValueError("forced scoring takes one sentence at a time")
    if not target_ids:
        raise ValueError("target_ids is empty: nothing to score")
    state = model.encode(input_ids, attention_mask)
    decoder_ids = np.full((1, 1), special.decoder_start, dtype=np.int64)
    all_logits, logprobs, ranks, tops, top_lps = [], [], [], [], []
    for token in target_ids:
        logits = np.asarray(model.step(state, decoder_ids), dtype=np.float32)  # (1, V)
        # A copy: the row may be a view of a (1, t, V) output (the single-step graph returns every
        # position), and keeping views would keep all of them alive.
        all_logits.append(logits[0].copy())
        lp = log_softmax(logits)[0]
        logprobs.append(float(lp[token]))
        ranks.append(int((lp > lp[token]).sum()))
        top = _top_k(lp[None, :], top_k)[0]
        tops.append([int(t) for t in top])
        top_lps.append([float(lp[t]) for t in top])
        decoder_ids = np.concatenate([decoder_ids, np.array([[token]], dtype=np.int64)], axis=1)
    return ForcedScores(
        token_ids=list(target_ids),
        logprobs=logprobs,
        ranks=ranks,
        top_ids=tops,
        top_logprobs=top_lps,
        logits=np.stack(all_logits),
    )
