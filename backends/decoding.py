"""The one greedy loop every backend shares, and teacher-forced scoring.

Backends differ only in how a `StepModel` turns the tokens so far into next-token logits. The
start token, the bad-words (pad) mask, eos / length stops, `min_new_tokens`, per-step scores and
timings are decided here, so a difference between backends is a difference in their numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .base import DecodeOptions, ForcedScores, StepModel, StepScore
from .manifest import SpecialTokens


@dataclass
class RowResult:
    token_ids: list[int]
    scores: list[StepScore]
    stop_reason: str
    timings_ms: dict[str, float]
    non_finite_steps: list[int] = field(default_factory=list)
    repeated_run: int = 0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    # logits (b, V) -> log-probabilities (b, V), computed in float64 so backends compare fairly
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def log_normalizer(logits: np.ndarray) -> np.ndarray:
    # logits (b, V) float32 -> log-sum-exp (b, 1) float64: the few log-probs the loop reports are
    # logit - lse, so a full float64 log-softmax over the vocabulary is never materialised.
    m = logits.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # rows of all -inf (never produced: eos stays finite)
        return m.astype(np.float64) + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True, dtype=np.float64))


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    # scores (b, V) -> ids (b, k), best first; ties broken by the lower id, like argmax
    part = np.argpartition(scores, -k, axis=-1)[:, -k:]
    vals = np.take_along_axis(scores, part, axis=-1)
    order = np.lexsort((part, -vals), axis=-1)
    return np.take_along_axis(part, order, axis=-1)


def _longest_run(ids: list[int]) -> int:
    best = run = 0
    prev = None
    for t in ids:
        run = run + 1 if t == prev else 1
        best, prev = max(best, run), t
    return best


def greedy_decode(
    model: StepModel,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    special: SpecialTokens,
    options: DecodeOptions,
) -> list[RowResult]:
    """Greedy search for a batch; every row stops at eos or `options.max_new_tokens`."""
    batch = input_ids.shape[0]
    max_new, min_new, k = options.max_new_tokens, options.min_new_tokens, options.top_k
    bad = np.array(special.bad_words_ids, dtype=np.int64)

    start = time.perf_counter()
    state = model.encode(input_ids, attention_mask)
    encoded = time.perf_counter()

    decoder_ids = np.full((batch, 1), special.decoder_start, dtype=np.int64)  # (b, t)
    finished = np.zeros(batch, dtype=bool)
    steps: list[list[StepScore]] = [[] for _ in range(batch)]
    non_finite: list[list[int]] = [[] for _ in range(batch)]
    first_token = None
    for step in range(max_new):
        # A fresh (b, V) array each step (a view of the engine's output): masked in place.
        logits = np.asarray(model.step(state, decoder_ids), dtype=np.float32)
        bad_rows = ~np.isfinite(logits).all(axis=-1)
        logits[:, bad] = -np.inf
        if step < min_new:
            logits[:, special.eos] = -np.inf
        # A NaN row would make argmax meaningless: score it as all -inf apart from eos, so the row
        # ends here and the step is reported instead of shown as a translation.
        for row in np.flatnonzero(bad_rows & ~finished):
            non_finite[row].append(step)
            logits[row] = -np.inf
            logits[row, special.eos] = 0.0
        lse = log_normalizer(logits)  # (b, 1)
        top = _top_k(logits, k)  # (b, k), best first
        top_logprobs = np.take_along_axis(logits, top, axis=-1) - lse  # (b, k) float64
        next_ids = top[:, 0].copy()
        next_ids[finished] = special.pad
        for row in np.flatnonzero(~finished):
            steps[row].append(
                StepScore(
                    token_id=int(next_ids[row]),
                    logprob=float(top_logprobs[row, 0]),
                    top_ids=top[row].tolist(),
                    top_logprobs=top_logprobs[row].tolist(),
                )
            )
        decoder_ids = np.concatenate([decoder_ids, next_ids[:, None]], axis=1)
        finished |= next_ids == special.eos
        if first_token is None:
            first_token = time.perf_counter()
        if finished.all():
            break
    end = time.perf_counter()

    generated = decoder_ids.shape[1] - 1
    timings = {
        "encode": (encoded - start) * 1e3,
        "first_token": ((first_token or end) - start) * 1e3,
        "decode": (end - encoded) * 1e3,
        "total": (end - start) * 1e3,
        "per_token": (end - encoded) * 1e3 / max(generated, 1),
        "steps": float(generated),
    }
    results = []
    for row in range(batch):
        ids = [s.token_id for s in steps[row]]
        results.append(
            RowResult(
                token_ids=ids,
                scores=steps[row],
                stop_reason="eos" if ids and ids[-1] == special.eos else "max_new_tokens",
                timings_ms=timings,
                non_finite_steps=non_finite[row],
                repeated_run=_longest_run(ids),
            )
        )
    return results


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
        all_logits.append(logits[0])
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
