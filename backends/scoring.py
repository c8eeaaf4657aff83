"""Scoring one decoding step's logits: the processors, log-normalizers, the exact top-k, and the
row-block threads.

These are the hot passes over a (rows, V) array each step; the token decoders (`greedy.py`,
`beam_search.py`) decide what to do with their results. The log-sum-exp with the finite check,
and the top-k, run compiled where `native.py` can build them (one pass over a row instead of
numpy's several); the numpy versions here define the results and run everywhere else. Each row is
computed by the same code whichever block it lands in, so the results are independent of the
thread count.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import native
from .processors import (
    ForcedToken,
    LogitsProcessor,
    Mask,
    NonFiniteEndsAtEos,
    Pairs,
    RepetitionPenalty,
    Renormalize,
    RowBlock,
)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    # logits (b, V) -> log-probabilities (b, V), computed in float64 so backends compare fairly
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def log_normalizer(logits: np.ndarray, row_max: np.ndarray | None = None, in_place: bool = False) -> np.ndarray:
    """logits (b, V) float32 -> log-sum-exp (b, 1) float64: the compiled pass where it runs
    (`native.py`), else numpy's (`_numpy_log_normalizer`, which also takes the rows with a NaN or
    +inf, or no finite entry)."""
    if native.usable(logits):
        return _compiled_log_normalizer(logits)[1]
    return _numpy_log_normalizer(logits, row_max, in_place)


def _compiled_log_normalizer(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lse, non_finite = native.log_normalizer(logits)
    left = np.isnan(lse)
    if left.any():
        lse[left] = _numpy_log_normalizer(logits[left])[:, 0]
    return non_finite, lse[:, None]


def _with_non_finite(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits (b, V) float32 -> (rows with a NaN or an infinity (b,), log-sum-exp (b, 1)): one pass
    over the row where compiled."""
    if native.usable(logits):
        return _compiled_log_normalizer(logits)
    return non_finite_rows(logits), _numpy_log_normalizer(logits)


def _numpy_log_normalizer(logits: np.ndarray, row_max: np.ndarray | None = None, in_place: bool = False) -> np.ndarray:
    """logits (b, V) float32 -> log-sum-exp (b, 1) float64, in numpy.

    The few log-probs the loop reports are logit - lse, so a full log-softmax over the vocabulary
    is never materialised. The sum of exp runs in float32: numpy's pairwise summation keeps its
    error far below any drift we report, and a float64 sum over the vocabulary costs more than the
    top-k itself.

    exp() runs on the logits as they are, without subtracting the row's maximum first (one pass
    fewer over the row, the same float32 precision) wherever that is safe: no term overflows and
    the largest is far from zero. `row_max` (b, 1), the rows' maxima when the caller has them
    (the argmax's values), decides that before exp(), so `in_place` may then overwrite `logits`;
    without it the sum itself tells. Each row is decided on its own numbers, so a result never
    depends on which rows share a call (the row blocks on threads).
    """
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):  # rows of all -inf, NaN rows
        if row_max is not None:
            direct = np.abs(row_max[:, 0]) <= _NO_SHIFT
            if direct.all():
                total = np.exp(logits, out=logits if in_place else None).sum(axis=-1, keepdims=True)
                return np.log(total.astype(np.float64))
            total = np.zeros((logits.shape[0], 1), dtype=np.float32)
            total[direct] = np.exp(logits[direct]).sum(axis=-1, keepdims=True)
        else:
            total = np.exp(logits).sum(axis=-1, keepdims=True)
            # a sum in [e^-40, inf): every term finite, the largest >= e^-40 / V, and the ones
            # exp() flushed to zero (below e^-87) weigh nothing against it
            direct = ((total >= _SMALLEST_SUM) & (total < np.inf))[:, 0]
            if direct.all():
                return np.log(total.astype(np.float64))
        out = np.empty((logits.shape[0], 1))
        out[direct] = np.log(total[direct].astype(np.float64))
        # rare: rows with an extreme maximum (or none: NaN, all -inf) subtract it first
        shift = logits[~direct]
        m = shift.max(axis=-1, keepdims=True) if row_max is None else row_max[~direct]
        total = np.exp(np.subtract(shift, m, out=shift), out=shift).sum(axis=-1, keepdims=True)
        out[~direct] = m.astype(np.float64) + np.log(total.astype(np.float64))
    return out


# Row maxima up to this size let exp() run on the raw logits: e^40 x 65001 terms stays far below
# float32's largest value (e^88), and a logit more than 87 below the maximum, flushed to zero,
# weighs less than e^-47 of the sum.
_NO_SHIFT = 40.0
_SMALLEST_SUM = float(np.exp(np.float32(-40.0)))


def non_finite_rows(logits: np.ndarray) -> np.ndarray:
    """logits (b, V) -> (b,) True where a row holds NaN or +-inf.

    A row's sum is finite exactly when every entry is (|logits| are far from float32's max).
    einsum's unrolled sum reads the row once, faster than ndarray.sum's pairwise one (whose
    precision is not needed here); a BLAS row sum (logits @ ones) would be faster still but wakes
    OpenBLAS's own threads, which then spin on the cores ORT needs next.
    """
    return ~np.isfinite(np.einsum("ij->i", logits))


_BLOCK = 128


def _top_k_reference(scores: np.ndarray, k: int) -> np.ndarray:
    # The definition _top_k must match: a full stable sort by (value desc, id asc).
    order = np.lexsort((np.broadcast_to(np.arange(scores.shape[-1]), scores.shape), -scores), axis=-1)
    return order[:, :k]


def _top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """scores (b, V) -> ids (b, k), best first; ties broken by the lower id, like argmax.

    The ids are cut into 128 strided blocks (block j holds ids j, j + n, ..., so the block maxima
    are one vectorised max over contiguous rows). At least k entries reach the k-th largest block
    maximum t, so the k best (and every tie at the k-th value) are among the entries >= t: one
    comparison pass over the rows finds those few candidates, and only they are sorted, every row
    at once. Rows with a NaN, or with fewer than k finite block maxima, go row by row (`_top_k_rare`).
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
    if native.usable(scores) and (compiled := native.top_k(scores, k)) is not None:
        ids, found = compiled
        for row in np.flatnonzero(found < k):  # NaN and -inf are not counted: sorted here
            ids[row] = _top_k_rare(scores[row], k)
        return ids
    block_max = scores[:, : n * _BLOCK].reshape(b, _BLOCK, n).max(axis=1)  # (b, n); NaN if the block has one
    if v > n * _BLOCK:
        block_max = np.concatenate([block_max, scores[:, n * _BLOCK :].max(axis=-1, keepdims=True)], axis=1)
    kth = np.partition(block_max, -k, axis=-1)[:, -k]  # (b,) NaN sorts last: a NaN row's is NaN or larger
    rare = np.isnan(block_max).any(axis=-1) | ~(kth > -np.inf)
    threshold = np.where(rare, np.inf, kth)[:, None]  # a rare row yields no candidates here
    # flatnonzero, then divmod: np.nonzero on the 2-d mask is far slower
    rows, ids = np.divmod(np.flatnonzero(scores >= threshold), v)  # row-major: grouped by row
    values = scores[rows, ids]
    order = np.lexsort((ids, -values, rows))  # by row, then value desc, then id asc
    first = np.searchsorted(rows[order], np.arange(b))  # each row's first candidate in `order`
    out = np.empty((b, k), dtype=np.int64)
    common = np.flatnonzero(~rare)
    out[common] = ids[order][first[common, None] + np.arange(k)]
    for row in np.flatnonzero(rare):
        out[row] = _top_k_rare(scores[row], k)
    return out


def _top_k_rare(row: np.ndarray, k: int) -> np.ndarray:
    """One row with a NaN (no order to exploit: the full sort) or fewer than k finite block maxima
    (a forced or NaN-rewritten step: every entry but a few is -inf): its k best."""
    if np.isnan(row).any():
        return _top_k_reference(row[None, :], k)[0]
    finite = np.flatnonzero(row > -np.inf)
    best = finite[np.lexsort((finite, -row[finite]))][:k]
    if len(best) < k:  # then -inf entries, lowest ids first, as the full sort orders them
        rest = np.flatnonzero(row == -np.inf)[: k - len(best)]
        best = np.concatenate([best, rest])
    return best


# Rows per thread below which splitting a batch costs more than it saves.
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


def _on_row_blocks(fn, logits: np.ndarray, threads: int, *args):
    """fn(logits[lo:hi], lo, whole, *args) on up to `threads` threads, results concatenated along the
    rows (`whole`: the block is every row).

    The engine's own threads sit idle between steps, and this scoring (passes over every logit
    plus the top-k) is a visible share of a batched step; numpy releases the GIL inside its loops,
    so the blocks run in parallel. Each row is computed by the same code whichever block it lands
    in: results equal the one-thread ones.
    """
    b = logits.shape[0]
    parts = max(1, min(threads, b // _MIN_ROWS_PER_PART))
    if parts == 1:
        return fn(logits, 0, True, *args)
    edges = [b * i // parts for i in range(parts + 1)]
    pool = _workers(parts - 1)
    futures = [pool.submit(fn, logits[lo:hi], lo, False, *args) for lo, hi in zip(edges[1:-1], edges[2:])]
    first = fn(logits[: edges[1]], 0, False, *args)
    return tuple(
        None if pieces[0] is None else np.concatenate(pieces) for pieces in zip(first, *(f.result() for f in futures))
    )


def _greedy_block(
    logits: np.ndarray, lo: int, whole: bool, finished: np.ndarray, processors: list[LogitsProcessor], k: int,
    scores: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    hi = lo + logits.shape[0]
    block = RowBlock(lo, hi, whole, None, finished[lo:hi])
    # The penalty comes first in generate()'s order and may overflow a logit: checked after it.
    for p in processors:
        if isinstance(p, RepetitionPenalty):
            p(logits, block)
    block.non_finite = non_finite_rows(logits)
    for p in processors:
        if not isinstance(p, RepetitionPenalty):
            p(logits, block)
    top = _top_k(logits, k)
    if not scores:
        return block.non_finite, top, None
    values = np.take_along_axis(logits, top, axis=-1)  # (r, k); [:, :1] is each row's maximum
    return block.non_finite, top, values - log_normalizer(logits, values[:, :1], in_place=True)


def greedy_scores(
    logits: np.ndarray,
    finished: np.ndarray,
    processors: list[LogitsProcessor],
    k: int,
    threads: int = 1,
    scores: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Greedy search: logits (r, V) float32, processed in place and then consumed -> non-finite rows
    (r,), top ids (r, k) and their log-probs (r, k) float64 (None when not `scores`).

    The processors (already `prepare`d for this step) act on the raw logits, as in generate()'s
    `_sample`; the log-probs reported are over the tokens they leave (logit - lse of the processed
    row). Row blocks run on up to `threads` threads, one without `scores`: two cheap passes over
    the row are left, and handing half of them to a second thread costs more than it saves.
    """
    threads = threads if scores else 1
    return _on_row_blocks(_greedy_block, logits, threads, finished, processors, k, scores)


def _beam_block(
    logits: np.ndarray, lo: int, whole: bool, masks: list[Mask], excluded: Pairs | None, k: int, renormalize: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """-> non-finite rows (r,), lse of the raw row (r, 1), lse of the masked row (r, 1) when
    renormalizing, top ids (r, k) of the masked row."""
    hi = lo + logits.shape[0]
    non_finite, lse = _with_non_finite(logits)  # generate() takes log_softmax over the raw row, then processes
    block = RowBlock(lo, hi, whole, non_finite, None)
    for m in masks:
        m(logits, block)
    if excluded is not None:
        logits[block.entries(excluded)] = -np.inf
    masked_lse = log_normalizer(logits) if renormalize else None
    return block.non_finite, lse, masked_lse, _top_k(logits, k)


def beam_scores(
    logits: np.ndarray, processors: list[LogitsProcessor], k: int, threads: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Beam search: logits (r, V) float32, consumed (numpy's path masks them in place) -> ids (r, k)
    and their processed log-probs (r, k) float64, best first, and the non-finite rows (r,).

    generate() applies the processors (already `prepare`d for this step) to log_softmax of the raw
    row. The masks act on the logits before the top-k; the repetition penalty's entries are left
    out of the top-k and scored exactly from the raw row, then merged in; a forced token, or eos
    for a NaN row (reported as a non-finite step), is the one candidate at log-prob 0, with the
    row's best others kept as its alternatives at -inf; renormalizing subtracts the log of the mass
    the processors leave. Where compiled, all of it but the forced tokens runs in one call that
    leaves the logits as they are (`_compiled_beam_scores`); numpy's path takes renormalizing and
    steps with a non-finite row or fewer than k ids left.
    """
    masks = [p for p in processors if isinstance(p, Mask)]
    penalty = next((p for p in processors if isinstance(p, RepetitionPenalty)), None)
    renormalize = any(isinstance(p, Renormalize) for p in processors)
    fused = None if renormalize else _compiled_beam_scores(logits, masks, penalty, k, threads)
    top, values, non_finite = fused or _numpy_beam_scores(logits, masks, penalty, k, threads, renormalize)
    forced = next((p.now for p in processors if isinstance(p, ForcedToken) and p.now is not None), None)
    nan_eos = next((p.eos for p in processors if isinstance(p, NonFiniteEndsAtEos)), None)
    only = forced if forced is not None else nan_eos
    rows = range(logits.shape[0]) if forced is not None else np.flatnonzero(non_finite) if nan_eos is not None else ()
    for row in rows:
        others = top[row][top[row] != only][: k - 1]
        top[row, 0], top[row, 1:] = only, others
        values[row, 0], values[row, 1:] = 0.0, -np.inf
    return top, values, non_finite


def _by_row(pairs: list[Pairs], rows: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, ids) pairs -> (offsets (rows + 1,), ids ascending within each row)."""
    offsets = np.zeros(rows + 1, dtype=np.int64)
    if not pairs:
        return offsets, np.zeros(0, dtype=np.int64)
    r = np.concatenate([r for r, _ in pairs]).astype(np.int64, copy=False)
    ids = np.concatenate([i for _, i in pairs]).astype(np.int64, copy=False)
    key = r * vocab + ids
    if len(key) > 1 and not (key[1:] >= key[:-1]).all():  # the repetition penalty's come in order
        order = np.argsort(key, kind="stable")
        r, ids = r[order], ids[order]
    np.cumsum(np.bincount(r, minlength=rows), out=offsets[1:])
    return offsets, ids


def _compiled_beam_scores(logits, masks, penalty, k, threads):
    """beam_scores' work in one compiled call (`native.beam_rows`), or None where it does not
    apply: numpy's scoring, a mask without `excluded`, or a row with a NaN, an infinity or fewer
    than k ids left (the numpy path below decides those)."""
    if not native.usable(logits):
        return None
    rows, vocab = logits.shape
    shared, pairs = [np.zeros(0, dtype=np.int64)], []
    for m in masks:
        try:
            every, own = m.excluded()
        except NotImplementedError:
            return None
        shared.append(np.asarray(every, dtype=np.int64))
        if own is not None and len(own[0]):
            pairs.append(own)
    repeated = [] if penalty is None or penalty.pairs is None else [penalty.pairs]
    threads = max(1, min(threads, rows // _MIN_ROWS_PER_PART))  # as _on_row_blocks splits
    got = native.beam_rows(logits, k, np.unique(np.concatenate(shared)), _by_row(pairs, rows, vocab),
                           _by_row(repeated, rows, vocab), 1.0 if penalty is None else penalty.penalty, threads)
    if got is None:
        return None
    non_finite, top, values, found = got
    if non_finite.any() or (found < k).any():
        return None
    return top, values, non_finite


def _numpy_beam_scores(logits, masks, penalty, k, threads, renormalize):
    repeated = None if penalty is None else penalty.pairs
    raw = None if repeated is None else logits[repeated].astype(np.float64)  # before any mask
    non_finite, lse, masked_lse, top = _on_row_blocks(_beam_block, logits, threads, masks, repeated, k, renormalize)
    values = np.take_along_axis(logits, top, axis=-1) - lse  # (r, k) float64
    norm = None if masked_lse is None else masked_lse - lse  # log of the mass the masks leave
    if repeated is not None:
        r, ids = repeated
        penalised = penalty.penalise(raw - lse[r, 0])
        if norm is not None:
            for m in masks:
                masked = m.masked(r, ids)
                if masked is not None:
                    penalised[masked] = -np.inf
            for row in np.unique(r):
                norm[row, 0] = np.logaddexp(norm[row, 0], np.logaddexp.reduce(penalised[r == row]))
        # Only an entry at least its row's k-th best can enter the row's top-k: the rest never
        # reach the sort (masking lowers a value, so it is applied to the few left).
        enters = np.flatnonzero(penalised >= values[r, k - 1])
        if len(enters):
            r, ids, penalised = r[enters], ids[enters], penalised[enters]
            for m in masks:
                masked = m.masked(r, ids)
                if masked is not None:
                    penalised[masked] = -np.inf
            # Each such row's k best of its top-k and its entries, every row in one sort (by row,
            # value desc, id asc; stable).
            held, counts = np.unique(r, return_counts=True)
            cand_rows = np.concatenate([np.repeat(held, k), r])
            cand_ids = np.concatenate([top[held].reshape(-1), ids])
            cand_values = np.concatenate([values[held].reshape(-1), penalised])
            order = np.lexsort((cand_ids, -cand_values, cand_rows))
            first = np.concatenate([[0], np.cumsum(counts + k)[:-1]])  # each held row's first candidate
            pick = order[first[:, None] + np.arange(k)]
            top[held], values[held] = cand_ids[pick], cand_values[pick]
    if norm is not None:  # renormalize_logits: log_softmax again after the processors
        values -= norm
    return top, values, non_finite
