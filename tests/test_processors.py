"""Each logits processor on its own: what it masks, penalises or forces on a small batch.

Parity with generate() end to end is tests/test_beam.py's; these pin each class's own rule, a row
block at a time as the scoring threads apply them, and how the two searches score with them.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.generation import GenerationDefaults, SpecialTokens
from backends.options import DecodeOptions
from backends.processors import (
    ForcedBOS,
    ForcedEOS,
    MinNewTokens,
    NoBadWords,
    NonFiniteEndsAtEos,
    NoRepeatNGram,
    RepetitionPenalty,
    Renormalize,
    RowBlock,
    logits_processors,
    prepare,
)
from backends.scoring import beam_scores, greedy_scores

V, EOS = 12, 1


def _block(rows: int, lo: int = 0, non_finite=None, finished=None) -> RowBlock:
    non_finite = np.zeros(rows, bool) if non_finite is None else np.asarray(non_finite)
    return RowBlock(lo, lo + rows, False, non_finite, finished)


def _scores(rows: int = 3) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((rows, V)).astype(np.float32)


def test_repetition_penalty_divides_positive_and_multiplies_negative_scores_of_ids_in_the_row():
    p = RepetitionPenalty(2.0)
    ids = np.array([[0, 4, 4, 7], [0, 3, 9, 3]])
    p.prepare(3, ids)
    x = np.array([[2.0] * V, [-2.0] * V], dtype=np.float32)
    before = x.copy()
    p(x, _block(2))
    expected = before.copy()
    expected[0, [0, 4, 7]] = 1.0  # positive / 2
    expected[1, [0, 3, 9]] = -4.0  # negative * 2
    assert np.array_equal(x, expected)


def test_repetition_penalty_in_a_row_block_touches_only_its_rows():
    p = RepetitionPenalty(2.0)
    p.prepare(1, np.array([[0, 5], [0, 6], [0, 7]]))
    x = np.full((2, V), 4.0, dtype=np.float32)  # rows 1 and 2 of the step
    p(x, _block(2, lo=1))
    assert np.flatnonzero(x[0] != 4.0).tolist() == [0, 6] and np.flatnonzero(x[1] != 4.0).tolist() == [0, 7]


def test_no_repeat_ngram_bans_the_token_that_completed_an_earlier_ngram():
    p = NoRepeatNGram(3)
    ids = np.array([[0, 5, 6, 8, 5, 6], [0, 5, 6, 7, 8, 9]])  # row 0 ends with 5 6, seen before 8
    p.prepare(5, ids)
    x = _scores(2)
    p(x, _block(2))
    assert np.flatnonzero(np.isneginf(x[0])).tolist() == [8] and not np.isneginf(x[1]).any()
    assert p.masked(np.array([0, 0, 1]), np.array([8, 7, 8])).tolist() == [True, False, False]
    p.prepare(1, ids[:, :2])  # shorter than n: nothing to ban
    assert p.masked(np.array([0]), np.array([8])) is None


def test_no_bad_words_masks_single_ids_always_and_the_last_of_a_sequence_after_its_prefix():
    p = NoBadWords(np.array([3], np.int64), [(np.array([6, 7]), 9)])
    ids = np.array([[0, 6, 7], [0, 7, 6]])
    p.prepare(2, ids)
    x = _scores(2)
    p(x, _block(2))
    assert np.flatnonzero(np.isneginf(x[0])).tolist() == [3, 9]
    assert np.flatnonzero(np.isneginf(x[1])).tolist() == [3]
    assert p.masked(np.array([0, 1, 1]), np.array([9, 9, 3])).tolist() == [True, False, True]


def test_min_new_tokens_masks_eos_until_the_minimum_is_reached():
    p = MinNewTokens(2, EOS)
    for step, masked in ((0, True), (1, True), (2, False)):
        p.prepare(step, np.zeros((2, step + 1), np.int64))
        x = _scores(2)
        p(x, _block(2))
        assert np.isneginf(x[:, EOS]).all() == masked and np.isneginf(x).sum() == 2 * masked
        assert (p.masked(np.array([0, 1]), np.array([EOS, 4])) is not None) == masked


def test_a_non_finite_row_scores_eos_alone_unless_it_is_finished():
    p = NonFiniteEndsAtEos(EOS)
    x = _scores(3)
    x[[1, 2], 4] = np.nan
    p(x, _block(3, non_finite=[False, True, True], finished=np.array([False, False, True])))
    assert np.isfinite(x[0]).all() and np.isnan(x[2, 4])  # a finished row is left alone
    assert x[1, EOS] == 0.0 and np.isneginf(np.delete(x[1], EOS)).all()


@pytest.mark.parametrize("cls,step", [(ForcedBOS, 0), (ForcedEOS, 4)])
def test_forced_tokens_leave_one_token_at_their_step_only(cls, step):
    p = ForcedBOS(9) if cls is ForcedBOS else ForcedEOS(9, max_new_tokens=5)
    for at in (step, step + 1):
        p.prepare(at, np.zeros((2, at + 1), np.int64))
        x = _scores(2)
        p(x, _block(2))
        if at == step:
            assert p.now == 9 and (x[:, 9] == 0).all() and np.isneginf(np.delete(x, 9, axis=1)).all()
        else:
            assert p.now is None and np.isfinite(x).all()


def test_renormalize_makes_beam_log_probs_sum_to_one_over_what_the_masks_leave(row_kernels):
    logits = _scores(2)
    masks = [NoBadWords(np.array([3, 4, 5], np.int64), [])]
    for renormalize in (False, True):
        processors = masks + [NonFiniteEndsAtEos(EOS)] + ([Renormalize()] if renormalize else [])
        prepare(processors, 1, np.zeros((2, 2), np.int64))
        ids, values, _ = beam_scores(logits.copy(), processors, V)
        assert set(ids[:, -3:].reshape(-1).tolist()) == {3, 4, 5} and np.isneginf(values[:, -3:]).all()
        mass = np.exp(values[:, :-3]).sum(axis=1)
        if renormalize:
            np.testing.assert_allclose(mass, 1.0, atol=1e-6)
        else:
            assert (mass < 1.0 - 1e-3).all()


def test_beam_scores_the_penalised_ids_exactly_from_the_raw_log_probs(row_kernels):
    logits = _scores(2)
    penalty = RepetitionPenalty(1.5)
    processors = [penalty, NonFiniteEndsAtEos(EOS)]
    ids = np.array([[0, 7], [0, 2]])
    prepare(processors, 1, ids)
    top, values, _ = beam_scores(logits.copy(), processors, V)
    raw = logits.astype(np.float64)
    lp = raw - np.log(np.exp(raw).sum(axis=1, keepdims=True))
    for row, repeated in ((0, [0, 7]), (1, [0, 2])):
        want = lp[row].copy()
        want[repeated] = np.where(want[repeated] < 0, want[repeated] * 1.5, want[repeated] / 1.5)
        got = dict(zip(top[row].tolist(), values[row].tolist()))
        for token in range(V):
            assert got[token] == pytest.approx(want[token], abs=2e-6), (row, token)


def test_greedy_log_probs_are_over_the_tokens_the_processors_leave():
    logits = _scores(2)
    processors = [NoBadWords(np.array([3], np.int64), []), MinNewTokens(1, EOS), NonFiniteEndsAtEos(EOS)]
    prepare(processors, 0, np.zeros((2, 1), np.int64))
    _, top, values = greedy_scores(logits.copy(), np.zeros(2, bool), processors, 3)
    masked = logits.astype(np.float64)
    masked[:, [3, EOS]] = -np.inf
    lp = masked - np.log(np.exp(masked).sum(axis=1, keepdims=True))
    assert not np.isin(top, [3, EOS]).any()
    np.testing.assert_allclose(values, np.take_along_axis(lp, top, axis=1), atol=2e-6)


def test_the_processors_come_in_generate_order_and_greedy_search_neither_forces_eos_nor_renormalizes():
    special = SpecialTokens(pad=0, eos=EOS, unk=2, decoder_start=0, bad_words_ids=(3,))
    rules = GenerationDefaults(bad_words_ids=((EOS,), (4, 5)), forced_bos_token_id=6, forced_eos_token_id=EOS,
                               renormalize_logits=True)
    options = DecodeOptions(min_new_tokens=2, no_repeat_ngram_size=2, repetition_penalty=1.2).resolved(8, rules)
    beams = logits_processors(special, options, rules, beams=True)
    assert [type(p) for p in beams] == [RepetitionPenalty, NoRepeatNGram, NoBadWords, MinNewTokens,
                                        NonFiniteEndsAtEos, ForcedBOS, ForcedEOS, Renormalize]
    assert beams[2].single.tolist() == [3]  # a lone eos is never a bad word
    greedy = logits_processors(special, options, rules, beams=False)
    assert [type(p) for p in greedy] == [RepetitionPenalty, NoRepeatNGram, NoBadWords, MinNewTokens,
                                         NonFiniteEndsAtEos, ForcedBOS]
    plain = logits_processors(special, DecodeOptions().resolved(8), GenerationDefaults(), beams=False)
    assert [type(p) for p in plain] == [NoBadWords, NonFiniteEndsAtEos]


def test_a_mask_says_which_entries_it_masks_as_a_set_membership_would():
    """`masked` answers, for any (row, id) entries, whether the mask holds them: checked against
    np.isin on random entries, with repeats, entries past the mask's largest id, and an empty query."""
    rng = np.random.default_rng(3)
    mask = NoRepeatNGram(2)
    for _ in range(20):
        mask.pairs = rng.integers(0, 6, 40), rng.integers(0, 50, 40)
        rows, ids = rng.integers(0, 6, 300), rng.integers(0, 80, 300)
        want = np.isin(rows * 1000 + ids, mask.pairs[0] * 1000 + mask.pairs[1])
        assert np.array_equal(mask.masked(rows, ids), want)
        assert mask.masked(rows[:0], ids[:0]).shape == (0,)
    mask.pairs = None
    assert mask.masked(rows, ids) is None
