"""The one decoding loop every backend shares, its two token decoders, and teacher-forced scoring.

Backends differ only in how a `StepModel` turns the tokens so far into next-token logits. The
start token, the logits processors (bad words, min length, forced BOS / EOS, repetition penalty,
no-repeat n-grams), eos / length stops, per-step scores and timings are decided here, so a
difference between backends is a difference in their numbers.

`decode` is the loop (as whisper's `DecodingTask.run`): encode once, expand per beam, then one
`step` per token; a token decoder picks the next tokens and says which rows continue which
(`GreedyDecoder`, `BeamSearchDecoder`); the engine reorders its cache by that index. Both
decoders follow transformers 5.24 `generate()` token for token: greedy applies the processors
to the raw logits and takes the argmax (`_sample`); beam search takes log_softmax over the whole
vocabulary, then the processors, then keeps 2 x num_beams continuations per sentence
(`_beam_search`, `_get_top_k_continuations`, `_get_running_beams_for_next_iteration`,
`_update_finished_beams`, `_check_early_stop_heuristic`).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .base import DecodeOptions, ForcedScores, StepModel, StepScore
from .manifest import GenerationDefaults, SpecialTokens


@dataclass
class RowResult:
    token_ids: list[int]
    scores: list[StepScore]
    stop_reason: str
    timings_ms: dict[str, float]
    non_finite_steps: list[int] = field(default_factory=list)
    repeated_run: int = 0
    score: float = 0.0  # sum(log-probs) / len(token_ids) ** length_penalty
    hypotheses: list[tuple[list[int], float]] = field(default_factory=list)  # (ids, score), best first


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


# --- generate()'s logits processors ---------------------------------------------------------------


def _unique_per_row(ids: np.ndarray) -> Pairs:
    """ids (r, t) -> (rows, ids) with every id of a row once."""
    order = np.sort(ids, axis=1)
    first = np.ones(order.shape, dtype=bool)
    first[:, 1:] = order[:, 1:] != order[:, :-1]
    rows, cols = np.nonzero(first)
    return rows, order[rows, cols]


class Processors:
    """What generate() applies to a step's scores, in `_get_logits_processor`'s order: repetition
    penalty, no-repeat n-grams, bad words, min length (eos masked), forced BOS, forced EOS. Each
    reads the row's decoder ids so far, decoder start included, as generate()'s processors do.

    The masks (-inf) commute with each other and with the penalty; the forced tokens override
    everything, so they are applied last. The scores they act on differ: raw logits for greedy
    search, log-probs for beam search (the caller applies them accordingly).
    """

    def __init__(self, special: SpecialTokens, options: DecodeOptions, rules: GenerationDefaults, beams: bool):
        self.eos = special.eos
        # A lone eos is never a bad word (generate()'s NoBadWordsLogitsProcessor drops it).
        singles = {*special.bad_words_ids, *(ids[0] for ids in rules.bad_words_ids if len(ids) == 1)} - {self.eos}
        self.bad = np.array(sorted(singles), dtype=np.int64)
        self.multi = [(np.array(ids[:-1], dtype=np.int64), ids[-1]) for ids in rules.bad_words_ids if len(ids) > 1]
        self.penalty = options.repetition_penalty
        self.ngram = options.no_repeat_ngram_size
        self.min_new = options.min_new_tokens
        self.forced_bos = rules.forced_bos_token_id
        # Greedy search reports a cut at max_new_tokens ("max_new_tokens", no eos), the contract its
        # results keep; beam search forces eos there as generate() does, since it changes which
        # hypotheses win (and their scores).
        self.forced_eos = rules.forced_eos_token_id if beams else None
        self.last_step = options.max_new_tokens - 1
        self.renormalize = rules.renormalize_logits

    def mask_eos(self, step: int) -> bool:
        return step < self.min_new

    def forced(self, step: int) -> int | None:
        if step == 0 and self.forced_bos is not None:
            return self.forced_bos
        if step == self.last_step and self.forced_eos is not None:
            return self.forced_eos
        return None

    def repeated(self, decoder_ids: np.ndarray) -> Pairs | None:
        """The ids the repetition penalty touches: every id already in the row."""
        return None if self.penalty == 1.0 else _unique_per_row(decoder_ids)

    def penalise(self, scores: np.ndarray) -> np.ndarray:
        # RepetitionPenaltyLogitsProcessor: negative scores * penalty, others / penalty
        return np.where(scores < 0, scores * self.penalty, scores / self.penalty)

    def banned(self, decoder_ids: np.ndarray) -> Pairs | None:
        """(rows, ids) no row may take next: repeated n-grams and completed multi-token bad words."""
        rows, ids = [], []
        t = decoder_ids.shape[1]
        n = self.ngram
        if n and t >= n:  # NoRepeatNGramLogitsProcessor: windows matching the last n - 1 ids ban their last
            windows = sliding_window_view(decoder_ids, n, axis=1)  # (r, t - n + 1, n)
            prefix = decoder_ids[:, t - n + 1 :]  # (r, n - 1)
            r, w = np.nonzero((windows[:, :, :-1] == prefix[:, None, :]).all(axis=-1))
            rows.append(r)
            ids.append(windows[r, w, -1])
        for prefix, last in self.multi:  # NoBadWordsLogitsProcessor, sequences of two or more
            if len(prefix) <= t:
                r = np.flatnonzero((decoder_ids[:, t - len(prefix) :] == prefix).all(axis=-1))
                rows.append(r)
                ids.append(np.full(len(r), last, dtype=np.int64))
        if not rows:
            return None
        return np.concatenate(rows), np.concatenate(ids)

    def is_masked(self, ids: np.ndarray, rows: np.ndarray, step: int, banned: Pairs | None) -> np.ndarray:
        """Whether (rows, ids) are masked this step (bad words, min length, bans)."""
        masked = np.isin(ids, self.bad)
        if self.mask_eos(step):
            masked |= ids == self.eos
        if banned is not None and len(banned[0]):
            width = int(max(ids.max(initial=0), banned[1].max()) + 1)
            masked |= np.isin(rows * width + ids, banned[0] * width + banned[1])
        return masked


# --- token decoders -------------------------------------------------------------------------------


class GreedyDecoder:
    """generate(num_beams=1): the processors act on the raw logits, then the argmax."""

    width = 1

    def __init__(self, batch: int, special: SpecialTokens, options: DecodeOptions, rules: GenerationDefaults, threads: int):
        self.special, self.options, self.threads = special, options, threads
        self.processors = Processors(special, options, rules, beams=False)
        self.finished = np.zeros(batch, dtype=bool)
        self.steps: list[list[StepScore]] = [[] for _ in range(batch)]
        self.non_finite: list[list[int]] = [[] for _ in range(batch)]

    def update(self, step: int, decoder_ids: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, None, bool]:
        """logits (b, V), a fresh array (a view of the engine's output) masked in place
        -> (decoder ids grown by one column, no reordering, whether every row is finished)."""
        p, special, finished = self.processors, self.special, self.finished
        repeated = p.repeated(decoder_ids)
        if repeated is not None:
            logits[repeated] = p.penalise(logits[repeated])
        bad_rows, lse, top = score_step(
            logits, finished, p.bad, p.mask_eos(step), special.eos, self.options.top_k, self.threads,
            p.banned(decoder_ids), p.forced(step),
        )  # (b,), (b, 1), (b, k)
        for row in np.flatnonzero(bad_rows & ~finished):
            self.non_finite[row].append(step)
        top_logprobs = np.take_along_axis(logits, top, axis=-1) - lse  # (b, k) float64
        next_ids = top[:, 0].copy()
        next_ids[finished] = special.pad
        for row in np.flatnonzero(~finished):
            self.steps[row].append(
                StepScore(
                    token_id=int(next_ids[row]),
                    logprob=float(top_logprobs[row, 0]),
                    top_ids=top[row].tolist(),
                    top_logprobs=top_logprobs[row].tolist(),
                )
            )
        finished |= next_ids == special.eos
        return np.concatenate([decoder_ids, next_ids[:, None]], axis=1), None, bool(finished.all())

    def finish(self, timings: dict[str, float]) -> list[RowResult]:
        eos, penalty = self.special.eos, self.options.length_penalty
        results = []
        for steps, non_finite in zip(self.steps, self.non_finite):
            ids = [s.token_id for s in steps]
            score = sum(s.logprob for s in steps) / len(ids) ** penalty
            results.append(
                RowResult(
                    token_ids=ids,
                    scores=steps,
                    stop_reason="eos" if ids and ids[-1] == eos else "max_new_tokens",
                    timings_ms=timings,
                    non_finite_steps=non_finite,
                    repeated_run=_longest_run(ids),
                    score=score,
                    hypotheses=[(ids, score)],
                )
            )
        return results


@dataclass
class _Finished:
    score: float  # sum of log-probs / length ** length_penalty
    step: int  # the step that produced its last token
    row: int  # the row (of that step's input) it continued
    token: int
    logprob: float


@dataclass
class _StepRecord:
    """What one beam-search step leaves behind; hypotheses are read back through `parent`."""

    parent: np.ndarray  # (rows,) the input row each next-step row continues
    token: np.ndarray  # (rows,) the token each next-step row appended
    logprob: np.ndarray  # (rows,) its processed log-prob
    top_ids: np.ndarray  # (rows, k) per input row: the divergence view's alternatives
    top_logprobs: np.ndarray  # (rows, k)
    non_finite: np.ndarray  # (rows,) per input row


_NEG = -1.0e9  # generate()'s "not this one" score


class BeamSearchDecoder:
    """generate(num_beams=n, do_sample=False), transformers 5.24 `_beam_search`, per step:

    1. log-probs = log_softmax(logits) over the whole vocabulary, then the processors;
    2. each sentence's running scores + log-probs, flattened over beams x vocabulary: the best
       2n continuations (ties: the lower beam, then the lower id);
    3. a continuation hits a stop when its token is eos or the length cap is reached; the best n
       that do not continue as the running beams (the cache is reordered by their rows);
    4. of the best n continuations, those that hit a stop join the sentence's finished list with
       score sum / length ** length_penalty, unless the sentence is done (early_stopping=True and n
       finished, or the heuristic said no running beam can win); the list keeps the best n;
    5. the heuristic: the best running score divided by (the current length, or the longest
       possible one for "never" with length_penalty > 0) ** length_penalty must beat the worst of
       n finished hypotheses; the loop ends when no sentence can improve, or every sentence is
       full with early_stopping=True, or every continuation hit a stop (the length cap).

    Scores are float64 (generate() uses float32): near-ties may resolve differently.
    """

    def __init__(self, batch: int, special: SpecialTokens, options: DecodeOptions, rules: GenerationDefaults, threads: int):
        self.special, self.options, self.threads = special, options, threads
        self.processors = Processors(special, options, rules, beams=True)
        self.batch = batch
        self.width = n = options.num_beams
        self.candidates = max(2 * n, options.top_k)  # per row: enough for the 2n best of a sentence
        # Only the first beam of a sentence is live at the start: the others are copies of it.
        self.running = np.zeros((batch, n))  # (b, n) float64, best first
        self.running[:, 1:] = _NEG
        self.finished: list[list[_Finished]] = [[] for _ in range(batch)]
        self.improvable = np.ones(batch, dtype=bool)  # generate()'s is_early_stop_heuristic_unsatisfied
        self.history: list[_StepRecord] = []

    def _log_probs(self, step: int, decoder_ids: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> ids (rows, K), their processed log-probs (rows, K) float64, best first; non-finite rows."""
        p, eos, k = self.processors, self.special.eos, self.candidates
        rows = logits.shape[0]
        repeated = p.repeated(decoder_ids)
        banned = p.banned(decoder_ids)
        raw = None if repeated is None else logits[repeated].astype(np.float64)  # before any mask
        excluded = banned
        if repeated is not None:  # scored exactly below, so left out of the top-k
            excluded = repeated if banned is None else tuple(np.concatenate(x) for x in zip(banned, repeated))
        non_finite, lse, masked_lse, top = _on_row_blocks(
            _beam_rows, logits, (), excluded, self.threads, p.bad, p.mask_eos(step), eos, k, p.renormalize
        )
        values = np.take_along_axis(logits, top, axis=-1) - lse  # (rows, K) float64
        norm = None if masked_lse is None else masked_lse - lse  # log of the mass the masks leave
        if repeated is not None:
            r, ids = repeated
            penalised = p.penalise(raw - lse[r, 0])
            penalised[p.is_masked(ids, r, step, banned)] = -np.inf
            for row in np.unique(r):
                mine = r == row
                cand_ids = np.concatenate([top[row], ids[mine]])
                cand_values = np.concatenate([values[row], penalised[mine]])
                order = np.lexsort((cand_ids, -cand_values))[:k]
                top[row], values[row] = cand_ids[order], cand_values[order]
                if norm is not None:
                    norm[row, 0] = np.logaddexp(norm[row, 0], np.logaddexp.reduce(penalised[mine]))
        if norm is not None:  # renormalize_logits: log_softmax again after the processors
            values -= norm
        forced = p.forced(step)
        for row in range(rows):
            # A NaN row is scored as eos alone so its beam ends (reported as a non-finite step);
            # a forced step has one token at log-prob 0, as generate()'s processors set it.
            only = forced if forced is not None else eos if non_finite[row] else None
            if only is not None:
                others = top[row][top[row] != only][: k - 1]
                top[row, 0], top[row, 1:] = only, others
                values[row, 0], values[row, 1:] = 0.0, -np.inf
        return top, values, non_finite

    def update(self, step: int, decoder_ids: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """logits (b * n, V) -> (the next rows' decoder ids, the row each continues, whether all are done)."""
        o, eos = self.options, self.special.eos
        b, n, vocab = self.batch, self.width, logits.shape[1]
        ids, values, non_finite = self._log_probs(step, decoder_ids, logits)  # (b * n, K)
        # 2. the best 2n continuations of each sentence over its n beams
        keep = 2 * n
        scores = (self.running.reshape(-1, 1) + values[:, :keep]).reshape(b, n * keep)
        beam = np.repeat(np.arange(n), keep)  # (n * keep,) the local beam of each column
        tokens = ids[:, :keep].reshape(b, n * keep)
        order = np.lexsort((beam * vocab + tokens, -scores), axis=-1)[:, :keep]  # (b, 2n)
        top_scores = np.take_along_axis(scores, order, axis=-1)
        top_beams = beam[order]
        top_tokens = np.take_along_axis(tokens, order, axis=-1)
        top_logprobs = np.take_along_axis(values[:, :keep].reshape(b, n * keep), order, axis=-1)
        # 3. stops, and the n best that go on
        hits = (top_tokens == eos) | (step + 1 >= o.max_new_tokens)
        running = top_scores + hits * _NEG
        nxt = np.argsort(-running, axis=-1, kind="stable")[:, :n]  # (b, n)
        offsets = (np.arange(b) * n)[:, None]
        beam_idx = (np.take_along_axis(top_beams, nxt, axis=-1) + offsets).reshape(-1)  # (b * n,)
        new_tokens = np.take_along_axis(top_tokens, nxt, axis=-1).reshape(-1)
        self.history.append(
            _StepRecord(
                parent=beam_idx,
                token=new_tokens,
                logprob=np.take_along_axis(top_logprobs, nxt, axis=-1).reshape(-1),
                top_ids=ids[:, : o.top_k],
                top_logprobs=values[:, : o.top_k],
                non_finite=non_finite,
            )
        )
        # 4. finished hypotheses (using the heuristic's verdict from the previous step)
        length_norm = (step + 1) ** o.length_penalty
        for s in range(b):
            done = self.finished[s]
            if not self.improvable[s] or (o.early_stopping is True and len(done) == n):
                continue
            new = [
                _Finished(float(top_scores[s, j] / length_norm), step, int(offsets[s, 0] + top_beams[s, j]),
                          int(top_tokens[s, j]), float(top_logprobs[s, j]))
                for j in range(n)
                if hits[s, j] and np.isfinite(top_scores[s, j])
            ]
            if new:
                merged = done + new
                merged.sort(key=lambda h: -h.score)  # stable: the earlier one first on a tie
                self.finished[s] = merged[:n]
        self.running = np.take_along_axis(running, nxt, axis=-1)
        # 5. can a running beam still beat the worst finished one?
        if o.early_stopping == "never" and o.length_penalty > 0.0:
            best_length = o.max_new_tokens
        else:
            best_length = step + 1
        best = self.running[:, 0] / best_length**o.length_penalty
        worst = np.array([min(h.score for h in f) if len(f) == n else _NEG for f in self.finished])
        self.improvable &= best > worst
        full = all(len(f) == n for f in self.finished)
        go_on = self.improvable.any() and not (full and o.early_stopping is True) and not hits.all()
        next_ids = np.concatenate([decoder_ids[beam_idx], new_tokens[:, None]], axis=1)
        return next_ids, beam_idx, not go_on

    def _read_back(self, h: _Finished) -> tuple[list[StepScore], list[int]]:
        """The steps of a finished hypothesis, first to last, and its non-finite steps."""
        steps, non_finite = [], []
        token, logprob, row = h.token, h.logprob, h.row
        for step in range(h.step, -1, -1):
            rec = self.history[step]
            steps.append(StepScore(int(token), float(logprob), rec.top_ids[row].tolist(), rec.top_logprobs[row].tolist()))
            if rec.non_finite[row]:
                non_finite.append(step)
            if step:
                prev = self.history[step - 1]
                token, logprob, row = prev.token[row], prev.logprob[row], prev.parent[row]
        return steps[::-1], non_finite[::-1]

    def finish(self, timings: dict[str, float]) -> list[RowResult]:
        o, eos = self.options, self.special.eos
        last = len(self.history) - 1
        results = []
        for s in range(self.batch):
            hyps = list(self.finished[s])
            if len(hyps) < o.num_return_sequences:  # never seen: the loop ends with n finished
                rec = self.history[last]
                for j in range(self.width):
                    row = s * self.width + j
                    score = self.running[s, j] / (last + 1) ** o.length_penalty
                    hyps.append(_Finished(float(score), last, int(rec.parent[row]), int(rec.token[row]), float(rec.logprob[row])))
            out = []
            for h in hyps[: o.num_return_sequences]:
                steps, non_finite = self._read_back(h)
                out.append((steps, non_finite, h.score))
            steps, non_finite, score = out[0]
            ids = [t.token_id for t in steps]
            capped = len(ids) == o.max_new_tokens and (ids[-1] != eos or self.processors.forced_eos is not None)
            results.append(
                RowResult(
                    token_ids=ids,
                    scores=steps,
                    stop_reason="max_new_tokens" if capped or ids[-1] != eos else "eos",
                    timings_ms=timings,
                    non_finite_steps=non_finite,
                    repeated_run=_longest_run(ids),
                    score=score,
                    hypotheses=[([t.token_id for t in st], sc) for st, _, sc in out],
                )
            )
        return results


# --- the loop -------------------------------------------------------------------------------------


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
    if options.num_beams is None or options.min_new_tokens is None:
        raise ValueError("decode() takes resolved options: DecodeOptions(...).resolved(limit, defaults)")
    batch = input_ids.shape[0]
    strategy = GreedyDecoder if options.num_beams == 1 else BeamSearchDecoder
    decoder = strategy(batch, special, options, rules, threads)
    if decoder.width > 1:
        missing = [m for m in ("expand", "reorder") if not callable(getattr(model, m, None))]
        if missing:
            raise TypeError(f"beam search needs {' and '.join(missing)}() on {type(model).__name__} (see StepModel)")

    start = time.perf_counter()
    state = model.encode(input_ids, attention_mask)
    if decoder.width > 1:
        model.expand(state, decoder.width)  # (b, ...) -> (b * n, ...), once: rows [s0 x n, s1 x n, ...]
    encoded = time.perf_counter()

    decoder_ids = np.full((batch * decoder.width, 1), special.decoder_start, dtype=np.int64)  # (rows, t)
    first_token = None
    for step in range(options.max_new_tokens):
        # A fresh (rows, V) array each step (a view of the engine's output): masked in place.
        logits = np.asarray(model.step(state, decoder_ids), dtype=np.float32)
        decoder_ids, beam_idx, done = decoder.update(step, decoder_ids, logits)
        if first_token is None:
            first_token = time.perf_counter()
        if done:
            break
        if beam_idx is not None and not np.array_equal(beam_idx, np.arange(len(beam_idx))):
            model.reorder(state, beam_idx)
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
    return decoder.finish(timings)


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
