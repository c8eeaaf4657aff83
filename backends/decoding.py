"""The one greedy loop every backend shares, and teacher-forced scoring.

Backends differ only in how a `StepModel` turns the tokens so far into next-token logits. The
start token, the bad-words (pad) mask, eos / length stops, `min_new_tokens`, per-step scores and
timings are decided here, so a difference between backends is a difference in their numbers.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
    # logit - lse, so a full log-softmax over the vocabulary is never materialised. The sum of
    # exp(x - max) runs in float32 (pairwise summation: relative error ~1e-7 here, far below any
    # drift we report); a float64 sum of 65001 logits per row cost more than the top-k itself.
    m = logits.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # rows of all -inf (never produced: eos stays finite)
        shifted = np.subtract(logits, m)  # (b, V), one scratch array, exp'd in place
        total = np.exp(shifted, out=shifted).sum(axis=-1, keepdims=True)
    return m.astype(np.float64) + np.log(total.astype(np.float64))


_BLOCK = 128


def _top_k_reference(scores: np.ndarray, k: int) -> np.ndarray:
    # The definition _top_k must match: a full stable sort by (value desc, id asc).
    order = np.lexsort((np.broadcast_to(np.arange(scores.shape[-1]), scores.shape), -scores), axis=-1)
    return order[:, :k]


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """scores (b, V) -> ids (b, k), best first; ties broken by the lower id, like argmax.

    The ids are cut into 128 strided blocks' worth of columns (block j holds ids j, j + n, ...,
    so the block maxima are one vectorised max over contiguous rows). An entry among the k best
    lies in a block whose maximum is at least the k-th largest block maximum, so only those
    blocks are sorted exactly: one pass over the row instead of argpartition, the same ids.
    """
    b, v = scores.shape
    n = v // _BLOCK  # blocks in the strided part; ids from n * _BLOCK on form one more block
    if n < 4 * k:
        return _top_k_reference(scores, k)
    block_max = scores[:, : n * _BLOCK].reshape(b, _BLOCK, n).max(axis=1)  # (b, n)
    if v > n * _BLOCK:
        block_max = np.concatenate([block_max, scores[:, n * _BLOCK :].max(axis=-1, keepdims=True)], axis=1)
    kth = np.partition(block_max, -k, axis=-1)[:, -k:].min(axis=-1, keepdims=True)  # (b, 1)
    out = np.empty((b, k), dtype=np.int64)
    strides = n * np.arange(_BLOCK)
    for row in range(b):
        if np.isnan(kth[row, 0]) or np.isnan(block_max[row]).any():
            out[row] = _top_k_reference(scores[row : row + 1], k)[0]  # NaN: no order to exploit
            continue
        blocks = np.flatnonzero(block_max[row] >= kth[row, 0])
        head = blocks[blocks < n]
        ids = (head[:, None] + strides).ravel()
        if blocks[-1] == n:  # the tail block
            ids = np.concatenate([ids, np.arange(n * _BLOCK, v)])
        vals = scores[row, ids]
        out[row] = ids[np.lexsort((ids, -vals))[:k]]
    return out


def _longest_run(ids: list[int]) -> int:
    best = run = 0
    prev = None
    for t in ids:
        run = run + 1 if t == prev else 1
        best, prev = max(best, run), t
    return best


# Rows per thread below which splitting a batch costs more than it saves (one 65001-wide row
# takes ~0.17 ms to score).
_MIN_ROWS_PER_PART = 4
_pool: tuple[ThreadPoolExecutor, int] | None = None  # (pool, its size)
_pool_lock = threading.Lock()


def _workers(n: int) -> ThreadPoolExecutor:
    """A process-wide pool with at least n threads, made on first use; idle threads cost nothing."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[1] < n:
            _pool = (ThreadPoolExecutor(max_workers=n, thread_name_prefix="decode-rows"), n)
        return _pool[0]


def _score_rows(
    logits: np.ndarray, finished: np.ndarray, bad: np.ndarray, mask_eos: bool, eos: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """logits (r, V) float32, masked in place -> non-finite rows (r,), lse (r, 1), top ids (r, k).

    Rows are independent, so a batch can be cut into row blocks scored on several threads.
    """
    # A row's sum is finite exactly when every entry is (|logits| are far from float32's max).
    non_finite = ~np.isfinite(logits.sum(axis=-1))
    logits[:, bad] = -np.inf
    if mask_eos:
        logits[:, eos] = -np.inf
    # A NaN row would make argmax meaningless: score it as all -inf apart from eos, so the row
    # ends here and the step is reported instead of shown as a translation.
    for row in np.flatnonzero(non_finite & ~finished):
        logits[row] = -np.inf
        logits[row, eos] = 0.0
    return non_finite, log_normalizer(logits), _top_k(logits, k)


def score_step(
    logits: np.ndarray, finished: np.ndarray, bad: np.ndarray, mask_eos: bool, eos: int, k: int, threads: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_score_rows` over the batch, cut into row blocks on up to `threads` threads.

    The engine's own threads sit idle between steps, and at batch 32 this scoring (three passes
    over 32 x 65001 logits plus the top-k) was a fifth of an fp32 step and a third of an int8
    one. numpy releases the GIL inside its loops, so the blocks run in parallel. Each row is
    computed by the same code whichever block it lands in: results equal the one-thread ones.
    """
    b = logits.shape[0]
    parts = max(1, min(threads, b // _MIN_ROWS_PER_PART))
    if parts == 1:
        return _score_rows(logits, finished, bad, mask_eos, eos, k)
    edges = [b * i // parts for i in range(parts + 1)]
    pool = _workers(parts - 1)
    futures = [
        pool.submit(_score_rows, logits[lo:hi], finished[lo:hi], bad, mask_eos, eos, k)
        for lo, hi in zip(edges[1:-1], edges[2:])
    ]
    first = _score_rows(logits[: edges[1]], finished[: edges[1]], bad, mask_eos, eos, k)
    non_finite, lse, top = zip(first, *(f.result() for f in futures))
    return np.concatenate(non_finite), np.concatenate(lse), np.concatenate(top)


def greedy_decode(
    model: StepModel,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    special: SpecialTokens,
    options: DecodeOptions,
    threads: int = 1,
) -> list[RowResult]:
    """Greedy search for a batch; every row stops at eos or `options.max_new_tokens`.

    `threads`: how many threads may score a step's logits (the backend's own thread count).
    """
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
        bad_rows, lse, top = score_step(logits, finished, bad, step < min_new, special.eos, k, threads)  # (b,), (b, 1), (b, k)
        for row in np.flatnonzero(bad_rows & ~finished):
            non_finite[row].append(step)
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
        # A copy: the row may be a view of a (1, t, V) output (the single-step graph returns every
        # position), and keeping views kept all of them alive: 8 GB for 511 steps of a 15k vocabulary.
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
