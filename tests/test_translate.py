"""service/translate.py: requests decoded together answer as they would alone; a refused request
leaves the others alone; the default backend is the sidecar's fastest verified one. In process, on
the tiny export (a few seconds); the app's batching itself is tested in tests/test_app.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from backends import APPROXIMATE, BACKEND_NAMES
from conftest import dev_sentences
from service.limits import RequestLimits
from service.translate import (
    APPROXIMATE_MARGIN,
    Traffic,
    default_backend,
    overlap_warning,
    translate_batch,
    verified_speed,
)

EXACT = [n for n in BACKEND_NAMES if n not in APPROXIMATE]
MAX_NEW = 6  # the tiny random model rarely stops by itself: a small cap keeps every decode short


def texts_of(answers):
    return [a.to_json()["text"] for a in answers]


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("num_beams", [1, 3])
def test_requests_decoded_together_answer_as_alone(tiny_backends, name, num_beams):
    # different lengths, so the batch pads; the second request holds two sentences
    texts = [dev_sentences(1)[0], "Click OK. Then close the dialog and save the document again.", "Yes."]
    together = translate_batch(tiny_backends, texts, [num_beams] * 3, [name] * 3, max_new_tokens=MAX_NEW)
    alone = [translate_batch(tiny_backends, [t], [num_beams], [name], max_new_tokens=MAX_NEW)[0] for t in texts]
    assert [a.batch["decoded_together"] for a in together] == [3, 3, 3]
    assert together[0].batch["sentences"] == 4 and [a.batch["decoded_together"] for a in alone] == [1, 1, 1]
    for t, a in zip(together, alone):
        assert t.error is None and a.error is None
        assert [x.token_ids for x in t.translations] == [x.token_ids for x in a.translations]
    assert texts_of(together) == texts_of(alone)
    assert len(together[1].to_json()["segments"]) == 2


@pytest.mark.parametrize(
    "text, num_beams, backend, message",
    [
        ("", None, None, "the input is empty"),
        ("\x00\x01\u200b", None, None, "no visible text"),
        ("x" * 21, None, None, "one request takes at most 20:"),
        ("Hello.", 9, None, "num_beams must be an integer in 1..8"),
        ("Hello.", None, "ort_nonesuch", "expected one of: pytorch"),
        (None, None, None, "expected text, got NoneType"),
    ],
)
def test_a_refused_request_leaves_the_others_alone(tiny_backends, text, num_beams, backend, message):
    limits = RequestLimits(max_chars=20)
    good = ["Open the file.", "Save it."]
    answers = translate_batch(tiny_backends, [good[0], text, good[1]], [None, num_beams, None],
                              [None, backend, None], default="ort_fp32_kv_cache", limits=limits,
                              max_new_tokens=MAX_NEW)
    bad = answers[1].to_json()
    assert message in bad["error"] and bad["text"] is None and bad["segments"] == []
    assert bad["batch"] == {"requests": 3, "refused": 1}
    alone = translate_batch(tiny_backends, good, backend_names=["ort_fp32_kv_cache"] * 2, max_new_tokens=MAX_NEW)
    assert texts_of([answers[0], answers[2]]) == texts_of(alone)
    for a in (answers[0], answers[2]):
        assert a.error is None and a.backend == "ort_fp32_kv_cache"
        assert a.batch == {"requests": 3, "refused": 1, "decoded_together": 2, "sentences": 2, "calls": 1}


def test_requests_with_other_decodings_or_backends_are_decoded_apart(tiny_backends):
    answers = translate_batch(tiny_backends, ["Open the file."] * 3, [1, 2, 1], ["ort_fp32_kv_cache", None, "pytorch"],
                              default="ort_fp32_kv_cache", max_new_tokens=MAX_NEW)
    assert [a.backend for a in answers] == ["ort_fp32_kv_cache", "ort_fp32_kv_cache", "pytorch"]
    assert [a.decoding["num_beams"] for a in answers] == [1, 2, 1]
    assert [a.batch["decoded_together"] for a in answers] == [1, 1, 1]
    assert answers[0].to_json()["text"] == answers[2].to_json()["text"]  # fp32 greedy: the reference's


def test_without_a_default_a_request_must_name_a_backend(tiny_backends):
    [answer] = translate_batch(tiny_backends, ["Open the file."], max_new_tokens=MAX_NEW)
    assert answer.error.startswith("no backend is chosen by default")
    assert answer.error.endswith(f"name one of: {', '.join(tiny_backends)}")


def test_default_is_the_fastest_verified_backend(tiny_backends):
    manifest = tiny_backends["pytorch"].manifest
    greedy = manifest.data["verification"]["greedy"]
    # the sidecar's own figures: every backend token-identical on every sentence, seconds recorded
    assert verified_speed(manifest, "pytorch") == greedy["reference_seconds"]
    assert verified_speed(manifest, "ort_fp32_kv_cache") == greedy["backends"]["ort_fp32_kv_cache"]["seconds"]
    pick = default_backend(tiny_backends)
    speeds = {n: verified_speed(manifest, n) for n in tiny_backends}
    exact = min(s for n, s in speeds.items() if s is not None and n not in APPROXIMATE)
    if pick in APPROXIMATE:
        assert speeds[pick] < APPROXIMATE_MARGIN * exact
    else:
        assert speeds[pick] == exact

    def edited(name, **change):
        data = copy.deepcopy(manifest.data)
        data["verification"]["greedy"]["backends"][name].update(change)
        return dataclasses.replace(manifest, data=data)

    def timed(**seconds):  # every backend's greedy verification time; the model's own decoding as is
        data = copy.deepcopy(manifest.data)
        for name, entry in data["verification"]["greedy"]["backends"].items():
            entry["seconds"] = seconds.get(name, 50.0)
        data["verification"]["greedy"]["reference_seconds"] = seconds.get("pytorch", 50.0)
        for entry in (data["verification"].get("model_decoding") or {}).get("backends", {}).values():
            entry["seconds"] = 0.0
        if data["verification"].get("model_decoding"):
            data["verification"]["model_decoding"]["reference_seconds"] = 0.0
        faked = dataclasses.replace(manifest, data=data)
        return default_backend({n: _with_manifest(b, faked) for n, b in tiny_backends.items()})

    # an approximate backend a little faster than the fastest exact one is not the default; a lot faster is
    assert timed(ort_fp32_kv_cache=10.0, ort_fp16=8.0) == "ort_fp32_kv_cache"
    assert timed(ort_fp32_kv_cache=10.0, ort_fp16=7.0) == "ort_fp16"
    assert timed(ort_fp32_kv_cache=10.0, pytorch=9.0, ort_fp16=7.0) == "pytorch"

    slow = {"seconds": 99.0}
    assert verified_speed(edited("ort_int8", identical_ids=greedy["sentences"] - 1), "ort_int8") is None
    assert verified_speed(edited("ort_int8", **slow), "ort_int8") == 99.0
    unverified = dataclasses.replace(manifest, data={**manifest.data, "verification": None})
    assert verified_speed(unverified, "ort_fp32_kv_cache") is None


def test_traffic_counts_decodes_that_ran_after_a_mark():
    traffic = Traffic()
    mark = traffic.mark()
    assert traffic.since(mark) == 0 and overlap_warning(0) is None
    with traffic.running():
        inside = traffic.mark()
        assert traffic.since(mark) == 1
    assert traffic.since(inside) == 1  # it was running at the mark
    assert traffic.since(traffic.mark()) == 0
    with traffic.running():
        pass
    assert traffic.since(mark) == 2
    assert overlap_warning(2) == "timed while 2 translate decodes ran on this machine: slower than alone"


def _with_manifest(backend, manifest):
    """A shallow copy of `backend` reading `manifest` (the same engine)."""
    other = copy.copy(backend)
    other.manifest = manifest
    return other
