"""The scoring's compiled row passes (backends/rows.c) against their definitions, and the numpy
fallback when they cannot be built."""

from __future__ import annotations

import numpy as np
import pytest

from backends import native
from backends.processors import NoBadWords, NonFiniteEndsAtEos, NoRepeatNGram, RepetitionPenalty, prepare
from backends.scoring import _compiled_beam_scores, _numpy_log_normalizer, beam_scores, log_normalizer, non_finite_rows


def _rows(vocab: int) -> np.ndarray:
    """Every kind of row a step can hand the scoring."""
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((10, vocab)) * 3).astype(np.float32)
    x[1] += 45.0  # a maximum too large for exp() unshifted
    x[2] -= 60.0  # and too small
    x[3, rng.integers(0, vocab, max(1, vocab // 50))] = -np.inf  # masked entries
    x[4, vocab // 2] = np.nan
    x[5, 3] = np.inf
    x[6] = -np.inf  # no finite entry
    x[7] = -np.inf
    x[7, vocab - 1] = 2.0  # one finite entry, in the ragged tail
    x[8, 0], x[8, -1] = np.inf, -np.inf
    return x


@pytest.mark.parametrize("vocab", [15123, 4096, 255, 17])
def test_the_log_normalizer_and_finite_check_match_float64(vocab, row_kernels):
    x = _rows(vocab)
    lse = log_normalizer(x.copy())[:, 0]
    finite = [0, 1, 2, 3, 7]  # rows with a finite entry and no NaN or +inf
    want = np.logaddexp.reduce(x[finite].astype(np.float64), axis=1)
    np.testing.assert_allclose(lse[finite], want, rtol=0, atol=2e-6)
    # the others: numpy's own answer, whichever path ran
    others = [4, 5, 6, 8]
    assert np.array_equal(lse[others], _numpy_log_normalizer(x[others].copy())[:, 0], equal_nan=True)
    if row_kernels == "compiled":
        lse_c, non_finite = native.log_normalizer(x)
        assert non_finite.tolist() == non_finite_rows(x).tolist() == [i in (3, 4, 5, 6, 7, 8) for i in range(10)]
        np.testing.assert_allclose(lse_c[finite], want, rtol=0, atol=2e-6)
        assert np.isnan(lse_c[[4, 5, 6, 8]]).all()  # left to numpy, which the dispatch above used


def _reference_beam_step(logits, history, penalty, banned, k):
    """generate()'s beam-search scoring by definition: float64 log_softmax of the raw row, the
    penalty on the ids the row holds, the bans, then a stable sort by (-value, id)."""
    lp = logits.astype(np.float64)
    lp = lp - np.logaddexp.reduce(lp, axis=1, keepdims=True)
    for r, row in enumerate(history):
        seen = np.unique(row)
        lp[r, seen] = np.where(lp[r, seen] < 0, lp[r, seen] * penalty, lp[r, seen] / penalty)
    for r, ids in banned.items():
        lp[r, ids] = -np.inf
    order = np.lexsort((np.broadcast_to(np.arange(lp.shape[1]), lp.shape), -lp), axis=-1)[:, :k]
    return order, np.take_along_axis(lp, order, axis=-1)


def test_a_beam_step_with_penalty_and_bans_scores_as_its_definition(row_kernels):
    rng = np.random.default_rng(3)
    rows, vocab, k, bad = 48, 15123, 8, 15122
    history = rng.integers(2, 9, (rows, 7))  # few distinct ids: repeated bigrams, so n-gram bans
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    logits[np.arange(rows)[:, None], history] += 9.0  # the penalised ids compete for the top-k
    logits[:, bad] += 20.0  # the bad word would be every row's best
    processors = [RepetitionPenalty(1.3), NoRepeatNGram(2), NoBadWords(np.array([bad]), []), NonFiniteEndsAtEos(0)]
    prepare(processors, 6, history)
    ids, values, non_finite = beam_scores(logits.copy(), processors, k, threads=2)
    fused = _compiled_beam_scores(logits.copy(), processors[1:3], processors[0], k, 2)
    assert (fused is not None) == (row_kernels == "compiled")  # the one-call path is the one checked
    banned = {r: [bad] for r in range(rows)}
    for r, token in zip(*processors[1].pairs):
        banned[int(r)].append(int(token))
    assert sum(len(b) > 1 for b in banned.values()) > rows // 4  # the n-gram rule did ban ids
    want_ids, want_values = _reference_beam_step(logits, history, 1.3, banned, k)
    assert not non_finite.any()
    assert np.array_equal(ids, want_ids)
    np.testing.assert_allclose(values, want_values, rtol=0, atol=2e-6)
    assert np.isin(ids, history).any(axis=1).mean() > 0.5  # penalised ids did enter most rows' top-k


@pytest.mark.parametrize("capped", [False, True])
def test_beam_search_s_choice_of_continuations_matches_its_numpy_definition(capped):
    """rows.c's beam_select against beam_search._select: ties in score go to the lower beam, then
    the lower id, ties among the running ones to the earlier; eos hits; NaN ranks last; -inf and
    -1e9 running scores (a beam not yet live) take part as numbers."""
    from backends.beam_search import _NEG, _select

    if native.library() is None:
        pytest.skip(f"no compiled passes here: {native.why_not()}")
    rng = np.random.default_rng(7)
    b, n, width, vocab, eos = 40, 4, 9, 50, 3
    running = np.round(rng.standard_normal((b, n)), 1)
    running[0, 1:] = _NEG  # the first step: one live beam
    values = -np.sort(np.round(rng.exponential(1.0, (b * n, width)), 1), axis=1)  # coarse: many ties
    ids = np.stack([rng.permutation(vocab)[:width] for _ in range(b * n)])
    ids[rng.random((b * n, width)) < 0.15] = eos
    values[5, 3:] = -np.inf
    values[9, 0] = np.nan
    running[11] = running[11, 0]  # every beam of a sentence level
    got = native.beam_select(running, ids, values, 2 * n, vocab, eos, capped)
    want = _select(running, ids, values, 2 * n, vocab, eos, capped)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.array_equal(g, w, equal_nan=True)


def test_without_a_compiler_the_scoring_runs_in_numpy_and_says_why(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    native.reset()
    try:
        assert native.library() is None
        assert native.describe() == "numpy (no C compiler (cc, gcc or clang) on PATH)"
        x = _rows(300)
        np.testing.assert_allclose(log_normalizer(x.copy())[[0, 1, 2], 0],
                                   np.logaddexp.reduce(x[:3].astype(np.float64), axis=1), rtol=0, atol=2e-6)
    finally:
        native.reset()


def test_a_build_that_fails_is_reported_with_the_compiler_s_words(tmp_path, monkeypatch):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: no such target' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    native.reset()
    try:
        assert native.library() is None
        assert "could not build rows.c" in native.why_not() and "no such target" in native.why_not()
    finally:
        native.reset()


def test_a_build_is_cached_per_source_compiler_and_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.reset()
    if native.library() is None and native.why_not().startswith("no C compiler"):
        pytest.skip(native.why_not())
    assert native.library() is not None
    built = sorted((tmp_path / "translation-migration" / "native").glob("rows-*.so"))
    stamp = built[0].stat().st_mtime_ns
    native.reset()
    assert native.library() is not None
    assert sorted((tmp_path / "translation-migration" / "native").glob("rows-*.so")) == built
    assert len(built) == 1 and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    native.reset()
