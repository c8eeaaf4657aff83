"""Scoring one decoding step's logits: log-normalizers, the exact top-k, and the row-block threads.

These are the hot numpy passes over a (rows, V) array each step; `strategies.py` decides what to
do with their results. Each row is computed by the same code whichever block it lands in, so the
results are independent of the thread count.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

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


# From this many rows, the batched top-k (one vectorised pass for the rows without ties) beats the
# per-row loop, whose Python work per row (~60 us) dominated at batch 32: 3.1 ms -> 1.4 ms for
# 32 x 15123 logits; below it the loop is faster (batch 1, 65001: 59 us vs 128 us).
_BATCHED_ROWS = 8


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """scores (b, V) -> ids (b, k), best first; ties broken by the lower id, like argmax.

    The ids are cut into 128 strided blocks' worth of columns (block j holds ids j, j + n, ...,
    so the block maxima are one vectorised max over contiguous rows). An entry among the k best
    lies in a block whose maximum is at least the k-th largest block maximum, so only those
    blocks are sorted exactly: one pass over the row instead of argpartition, the same ids.
    """
    b, v = scores.shape
    if k == 1:  # the benchmark's setting (no alternatives): argmax takes the lowest id of a tie too
        best = scores.argmax(axis=-1)  # (b,)
        out = best[:, None].astype(np.int64)
        nan_rows = np.flatnonzero(np.isnan(scores[np.arange(b), best]))  # argmax stops at a NaN
        if len(nan_rows):
            out[nan_rows] = _top_k_reference(scores[nan_rows], 1)
        return out
    n = v // _BLOCK  # blocks in the strided part; ids from n * _BLOCK on form one more block
    if n < 4 * k:
        return _top_k_reference(scores, k)
    block_max = scores[:, : n * _BLOCK].reshape(b, _BLOCK, n).max(axis=1)  # (b, n)
    if v > n * _BLOCK:
        block_max = np.concatenate([block_max, scores[:, n * _BLOCK :].max(axis=-1, keepdims=True)], axis=1)
    out = np.empty((b, k), dtype=np.int64)
    rows = np.arange(b)
    if b >= _BATCHED_ROWS:
        rows = _top_k_batched(scores, k, block_max, out)
    _top_k_each(scores, k, block_max, rows, out)
    return out


def _top_k_each(scores: np.ndarray, k: int, block_max: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """out[rows] = the top k of those rows, one row at a time: exact whatever the ties or NaNs."""
    v = scores.shape[1]
    n = v // _BLOCK
    if not len(rows):
        return
    kth = np.partition(block_max[rows], -k, axis=-1)[:, -k:].min(axis=-1)  # (r,)
    strides = n * np.arange(_BLOCK)
    for row, kth_row in zip(rows, kth):
        if np.isnan(kth_row) or np.isnan(block_max[row]).any():
            out[row] = _top_k_reference(scores[row : row + 1], k)[0]  # NaN: no order to exploit
            continue
        blocks = np.flatnonzero(block_max[row] >= kth_row)
        head = blocks[blocks < n]
        ids = (head[:, None] + strides).ravel()
        if blocks[-1] == n:  # the tail block
            ids = np.concatenate([ids, np.arange(n * _BLOCK, v)])
        vals = scores[row, ids]
        out[row] = ids[np.lexsort((ids, -vals))[:k]]


def _top_k_batched(scores: np.ndarray, k: int, block_max: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[r] for the rows where no tie can decide the order, in one vectorised pass: exactly k
    blocks reach the k-th block maximum and exactly one candidate holds the k-th value. Returns
    the other rows (ties, NaNs), left to `_top_k_each`."""
    b, v = scores.shape
    n = v // _BLOCK
    tail = v > n * _BLOCK
    part = np.argpartition(block_max, -k, axis=-1)[:, -k:]  # (b, k): blocks holding the k largest maxima
    kth = np.take_along_axis(block_max, part, axis=-1).min(axis=-1, keepdims=True)  # (b, 1)
    with np.errstate(invalid="ignore"):
        simple = ((block_max >= kth).sum(axis=-1) == k) & ~np.isnan(kth[:, 0])
    rows = np.flatnonzero(simple)
    if len(rows):
        blocks = part[rows]  # (r, k)
        ids = blocks[:, :, None] + np.arange(_BLOCK) * n  # (r, k, 128): the blocks' ids
        if tail:  # the tail block's ids run past v; those slots read -inf below
            ids = np.where((blocks == n)[:, :, None], n * _BLOCK + np.arange(_BLOCK), ids)
        ids = ids.reshape(len(rows), -1)
        vals = np.take_along_axis(scores[rows], np.minimum(ids, v - 1), axis=-1)  # (r, k * 128)
        if tail:
            vals[ids >= v] = -np.inf
        pick = np.argpartition(-vals, k - 1, axis=-1)[:, :k]  # the k largest; a tie at the k-th is arbitrary
        top_vals = np.take_along_axis(vals, pick, axis=-1)
        unique = (vals == top_vals.min(axis=-1, keepdims=True)).sum(axis=-1) == 1  # else the id decides
        top_ids = np.take_along_axis(ids, pick, axis=-1)
        order = np.lexsort((top_ids, -top_vals), axis=-1)  # equal values above the k-th: lower id first
        out[rows] = np.take_along_axis(top_ids, order, axis=-1)
        simple[rows[~unique]] = False
    return np.flatnonzero(~simple)


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


Pairs = tuple[np.ndarray, np.ndarray]  # (rows, ids): single entries of a (rows, V) array


def _pairs_in(pairs: Pairs | None, lo: int, hi: int) -> Pairs | None:
    if pairs is None:
        return None
    keep = (pairs[0] >= lo) & (pairs[0] < hi)
    return pairs[0][keep] - lo, pairs[1][keep]


def _on_row_blocks(fn, logits: np.ndarray, rows: tuple, pairs: Pairs | None, threads: int, *args):
    """fn(logits[lo:hi], *(r[lo:hi] for r in rows), pairs of those rows, *args) on up to `threads`
    threads, results concatenated along the rows.

    The engine's own threads sit idle between steps, and at batch 32 this scoring (three passes
    over 32 x 65001 logits plus the top-k) was a fifth of an fp32 step and a third of an int8
    one. numpy releases the GIL inside its loops, so the blocks run in parallel. Each row is
    computed by the same code whichever block it lands in: results equal the one-thread ones.
    """
    b = logits.shape[0]
    parts = max(1, min(threads, b // _MIN_ROWS_PER_PART))
    if parts == 1:
        return fn(logits, *rows, pairs, *args)
    edges = [b * i // parts for i in range(parts + 1)]
    pool = _workers(parts - 1)
    futures = [
        pool.submit(fn, logits[lo:hi], *(r[lo:hi] for r in rows), _pairs_in(pairs, lo, hi), *args)
        for lo, hi in zip(edges[1:-1], edges[2:])
    ]
    first = fn(logits[: edges[1]], *(r[: edges[1]] for r in rows), _pairs_in(pairs, 0, edges[1]), *args)
    return tuple(
        None if pieces[0] is None else np.concatenate(pieces) for pieces in zip(first, *(f.result() for f in futures))
    )


def _score_rows(
    logits: np.ndarray,
    finished: np.ndarray,
    banned: Pairs | None,
    bad: np.ndarray,
    mask_eos: bool,
    eos: int,
    k: int,
    forced: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy: logits (r, V) float32, masked in place -> non-finite rows (r,), lse (r, 1), top ids (r, k).

    The log-probs reported are over the tokens left after the masks (logit - lse of the masked row).
    """
    # A row's sum is finite exactly when every entry is (|logits| are far from float32's max).
    non_finite = ~np.isfinite(logits.sum(axis=-1))
    logits[:, bad] = -np.inf
    if mask_eos:
        logits[:, eos] = -np.inf
    if banned is not None:
        logits[banned] = -np.inf
    # A NaN row would make argmax meaningless: score it as all -inf apart from eos, so the row
    # ends here and the step is reported instead of shown as a translation.
    for row in np.flatnonzero(non_finite & ~finished):
        logits[row] = -np.inf
        logits[row, eos] = 0.0
    if forced is not None:  # generate()'s forced BOS: every other token -inf, this one 0
        logits[:] = -np.inf
        logits[:, forced] = 0.0
    return non_finite, log_normalizer(logits), _top_k(logits, k)


def score_step(
    logits: np.ndarray,
    finished: np.ndarray,
    bad: np.ndarray,
    mask_eos: bool,
    eos: int,
    k: int,
    threads: int = 1,
    banned: Pairs | None = None,
    forced: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_score_rows` over the batch, cut into row blocks on up to `threads` threads."""
    return _on_row_blocks(_score_rows, logits, (finished,), banned, threads, bad, mask_eos, eos, k, forced)


def _beam_rows(
    logits: np.ndarray, excluded: Pairs | None, bad: np.ndarray, mask_eos: bool, eos: int, k: int, renormalize: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """Beam search: logits (r, V) float32, masked in place -> non-finite rows (r,), lse of the raw
    row (r, 1), lse of the masked row (r, 1) when renormalizing, top ids (r, k) of the masked row.

    generate()'s beam search takes log_softmax over the whole vocabulary first, then masks: the
    normalizer comes from the raw row. `excluded` entries (masked n-grams and bad words, and the
    repetition-penalised ids the caller scores itself) are left out of the top-k.
    """
    non_finite = ~np.isfinite(logits.sum(axis=-1))
    lse = log_normalizer(logits)
    logits[:, bad] = -np.inf
    if mask_eos:
        logits[:, eos] = -np.inf
    if excluded is not None:
        logits[excluded] = -np.inf
    masked_lse = log_normalizer(logits) if renormalize else None
    return non_finite, lse, masked_lse, _top_k(logits, k)




def beam_step_scores(
    logits: np.ndarray, excluded: Pairs | None, threads: int, bad: np.ndarray, mask_eos: bool, eos: int, k: int, renormalize: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """`_beam_rows` over the batch, cut into row blocks on up to `threads` threads."""
    return _on_row_blocks(_beam_rows, logits, (), excluded, threads, bad, mask_eos, eos, k, renormalize)
