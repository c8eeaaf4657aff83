"""generate()'s logits processors, as one object the token decoders consult each step.

transformers 5.24 `_get_logits_processor` builds them from the generation config; here they are
built from the request's `DecodeOptions` and the model's fixed rules (`GenerationDefaults`).
"""

from __future__ import annotations

import numpy as np

from .base import DecodeOptions
from .manifest import GenerationDefaults, SpecialTokens
from .scoring import Pairs

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
            # Window w is ids[w : w + n]; compared one position at a time (n - 1 slices), which is
            # 21 us against 37 for the same through sliding_window_view (batch 32, 16 ids).
            count = t - n + 1
            hit = np.ones((decoder_ids.shape[0], count), dtype=bool)
            for j in range(n - 1):
                hit &= decoder_ids[:, j : j + count] == decoder_ids[:, t - n + 1 + j, None]
            r, w = np.nonzero(hit)
            rows.append(r)
            ids.append(decoder_ids[r, w + n - 1])
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
