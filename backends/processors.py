"""generate()'s logits processors, one small class each, in `_get_logits_processor`'s order.

Each step a token decoder calls `prepare` on every processor once (it reads the rows' decoder ids
so far, decoder start included, as generate()'s processors do, vectorised over the rows), then the
processors act in place on row blocks of that step's scores (`__call__`, on the block's thread:
see `scoring.py`), as whole-array numpy operations rather than a Python loop over the rows.

Greedy search applies the list to the raw logits, as generate()'s `_sample` does. Beam search
applies it to log-probabilities; since a mask (-inf) is the same before and after log_softmax's
shift, beam search applies the `Mask` processors to the logits and handles the others itself
(`scoring.beam_scores`). A new mask is one `Mask` subclass here and one test.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .generation import GenerationDefaults, SpecialTokens
from .options import DecodeOptions

Pairs = tuple[np.ndarray, np.ndarray]  # (rows, ids): single entries of a (rows, V) array


@dataclass(slots=True)
class RowBlock:
    """Rows lo .. hi of a step's scores, as one thread sees them."""

    lo: int
    hi: int
    whole: bool  # the block is every row of the step
    non_finite: np.ndarray | None  # (hi - lo,) rows whose raw logits hold NaN or +-inf; None until known
    finished: np.ndarray | None  # (hi - lo,) greedy search's finished rows; None in beam search

    def entries(self, pairs: Pairs) -> Pairs:
        """The entries (rows, ids) of a step that fall in this block, rows counted from its first."""
        if self.whole:
            return pairs
        keep = (pairs[0] >= self.lo) & (pairs[0] < self.hi)
        return pairs[0][keep] - self.lo, pairs[1][keep]


def unique_per_row(ids: np.ndarray) -> Pairs:
    """ids (r, t) -> (rows, ids) with every id of a row once."""
    order = np.sort(ids, axis=1)
    first = np.ones(order.shape, dtype=bool)
    first[:, 1:] = order[:, 1:] != order[:, :-1]
    rows, cols = np.nonzero(first)
    return rows, order[rows, cols]


class LogitsProcessor:
    """One processor: `prepare` once per step over every row, then `__call__` per row block."""

    def prepare(self, step: int, decoder_ids: np.ndarray) -> None:
        """decoder_ids (r, t): the computed rows' ids so far, this step's scores' rows in order."""

    def __call__(self, scores: np.ndarray, block: RowBlock) -> None:
        """Act in place on scores (hi - lo, V), rows block.lo .. block.hi of the step."""
        raise NotImplementedError


class Mask(LogitsProcessor):
    """A processor that only sets entries to -inf: masks commute with each other and with the
    log_softmax shift, so both searches apply them to the logits before the top-k."""

    def masked(self, rows: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
        """Whether the entries (rows, ids) are masked this step; None: none of them is."""
        raise NotImplementedError

    def excluded(self) -> tuple[np.ndarray, Pairs | None]:
        """What this step masks, as the compiled beam scoring takes it (`native.beam_rows`): the
        ids masked in every row (int64), and the (rows, ids) masked in some rows only."""
        raise NotImplementedError


_NONE = np.zeros(0, dtype=np.int64)


def _pairs_masked(pairs: Pairs | None, rows: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
    if pairs is None or not len(pairs[0]):
        return None
    width = int(max(ids.max(initial=0), pairs[1].max()) + 1)
    # A binary search in the few masked entries, sorted: np.isin sorts both sides together.
    keys = np.sort(pairs[0] * width + pairs[1])
    query = rows * width + ids
    at = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
    return keys[at] == query


class RepetitionPenalty(LogitsProcessor):
    """RepetitionPenaltyLogitsProcessor: every id already in the row scores * penalty where its
    score is negative, / penalty otherwise (> 1 discourages repeats)."""

    def __init__(self, penalty: float):
        self.penalty = penalty
        self.pairs: Pairs | None = None

    def prepare(self, step: int, decoder_ids: np.ndarray) -> None:
        self.pairs = unique_per_row(decoder_ids)

    def penalise(self, scores: np.ndarray) -> np.ndarray:
        return np.where(scores < 0, scores * self.penalty, scores / self.penalty)

    def __call__(self, scores: np.ndarray, block: RowBlock) -> None:
        pairs = block.entries(self.pairs)
        scores[pairs] = self.penalise(scores[pairs])


class NoRepeatNGram(Mask):
    """NoRepeatNGramLogitsProcessor: an n-gram already in the row may not appear again, so every
    earlier window that matches the row's last n - 1 ids bans the id that followed it."""

    def __init__(self, n: int):
        self.n = n
        self.pairs: Pairs | None = None

    def prepare(self, step: int, decoder_ids: np.ndarray) -> None:
        t, n = decoder_ids.shape[1], self.n
        if t < n:
            self.pairs = None
            return
        # Window w is ids[w : w + n], compared one position at a time (n - 1 slices): cheaper than
        # a sliding_window_view of every window.
        count = t - n + 1
        hit = np.ones((decoder_ids.shape[0], count), dtype=bool)
        for j in range(n - 1):
            hit &= decoder_ids[:, j : j + count] == decoder_ids[:, t - n + 1 + j, None]
        r, w = np.nonzero(hit)
        self.pairs = r, decoder_ids[r, w + n - 1]

    def __call__(self, scores: np.ndarray, block: RowBlock) -> None:
        if self.pairs is not None:
            scores[block.entries(self.pairs)] = -np.inf

    def masked(self, rows: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
        return _pairs_masked(self.pairs, rows, ids)

    def excluded(self) -> tuple[np.ndarray, Pairs | None]:
        return _NONE, self.pairs


class NoBadWords(Mask):
    """NoBadWordsLogitsProcessor: a single-token bad word is masked at every step; a longer one's
    last token is masked where the row ends with the rest of it."""

    def __init__(self, single: np.ndarray, multi: list[tuple[np.ndarray, int]]):
        self.single = single  # (k,) int64 ids
        self.multi = multi  # (prefix ids, last id)
        self.pairs: Pairs | None = None

    def prepare(self, step: int, decoder_ids: np.ndarray) -> None:
        t = decoder_ids.shape[1]
        rows, ids = [], []
        for prefix, last in self.multi:
            if len(prefix) <= t:
                r = np.flatnonzero((decoder_ids[:, t - len(prefix) :] == prefix).all(axis=-1))
                rows.append(r)
                ids.append(np.full(len(r), last, dtype=np.int64))
        self.pairs = (np.concatenate(rows), np.concatenate(ids)) if rows else None

    def __call__(self, scores: np.ndarray, block: RowBlock) -> None:
        scores[:, self.single] = -np.inf
        if self.pairs is not None:
            scores[block.entries(self.pairs)] = -np.inf

    def masked(self, rows: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
        # A broadcast comparison for the usual one or few ids: np.isin sorts both sides
        masked = (ids[:, None] == self.single).any(axis=1) if len(self.single) <= 16 else np.isin(ids, self.single)
        by_prefix = _pairs_masked(self.pairs, rows, ids)
        return masked if by_prefix is None else masked | by_prefix

    def excluded(self) -> tuple[np.ndarray, Pairs | None]:
        return self.single, self.pairs


class MinNewTokens(Mask):
    """MinNewTokensLengthLogitsProcessor: eos is masked until `min_new` tokens exist."""

    def __init__(self, min_new: int, eos: int):
        self.min_new, self.eos = min_new, eos
        self.active = False

    def prepare(self, step: int, decoder_ids: np.ndarray) -> None:
        self.active = step < self.min_new

    def __call__(self, scores: np.ndarray, block: RowBlock) -> None:
        if self.active:
            scores[:, self.eos] = -np.inf

    def masked(self, rows: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
        return ids == self.eos if self.active else None

    def excluded(self) -> tuple[np.ndarray, Pairs | None]:
        return np.array([self.eos] if self.active else [], dtype=np.int64), None


class NonFiniteEndsAtEos(LogitsProcessor):
    """Not one of generate()'s: a row whose raw logits hold NaN or +-inf would make the argmax
    meaningless, so it scores eos alone and ends there, and the step is reported (a finished row is
    left alone). Placed before the forced tokens, which override it."""

    def __init__(self, eos: int):
        self.eos = eos

    def __call__(self, scores: np.ndarray, block: RowBlock) -> None:
        bad = block.non_finite if block.finished is None else block.non_finite & ~block.finished
        for row in np.flatnonzero(bad):  # rare: one write per broken row
            scores[row] = -np.inf
            scores[row, self.eos] = 0.0


class ForcedToken(LogitsProcessor):
    """At one step, every token but `token` is -inf and `token` scores 0."""

    def __init__(self, token: int, at_step: int):
        self.token, self.at_step = token, at_step
        self.now: int | None = None  # the token forced this step, if any

    def prepare(self, step: int, decoder_ids: np.ndarray) -> None:
        self.now = self.token if step == self.at_step else None

    def __call__(self, scores: np.ndarray, block: RowBlock) -> None:
        if self.now is not None:
            scores[:] = -np.inf
            scores[:, self.now] = 0.0


class ForcedBOS(ForcedToken):
    """ForcedBOSTokenLogitsProcessor: the first generated token (a target language code)."""

    def __init__(self, token: int):
        super().__init__(token, 0)


class ForcedEOS(ForcedToken):
    """ForcedEOSTokenLogitsProcessor: eos at the length cap. Beam search only: greedy search reports
    a cut at max_new_tokens ("max_new_tokens", no eos), the contract its results keep, while in
    beam search it changes which hypotheses win (and their scores)."""

    def __init__(self, token: int, max_new_tokens: int):
        super().__init__(token, max_new_tokens - 1)


class Renormalize(LogitsProcessor):
    """LogitNormalization (renormalize_logits): log_softmax again after the other processors.
    Greedy search's log-probs are always over the masked row, so only beam search acts on it."""

    def __call__(self, scores: np.ndarray, block: RowBlock) -> None:
        pass


def logits_processors(
    special: SpecialTokens, options: DecodeOptions, rules: GenerationDefaults, beams: bool
) -> list[LogitsProcessor]:
    """The processors a call applies, in generate()'s order, from the request's options and the
    model's fixed rules."""
    eos = special.eos
    out: list[LogitsProcessor] = []
    if options.repetition_penalty != 1.0:
        out.append(RepetitionPenalty(options.repetition_penalty))
    if options.no_repeat_ngram_size:
        out.append(NoRepeatNGram(options.no_repeat_ngram_size))
    # A lone eos is never a bad word (generate()'s NoBadWordsLogitsProcessor drops it).
    single = {*special.bad_words_ids, *(ids[0] for ids in rules.bad_words_ids if len(ids) == 1)} - {eos}
    multi = [(np.array(ids[:-1], dtype=np.int64), ids[-1]) for ids in rules.bad_words_ids if len(ids) > 1]
    out.append(NoBadWords(np.array(sorted(single), dtype=np.int64), multi))
    if options.min_new_tokens:
        out.append(MinNewTokens(options.min_new_tokens, eos))
    out.append(NonFiniteEndsAtEos(eos))
    if rules.forced_bos_token_id is not None:
        out.append(ForcedBOS(rules.forced_bos_token_id))
    if beams and rules.forced_eos_token_id is not None:
        out.append(ForcedEOS(rules.forced_eos_token_id, options.max_new_tokens))
    if beams and rules.renormalize_logits:
        out.append(Renormalize())
    return out


def prepare(processors: list[LogitsProcessor], step: int, decoder_ids: np.ndarray) -> None:
    for p in processors:
        p.prepare(step, decoder_ids)
