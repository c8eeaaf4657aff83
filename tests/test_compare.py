"""service/compare.py and backends/divergence.py: alignment on hand-made sequences, then real runs on the tiny backends."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from backends import BACKEND_NAMES, Backend, InputError
from backends.divergence import align, first_divergence
from backends.timing import summarize_runs
from service import compare, compare_iter, to_json
from service.limits import batches, check_repeat
from conftest import dev_sentences

SENTENCE = "Click outside the spreadsheet to view the slide."
MAX_NEW = 12  # the tiny random model rarely emits eos: cap it so each run stays short


# --- alignment, hand-made --------------------------------------------------------------------


@pytest.mark.parametrize(
    "ref, other, ops, first",
    [
        ([1, 2, 3, 0], [1, 2, 3, 0], ["same"] * 4, None),
        ([1, 2, 3, 0], [1, 9, 3, 0], ["same", "changed", "same", "same"], 1),
        # one inserted token: one extra row, the tail still aligns
        ([1, 2, 3, 0], [1, 2, 7, 3, 0], ["same", "same", "extra", "same", "same"], 2),
        # one dropped token
        ([1, 2, 3, 0], [1, 3, 0], ["same", "missing", "same", "same"], 1),
        # a prefix: the reference went on where the other stopped
        ([5, 6, 0], [5, 6], ["same", "same", "missing"], 2),
        # two changed, then one extra inside the same replaced block
        ([1, 2, 3, 0], [1, 8, 9, 4, 0], ["same", "changed", "changed", "extra", "same"], 1),
        ([], [4, 0], ["extra", "extra"], 0),
    ],
)
def test_align_and_first_divergence(ref, other, ops, first):
    rows = align(ref, other)
    assert [r.op for r in rows] == ops
    # every reference and every other token appears exactly once, in order
    assert [r.ref_id for r in rows if r.ref_id is not None] == ref
    assert [r.id for r in rows if r.id is not None] == other
    assert [r.step for r in rows if r.step is not None] == list(range(len(other)))
    assert first_divergence(ref, other) == first


def test_summarize_runs_marks_the_cold_run_and_uses_warm_ones():
    s = summarize_runs([100.0, 10.0, 14.0, 12.0])
    assert s["cold_ms"] == 100.0 and s["n"] == 4
    assert s["median_ms"] == 12.0 and s["min_ms"] == 10.0 and s["max_ms"] == 14.0 and s["spread_ms"] == 4.0
    one = summarize_runs([50.0])
    assert one["median_ms"] == one["cold_ms"] == 50.0 and one["spread_ms"] == 0.0


@pytest.mark.parametrize("bad", [0, 21, 1.5, "3", None, True])
def test_check_repeat_rejects(bad):
    with pytest.raises(ValueError, match="repeat must be an integer in 1..20"):
        check_repeat(bad)


def test_check_repeat_accepts_integral_floats():
    assert check_repeat(3.0) == 3 and check_repeat(1) == 1


# --- test doubles wrapping a real engine ------------------------------------------------------


class _Raising:
    """An engine whose decoder step fails, like a corrupt graph."""

    def __init__(self, inner):
        self.inner = inner

    def encode(self, input_ids, attention_mask):
        return self.inner.encode(input_ids, attention_mask)

    def step(self, state, decoder_ids):
        raise RuntimeError("decoder graph exploded")


class _SwapAtStep:
    """A real engine whose logits at one step have top-1 and top-2 swapped: a controlled flip."""

    def __init__(self, inner, step):
        self.inner, self.at = inner, step

    def encode(self, input_ids, attention_mask):
        return self.inner.encode(input_ids, attention_mask)

    def step(self, state, decoder_ids):
        logits = np.array(self.inner.step(state, decoder_ids), dtype=np.float32, copy=True)  # (b, V)
        if decoder_ids.shape[1] - 1 == self.at:
            for row in logits:
                a, b = np.argsort(-row, kind="stable")[:2]
                row[a], row[b] = row[b], row[a]
        return logits

    def expand(self, state, n):  # beam search: the engine's own
        return self.inner.expand(state, n)

    def reorder(self, state, beam_idx):
        return self.inner.reorder(state, beam_idx)


def _wrap(backend: Backend, name: str, model) -> Backend:
    return Backend(name, model, backend.tokenizer, backend.manifest, dict(backend.info))


# --- real runs on the tiny backends -----------------------------------------------------------


@pytest.fixture(scope="module")
def result(tiny_backends):
    streamed = list(compare_iter(tiny_backends, SENTENCE, max_new_tokens=MAX_NEW, repeat=2))
    return streamed


def test_streams_each_backend_in_load_order(result, tiny_backends):
    assert [r.name for r in result] == list(tiny_backends)
    assert [r.name for r in result][0] == "pytorch"


def test_fp32_backends_do_not_diverge(result):
    by = {r.name: r for r in result}
    ref = by["pytorch"].translation
    assert by["pytorch"].divergence is None and by["pytorch"].error is None
    assert len(ref.token_ids) == MAX_NEW
    for name in ("ort_fp32_single_step", "ort_fp32_kv_cache"):
        d = by[name].divergence
        assert by[name].translation.token_ids == ref.token_ids
        assert d["identical"] and d["first"] is None and d["agreement"] == 1.0
        assert [a["op"] for a in d["alignment"]] == ["same"] * MAX_NEW
        tf = d["teacher_forced"]
        assert tf["steps"] == MAX_NEW and len(tf["max_abs_dlogit"]) == MAX_NEW
        assert tf["max_abs_dlogit_overall"] < 1e-4
        assert tf["ref_token_rank"] == [0] * MAX_NEW and tf["steps_not_argmax"] == []
        np.testing.assert_allclose(tf["ref_token_prob"], tf["ref_token_prob_reference"], rtol=1e-4)


def test_fp16_drifts_measurably_but_within_bounds(result):
    tf = {r.name: r for r in result}["ort_fp16"].divergence["teacher_forced"]
    # half precision: clearly above fp32's ~1e-7 noise, far below a changed decision
    assert 1e-6 < tf["max_abs_dlogit_overall"] < 5e-2


def test_timings_and_repeat_summary(result):
    for r in result:
        assert r.error is None
        t = r.timings_ms
        assert set(t) >= {"tokenize", "encode", "first_token", "per_token", "decode", "total"}
        assert t["total"] > 0 and t["per_token"] > 0 and t["total"] >= t["decode"]
        assert r.runs["n"] == 2 and len(r.runs["totals_ms"]) == 2
        assert r.runs["median_ms"] == r.runs["totals_ms"][1]  # one warm run: its own total
        assert r.runs["cold_ms"] == r.runs["totals_ms"][0] > 0


def test_json_shape(tiny_backends):
    out = compare(tiny_backends, SENTENCE, max_new_tokens=4)
    assert out["reference"] == "pytorch"
    assert list(out["backends"]) == list(BACKEND_NAMES)
    for b in out["backends"].values():
        assert {"text", "tokens", "token_ids", "timings_ms", "divergence", "error"} <= set(b)
        assert len(b["tokens"]) == len(b["token_ids"]) == 4
    json.dumps(out)  # serialisable as is


# The `compare` API's JSON contract, key for key: a change here is a change for every API user.
CONTRACT = {
    "top": {"backends", "decoding", "reference", "segments"},
    "decoding": {
        "early_stopping", "length_penalty", "max_new_tokens", "min_new_tokens", "no_repeat_ngram_size", "num_beams",
        "repetition_penalty", "requested_num_beams", "strategy",
    },
    "split": {"chunked", "end", "start", "text"},
    "backend": {
        "divergence", "error", "info", "non_finite_steps", "repeated_run", "runs", "segments", "stop_reason",
        "text", "timings_ms", "token_ids", "tokens", "warnings",
    },
    "segment": {
        "divergence", "hypotheses", "non_finite_steps", "reference_rank", "repeated_run", "score", "stop_reason", "text",
        "token_ids", "tokens",
    },
    "hypothesis": {"score", "text", "token_ids"},
    "segment_divergence": {"agreement", "first_step", "identical", "length", "matching", "reference_length"},
    "divergence": {
        "agreement", "alignment", "first", "identical", "length", "matching", "reference_length", "reference_rank",
        "segment", "segments", "segments_identical", "teacher_forced",
    },
    "alignment": {"op", "ref", "ref_id", "ref_step", "step", "token", "token_id"},
    "first": {"step", "reference", "backend"},
    "step_view": {
        "margin_logprob", "margin_prob", "other_token_prob", "prob", "runner_up", "runner_up_prob", "token", "token_id",
    },
    "teacher_forced": {
        "max_abs_dlogit", "max_abs_dlogit_overall", "non_finite_mismatch_steps", "ref_token_prob",
        "ref_token_prob_reference", "ref_token_rank", "steps", "steps_not_argmax", "steps_top1_differs",
    },
    "runs": {"cold_ms", "max_ms", "median_ms", "min_ms", "n", "over", "spread_ms", "stdev_ms", "totals_ms"},
    "timings_ms": {"decode", "encode", "first_token", "per_token", "steps", "tokenize", "total", "engine"},
}  # fmt: skip


def test_json_contract_is_pinned(tiny_backends):
    """Every key of the `compare` JSON, on a two-segment input with a forced divergence."""
    flipped = dict(tiny_backends)
    kv = tiny_backends["ort_fp32_kv_cache"]
    flipped["ort_int8"] = _wrap(kv, "ort_int8", _SwapAtStep(kv.model, step=1))
    out = compare(flipped, "Click OK. Then close the window.", max_new_tokens=4, num_beams=2)
    assert set(out) == CONTRACT["top"] and set(out["decoding"]) == CONTRACT["decoding"]
    assert out["decoding"]["num_beams"] == 2 and out["decoding"]["requested_num_beams"] == 2
    assert all(set(s) == CONTRACT["split"] for s in out["segments"]) and len(out["segments"]) == 2
    for name, b in out["backends"].items():
        assert set(b) == CONTRACT["backend"], name
        assert set(b["runs"]) == CONTRACT["runs"] and set(b["timings_ms"]) == CONTRACT["timings_ms"]
        for seg in b["segments"]:
            assert set(seg) == CONTRACT["segment"] and len(seg["hypotheses"]) == 2
            assert all(set(h) == CONTRACT["hypothesis"] for h in seg["hypotheses"])
            if name != "pytorch":
                assert set(seg["divergence"]) == CONTRACT["segment_divergence"]
    d = out["backends"]["ort_int8"]["divergence"]
    assert set(d) == CONTRACT["divergence"] and not d["identical"]
    assert all(set(a) == CONTRACT["alignment"] for a in d["alignment"])
    assert set(d["first"]) == CONTRACT["first"]
    assert set(d["first"]["reference"]) == set(d["first"]["backend"]) == CONTRACT["step_view"]
    assert set(d["teacher_forced"]) == CONTRACT["teacher_forced"]


def test_controlled_flip_is_found_with_its_numbers(tiny_backends):
    kv = tiny_backends["ort_fp32_kv_cache"]
    flipped = _wrap(kv, "flipped", _SwapAtStep(kv.model, step=2))
    results = {
        r.name: r
        for r in compare_iter(
            {"pytorch": tiny_backends["pytorch"], "flipped": flipped}, SENTENCE, max_new_tokens=MAX_NEW
        )
    }
    ref, d = results["pytorch"].translation, results["flipped"].divergence
    first = d["first"]
    assert not d["identical"] and first["step"] == 2
    assert results["flipped"].translation.token_ids[:2] == ref.token_ids[:2]
    # the flipped backend took the reference's runner-up, with the reference's top-1 as its own runner-up
    assert first["backend"]["token"] == first["reference"]["runner_up"]
    assert first["backend"]["runner_up"] == first["reference"]["token"]
    # swapping two logits permutes the softmax: each backend gives its top-1 what the other gave its own
    assert math.isclose(first["backend"]["prob"], first["reference"]["prob"], rel_tol=1e-4)
    assert math.isclose(first["backend"]["other_token_prob"], first["reference"]["runner_up_prob"], rel_tol=1e-4)
    assert math.isclose(first["backend"]["margin_logprob"], first["reference"]["margin_logprob"], rel_tol=1e-3)
    assert math.isclose(first["reference"]["other_token_prob"], first["reference"]["runner_up_prob"])
    assert first["reference"]["margin_prob"] > 0
    assert d["alignment"][2]["op"] in ("changed", "extra")
    # forced on the reference's tokens, the drift sits at step 2 only, equal to the swapped gap
    tf = d["teacher_forced"]
    assert tf["steps_not_argmax"] == [2] and tf["ref_token_rank"][2] == 1 and tf["steps_top1_differs"] == [2]
    others = [x for i, x in enumerate(tf["max_abs_dlogit"]) if i != 2]
    assert max(others) < 1e-4
    assert math.isclose(tf["max_abs_dlogit"][2], first["reference"]["margin_logprob"], rel_tol=1e-3)


def test_broken_backend_gets_an_error_entry_and_others_still_run(tiny_backends):
    kv = tiny_backends["ort_fp32_kv_cache"]
    backends = dict(tiny_backends)
    backends["ort_fp32_kv_cache"] = _wrap(kv, "ort_fp32_kv_cache", _Raising(kv.model))
    out = compare(backends, SENTENCE, max_new_tokens=4, load_errors=None)
    broken = out["backends"]["ort_fp32_kv_cache"]
    assert broken["error"] == "RuntimeError: decoder graph exploded" and broken["text"] is None
    for name in (n for n in BACKEND_NAMES if n != "ort_fp32_kv_cache"):
        assert out["backends"][name]["error"] is None and len(out["backends"][name]["token_ids"]) == 4
    assert out["backends"]["ort_fp16"]["divergence"]["teacher_forced"]["steps"] == 4


def test_backend_that_failed_to_load_keeps_its_place(tiny_backends):
    backends = {k: v for k, v in tiny_backends.items() if k != "ort_fp16"}
    errors = {"ort_fp16": "FileNotFoundError: decoder_fp16.onnx"}
    out = compare(backends, SENTENCE, max_new_tokens=3, load_errors=errors)
    assert list(out["backends"]) == list(BACKEND_NAMES)  # in its own place, not appended
    assert out["backends"]["ort_fp16"]["error"] == "failed to load: FileNotFoundError: decoder_fp16.onnx"
    assert out["backends"]["ort_fp32_kv_cache"]["divergence"]["identical"]


def test_missing_reference_still_runs_the_others(tiny_backends):
    backends = {k: v for k, v in tiny_backends.items() if k != "pytorch"}
    out = compare(backends, SENTENCE, max_new_tokens=3, load_errors={"pytorch": "OSError: weights gone"})
    assert list(out["backends"])[0] == "pytorch" and out["backends"]["pytorch"]["error"].startswith("failed to load")
    for name in BACKEND_NAMES[1:]:
        b = out["backends"][name]
        assert b["error"] is None and len(b["token_ids"]) == 3
        assert "no reference" in b["divergence"]["error"]


class _Counting:
    def __init__(self):
        self.calls = 0

    def encode(self, *a):
        self.calls += 1
        raise AssertionError("must not be called")

    step = encode


@pytest.mark.parametrize("text", ["", "   \n\t"])
def test_empty_input_is_rejected_before_any_model_call(tiny_backends, text):
    engine = _Counting()
    kv = tiny_backends["ort_fp32_kv_cache"]
    with pytest.raises(InputError, match="empty"):
        list(compare_iter({"pytorch": _wrap(kv, "pytorch", engine)}, text))
    assert engine.calls == 0


def test_text_over_the_position_limit_is_split_not_refused(tiny_backends):
    """2,000 words (several times the 512 positions): split, every word translated, nothing cut."""
    text = "word " * 2000
    out = compare(tiny_backends, text, max_new_tokens=2)
    segs = out["segments"]
    tok = tiny_backends["pytorch"].tokenizer
    assert len(segs) > 1 and all(s["chunked"] for s in segs)
    assert all(tok.count_tokens(s["text"]) <= 512 for s in segs)
    assert sum(s["text"].count("word") for s in segs) == 2000
    for b in out["backends"].values():
        assert b["error"] is None and len(b["segments"]) == len(segs)


@pytest.mark.parametrize(
    "lengths, budget, rows, groups",
    [
        ([5, 9, 7], 100, 16, [[1, 2, 0]]),  # longest first, one call
        ([5, 9, 7], 100, 2, [[1, 2], [0]]),  # row cap
        ([300, 10, 512, 200], 1024, 16, [[2, 0], [3, 1]]),  # 2 x 512 fits, a third row would not
        ([600, 600], 512, 16, [[0], [1]]),  # a row over the budget still goes, alone
        ([], 100, 16, []),
    ],
)
def test_batches_group_similar_lengths_within_the_budget(lengths, budget, rows, groups):
    assert batches(lengths, budget=budget, max_rows=rows) == groups


class _SwapForSource:
    """A real engine that swaps top-1 and top-2 at one step, only in rows whose source tokens are
    `source_ids`: one segment of a batch diverges, the others stay identical."""

    def __init__(self, inner, step, source_ids):
        self.inner, self.at, self.source_ids = inner, step, source_ids

    def encode(self, input_ids, attention_mask):
        rows = [i for i in range(len(input_ids)) if input_ids[i, attention_mask[i] == 1].tolist() == self.source_ids]
        return self.inner.encode(input_ids, attention_mask), rows

    def step(self, state, decoder_ids):
        inner, rows = state
        logits = np.array(self.inner.step(inner, decoder_ids), dtype=np.float32, copy=True)  # (b, V)
        if decoder_ids.shape[1] - 1 == self.at:
            for row in rows:
                a, b = np.argsort(-logits[row], kind="stable")[:2]
                logits[row, a], logits[row, b] = logits[row, b], logits[row, a]
        return logits


def test_several_segments_detail_the_first_diverging_one(tiny_backends):
    sentences = ["Click OK.", "Save the file before you close the window.", "Close it.", "Open the menu."]
    kv = tiny_backends["ort_fp32_kv_cache"]
    target = kv.tokenizer.encode([sentences[1]], 512).input_ids[0].tolist()
    flipped = _wrap(kv, "flipped", _SwapForSource(kv.model, 2, target))
    backends = {"pytorch": tiny_backends["pytorch"], "flipped": flipped}
    results = {r.name: r for r in compare_iter(backends, " ".join(sentences), max_new_tokens=MAX_NEW)}
    ref, flipped = results["pytorch"], results["flipped"]
    assert [s.text for s in ref.segments] == sentences and len(flipped.translations) == 4
    d = flipped.divergence
    assert d["segment"] == 1 and d["segments"] == 4 and d["segments_identical"] == 3 and not d["identical"]
    assert d["first"]["step"] == 2
    assert [s["identical"] for s in flipped.segment_divergence] == [True, False, True, True]
    assert [s["first_step"] for s in flipped.segment_divergence] == [None, 2, None, None]
    # the detail is segment 1's: its alignment, and teacher forcing on segment 1's reference tokens
    assert [a["ref_id"] for a in d["alignment"] if a["ref_id"] is not None] == ref.translations[1].token_ids
    assert d["teacher_forced"]["steps"] == len(ref.translations[1].token_ids)
    assert d["teacher_forced"]["steps_not_argmax"] == [2]
    out = to_json([ref, flipped])
    assert [s["text"] for s in out["segments"]] == sentences
    assert out["backends"]["flipped"]["segments"][1]["divergence"]["identical"] is False
    with pytest.raises(ValueError, match="4 segments"):
        flipped.translation  # noqa: B018  (one translation per segment: ask for them all)


def test_whole_text_timings_add_up_over_the_batches(tiny_backends):
    """Timings cover every batch: a text of two batches takes the sum of its two calls' steps."""
    kv = tiny_backends["ort_fp32_kv_cache"]
    sentences = dev_sentences(20)  # 20 short sentences: two batches of at most 16
    [r] = compare_iter({"ort_fp32_kv_cache": kv}, " ".join(sentences), max_new_tokens=MAX_NEW)
    groups = batches([kv.tokenizer.count_tokens(s) for s in sentences])
    assert len(groups) == 2
    steps = sum(max(len(r.translations[i].token_ids) for i in g) for g in groups)
    assert r.timings_ms["steps"] == steps
    assert r.timings_ms["per_token"] == pytest.approx(r.timings_ms["decode"] / steps)
    assert r.timings_ms["total"] >= r.timings_ms["decode"] + r.timings_ms["encode"]


def test_compare_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, service, backends.divergence; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent).returncode == 0


# --- decoding options through the request layer ------------------------------------------------


@pytest.mark.parametrize("beams", [0, 9, 2.5, "4", True])
def test_beam_count_outside_the_app_limit_is_refused_before_any_model_call(tiny_backends, beams):
    with pytest.raises(InputError, match=r"num_beams must be an integer in 1\.\.8"):
        compare(tiny_backends, SENTENCE, num_beams=beams, max_new_tokens=4)


def test_work_over_the_limit_is_refused_with_its_numbers(tiny_backends):
    from service import RequestLimits

    text = " ".join(dev_sentences(6))  # six sentences: six segments
    with pytest.raises(InputError, match=r"4 beams x 6 segments x 20 tokens = 480 .* at most 400"):
        compare(tiny_backends, text, num_beams=4, max_new_tokens=20, limits=RequestLimits(max_work=400))
    out = compare(tiny_backends, text, num_beams=1, max_new_tokens=20, limits=RequestLimits(max_work=400))
    assert out["decoding"]["strategy"] == "greedy" and len(out["segments"]) == 6


def test_default_decoding_is_the_models_own_and_is_echoed(tiny_backends):
    own = tiny_backends["pytorch"].manifest.generation.num_beams
    out = compare(tiny_backends, SENTENCE, max_new_tokens=4, teacher_forced=False)
    assert out["decoding"]["requested_num_beams"] is None and out["decoding"]["num_beams"] == own


def test_beam_results_carry_the_nbest_and_the_reference_rank(tiny_backends):
    out = compare(tiny_backends, SENTENCE, num_beams=3, max_new_tokens=6, teacher_forced=False)
    ref = out["backends"]["pytorch"]["segments"][0]
    assert len(ref["hypotheses"]) == 3 and ref["hypotheses"][0]["token_ids"] == ref["token_ids"]
    scores = [h["score"] for h in ref["hypotheses"]]
    assert scores == sorted(scores, reverse=True) and ref["score"] == pytest.approx(scores[0])
    for name in ("ort_fp32_single_step", "ort_fp32_kv_cache"):  # fp32: the same beam, so rank 0
        seg = out["backends"][name]["segments"][0]
        assert seg["token_ids"] == ref["token_ids"] and seg["reference_rank"] == 0
        assert [h["token_ids"] for h in seg["hypotheses"]] == [h["token_ids"] for h in ref["hypotheses"]]
