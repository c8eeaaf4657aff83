"""Hostile and boundary inputs through every backend, the compare API and the page's own handler.

Each input kind runs through the five tiny backends (service.compare), then through the app built
in-process: its `compare` endpoint via gradio_client, and its UI event handler (`translate_ui`)
called as the page calls it. Nothing may crash, hang or be cut: a result or a clear error.
Degenerate output and non-finite logits are produced by real engines wrapped to misbehave, and
must reach the JSON and the page as warnings and errors, not as translations.
"""

from __future__ import annotations

import html
import re
import socket
import time

import numpy as np
import pytest
from gradio_client import Client

from backends import APPROXIMATE, BACKEND_NAMES, Backend, InputError
from service import RequestLimits, compare, compare_iter
from service.segment import clean, join_translations
from conftest import dev_sentences

MAX_NEW = 6  # the tiny random model rarely emits eos: a small cap keeps every run short
FP32 = [n for n in BACKEND_NAMES if n != "pytorch" and n not in APPROXIMATE]
LONG_SENTENCES = dev_sentences(60)  # about 2,200 tokens of the tiny model: four times its 512 positions
RUN_ON = ", ".join(s.rstrip(".") for s in dev_sentences(40)) + "."  # one sentence of about 1,400 tokens

KINDS = {
    "punctuation only": "!!!???",
    "mixed Chinese and English": "Click 确定 to save.",
    "emoji": "I love this song 🎵😊 and I want to hear it again 🔁!",
    "control characters and NUL": "a\x00b\x07c",
    "right-to-left": "مرحبا بالعالم. שלום עולם.",
    "500-character word": "a" * 500,
    "1,200-character word": "b" * 1200,
    "60 sentences": " ".join(LONG_SENTENCES),
    "one sentence of 1,400 tokens": RUN_ON,
}
EMPTY = {
    "empty": ("", "the input is empty"),
    "whitespace": ("  \n\t ", "the input is empty"),
    "control characters only": ("\x00\x07\x1b", "no visible text"),
    "format characters only": ("\u200b\u200f", "no visible text"),
}


def no_space(text: str) -> str:
    return re.sub(r"\s+", "", text)


def check_complete(out: dict, text: str, tokenizer, limit: int) -> None:
    """The split loses nothing and respects the limit; every backend answers every segment, in order."""
    segs = out["segments"]
    cleaned = clean(text)
    assert segs and all(cleaned[s["start"] : s["end"]] == s["text"] for s in segs)
    assert all(a["end"] <= b["start"] for a, b in zip(segs, segs[1:]))
    assert no_space("".join(s["text"] for s in segs)) == no_space(cleaned)
    assert not any(ch in s["text"] for s in segs for ch in "\x00\x07")
    assert all(tokenizer.count_tokens(s["text"]) <= limit for s in segs)
    assert list(out["backends"]) == list(BACKEND_NAMES)
    eos = tokenizer.eos_id
    for name, b in out["backends"].items():
        assert b["error"] is None, f"{name}: {b['error']}"
        assert len(b["segments"]) == len(segs)
        assert b["text"] == join_translations([s["text"] for s in b["segments"]])
        assert b["token_ids"] == [i for s in b["segments"] for i in s["token_ids"]]
        for s in b["segments"]:
            assert 1 <= len(s["token_ids"]) <= MAX_NEW and len(s["tokens"]) == len(s["token_ids"])
            assert s["stop_reason"] == ("eos" if s["token_ids"][-1] == eos else "max_new_tokens")
            assert s["non_finite_steps"] == []
    ref = out["backends"]["pytorch"]
    for name in FP32:
        assert out["backends"][name]["token_ids"] == ref["token_ids"], name
        d = out["backends"][name]["divergence"]
        assert d["identical"] and d["segments"] == len(segs) == d["segments_identical"]


@pytest.fixture(scope="module")
def direct(tiny_backends):
    """Each kind through service.compare once: {kind: JSON}."""
    return {kind: compare(tiny_backends, text, max_new_tokens=MAX_NEW) for kind, text in KINDS.items()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_backend_answers_every_kind(direct, tiny_backends, kind):
    pt = tiny_backends["pytorch"]
    check_complete(direct[kind], KINDS[kind], pt.tokenizer, pt.manifest.max_source_tokens)


def test_control_characters_become_spaces_and_keep_their_offsets(direct):
    [seg] = direct["control characters and NUL"]["segments"]
    assert seg == {"text": "a b c", "start": 0, "end": 5, "chunked": False}


def test_long_text_is_split_into_its_sentences(direct):
    segs = direct["60 sentences"]["segments"]
    assert [s["text"] for s in segs] == LONG_SENTENCES and not any(s["chunked"] for s in segs)


@pytest.mark.parametrize("kind", ["one sentence of 1,400 tokens", "1,200-character word"])
def test_a_sentence_over_the_limit_is_cut_into_chunks(direct, tiny_backends, kind):
    tok = tiny_backends["pytorch"].tokenizer
    segs = direct[kind]["segments"]
    n_tokens = tok.count_tokens(KINDS[kind])
    assert n_tokens > 512 and len(segs) >= -(-n_tokens // 512)
    assert all(s["chunked"] for s in segs)
    if kind == "1,200-character word":  # no space to cut at: cut at characters, nothing lost
        assert "".join(s["text"] for s in segs) == KINDS[kind]


def test_segments_come_back_in_input_order_from_length_sorted_batches(direct, tiny_backends):
    """The batches run longest first; each segment's output must still be its own."""
    kv = tiny_backends["ort_fp32_kv_cache"]
    out = direct["60 sentences"]["backends"]["ort_fp32_kv_cache"]["segments"]
    lengths = [kv.tokenizer.count_tokens(s) for s in LONG_SENTENCES]
    picks = [int(np.argmin(lengths)), int(np.argmax(lengths)), 0, len(LONG_SENTENCES) - 1]
    for i in picks:
        [alone] = kv.translate([LONG_SENTENCES[i]], max_new_tokens=MAX_NEW)
        assert out[i]["token_ids"] == alone.token_ids, f"segment {i}"


class _Counting:
    """An engine that must never be reached."""

    def __init__(self):
        self.calls = 0

    def encode(self, *a):
        self.calls += 1
        raise AssertionError("a model was called")

    step = encode


def _wrap(backend: Backend, model, name: str | None = None) -> Backend:
    return Backend(name or backend.name, model, backend.tokenizer, backend.manifest, dict(backend.info))


@pytest.mark.parametrize("kind", list(EMPTY))
def test_nothing_to_translate_is_refused_before_any_model_call(tiny_backends, kind):
    text, message = EMPTY[kind]
    engine = _Counting()
    backends = {"pytorch": _wrap(tiny_backends["pytorch"], engine)}
    with pytest.raises(InputError, match=message):
        list(compare_iter(backends, text))
    assert engine.calls == 0


@pytest.mark.parametrize(
    "text, limits, message",
    [
        ("word " * 4001, RequestLimits(), r"20,005 characters long; one request takes at most 20,000"),
        ("Hi. " * 9, RequestLimits(max_segments=8), r"splits into 9 sentences or chunks; .* at most 8"),
    ],
)
def test_too_large_a_request_is_refused_with_its_numbers(tiny_backends, text, limits, message):
    engine = _Counting()
    backends = {"pytorch": _wrap(tiny_backends["pytorch"], engine)}
    with pytest.raises(InputError, match=message):
        list(compare_iter(backends, text, limits=limits))
    assert engine.calls == 0


# --- engines that misbehave on purpose --------------------------------------------------------


class _Slow:
    """A real engine that takes `seconds` per decoder step, like the single-step graph on a long
    output (everything recomputed per token)."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds, self.steps = inner, seconds, 0

    def encode(self, input_ids, attention_mask):
        return self.inner.encode(input_ids, attention_mask)

    def step(self, state, decoder_ids):
        self.steps += 1
        time.sleep(self.seconds)
        return self.inner.step(state, decoder_ids)


def test_a_backend_over_the_time_limit_stops_with_an_error_and_the_next_one_runs(tiny_backends):
    """max_seconds bounds each backend's turn: the slow one reports it, the rest are unaffected."""
    single = tiny_backends["ort_fp32_single_step"]
    slow = _Slow(single.model, 1.0)
    backends = {
        "pytorch": tiny_backends["pytorch"],
        "ort_fp32_single_step": _wrap(single, slow),
        "ort_fp32_kv_cache": tiny_backends["ort_fp32_kv_cache"],
    }
    out = compare(backends, "Click OK to save.", max_new_tokens=MAX_NEW, limits=RequestLimits(max_seconds=3))
    assert slow.steps <= 4  # stopped at the first step past 3 s, not after all six
    late = out["backends"]["ort_fp32_single_step"]
    assert late["error"] == (
        "TimeLimitExceeded: did not finish within 3 s, the time limit for one backend on one request; "
        "a shorter text (or fewer runs) fits"
    )
    assert late["text"] is None
    kv = out["backends"]["ort_fp32_kv_cache"]
    assert kv["error"] is None and kv["divergence"]["identical"] and kv["divergence"]["teacher_forced"]["steps"] > 0


class _Repeat:
    """A real engine whose logits get one token pushed to the top at every step: degenerate output."""

    def __init__(self, inner, token: int):
        self.inner, self.token = inner, token

    def encode(self, input_ids, attention_mask):
        return self.inner.encode(input_ids, attention_mask)

    def step(self, state, decoder_ids):
        logits = np.array(self.inner.step(state, decoder_ids), dtype=np.float32, copy=True)  # (b, V)
        logits[:, self.token] = logits.max(axis=-1) + 10.0
        return logits


class _NonFinite:
    """A real engine whose logits hold `value` (NaN or Inf) at one step, in the rows whose source
    tokens are `source_ids` (every row when None), as a broken fp16 graph would produce."""

    def __init__(self, inner, step: int, value: float, source_ids: list[int] | None = None):
        self.inner, self.at, self.value, self.source_ids = inner, step, value, source_ids

    def encode(self, input_ids, attention_mask):
        rows = [
            i
            for i in range(input_ids.shape[0])
            if self.source_ids is None or input_ids[i, attention_mask[i] == 1].tolist() == self.source_ids
        ]
        return self.inner.encode(input_ids, attention_mask), rows

    def step(self, state, decoder_ids):
        inner, rows = state
        logits = np.array(self.inner.step(inner, decoder_ids), dtype=np.float32, copy=True)  # (b, V)
        if decoder_ids.shape[1] - 1 == self.at:
            logits[rows, 7] = self.value
        return logits


def test_a_repeated_token_run_is_flagged_in_the_json_and_the_panel(tiny_backends):
    from ui import compare_render

    int8 = tiny_backends["ort_int8"]
    # A piece with visible text (a lone word-start piece "▁" would detokenize to nothing).
    ids = int8.tokenizer.encode(["Click OK to save."], 512).input_ids[0]
    token = next(int(t) for t in ids if int8.tokenizer.decode([int(t)]).strip())
    backends = {"pytorch": tiny_backends["pytorch"], "ort_int8": _wrap(int8, _Repeat(int8.model, int(token)))}
    out = compare(backends, "Click OK to save.", max_new_tokens=MAX_NEW)
    b = out["backends"]["ort_int8"]
    assert b["token_ids"] == [token] * MAX_NEW and b["repeated_run"] == MAX_NEW
    assert b["warnings"] == [
        f"repeated token run of {MAX_NEW}",
        f"stopped at the {MAX_NEW}-token cap before eos",
    ]
    assert b["error"] is None and b["text"]  # suspicious, still a translation: shown with the warning
    panel = compare_render.panel_html("ort_int8", b, "", {})
    assert f"⚠ repeated token run of {MAX_NEW}" in panel and "state-warn" in panel


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_logits_are_an_error_not_a_translation(tiny_backends, value):
    from ui import compare_render

    fp16 = tiny_backends["ort_fp16"]
    backends = dict(tiny_backends, ort_fp16=_wrap(fp16, _NonFinite(fp16.model, step=2, value=value)))
    out = compare(backends, "Click OK to save.", max_new_tokens=MAX_NEW)
    b = out["backends"]["ort_fp16"]
    assert b["error"] == "non-finite logits (NaN/Inf) at step 2"
    assert b["text"] is None and b["segments"][0]["text"] is None and b["divergence"] is None
    assert b["non_finite_steps"] == [{"segment": 0, "step": 2}]
    # the loop ended the row at that step, with eos: three tokens, the last one eos
    assert len(b["token_ids"]) == 3 and b["token_ids"][-1] == fp16.special.eos
    for name in ("pytorch", *FP32):
        assert out["backends"][name]["error"] is None and out["backends"][name]["text"]
    assert out["backends"]["ort_int8"]["divergence"]["teacher_forced"]["steps"] > 0
    panel = compare_render.panel_html("ort_fp16", b, "", {})
    assert "non-finite logits (NaN/Inf) at step 2" in panel and "state-err" in panel
    assert "ORT fp16 · KV cache" in compare_render.divergence_html(out) and "non-finite" in compare_render.divergence_html(out)


def test_non_finite_logits_in_one_segment_name_that_segment(tiny_backends):
    fp16 = tiny_backends["ort_fp16"]
    sentences = ["Click OK.", "Then save the file to the disk.", "Close it."]
    bad = fp16.tokenizer.encode([sentences[1]], 512).input_ids[0].tolist()
    backends = dict(tiny_backends, ort_fp16=_wrap(fp16, _NonFinite(fp16.model, step=1, value=np.nan, source_ids=bad)))
    out = compare(backends, " ".join(sentences), max_new_tokens=MAX_NEW)
    b = out["backends"]["ort_fp16"]
    assert b["error"] == "non-finite logits (NaN/Inf) at step 1 in segment 2 of 3"
    assert [s["text"] is None for s in b["segments"]] == [False, True, False]
    assert b["non_finite_steps"] == [{"segment": 1, "step": 1}]


def test_non_finite_reference_leaves_the_others_uncompared_and_says_why(tiny_backends):
    pt = tiny_backends["pytorch"]
    backends = dict(tiny_backends, pytorch=_wrap(pt, _NonFinite(pt.model, step=0, value=np.nan)))
    out = compare(backends, "Click OK to save.", max_new_tokens=MAX_NEW)
    assert out["backends"]["pytorch"]["error"] == "non-finite logits (NaN/Inf) at step 0"
    for name in BACKEND_NAMES[1:]:
        b = out["backends"][name]
        assert b["error"] is None and b["text"]
        assert b["divergence"]["error"] == (
            "no reference to compare with: pytorch did not produce a translation "
            "(non-finite logits (NaN/Inf) at step 0)"
        )


# --- through the app: the compare API and the page's handler ----------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(backends):
    import app

    loaded = app.Loaded(dict(backends), model="tiny", export_note="in-process", max_new_tokens=MAX_NEW)
    demo = app.build_app(loaded)
    demo.queue(max_size=8, default_concurrency_limit=1)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    return demo, Client(f"http://127.0.0.1:{port}/", verbose=False)


@pytest.fixture(scope="module")
def served(tiny_backends):
    demo, client = _launch(tiny_backends)
    yield demo, client
    demo.close()


def _ui(demo, text: str, repeat: int = 1) -> list[dict]:
    """Run the page's Translate handler as gradio does; each frame as {elem_id: value}."""
    fn = next(f for f in demo.fns.values() if getattr(f.fn, "__name__", "") == "translate_ui")  # click = submit
    ids = [c.elem_id for c in fn.outputs]
    return [dict(zip(ids, frame)) for frame in fn.fn(text, repeat)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_compare_api_answers_every_kind_like_the_backends(served, direct, tiny_backends, kind):
    _, client = served
    out = client.predict(KINDS[kind], api_name="/compare")
    pt = tiny_backends["pytorch"]
    check_complete(out, KINDS[kind], pt.tokenizer, pt.manifest.max_source_tokens)
    assert out["segments"] == direct[kind]["segments"]
    for name in BACKEND_NAMES:
        assert out["backends"][name]["token_ids"] == direct[kind]["backends"][name]["token_ids"], name


@pytest.mark.parametrize("kind", list(EMPTY))
def test_compare_api_refuses_nothing_to_translate_with_the_reason(served, kind):
    _, client = served
    text, message = EMPTY[kind]
    with pytest.raises(Exception, match=message):
        client.predict(text, api_name="/compare")


def test_compare_api_refuses_too_long_a_text_with_the_limit(served):
    _, client = served
    with pytest.raises(Exception, match=r"20,005 characters long; one request takes at most 20,000"):
        client.predict("word " * 4001, api_name="/compare")


def test_page_shows_the_split_and_each_segment(served):
    demo, client = served
    text = "Click OK. Then save the file."
    frames = _ui(demo, text)
    assert "Split into 2 segments" in frames[0]["status"]  # shown before the first backend finishes
    assert "Input split into 2 segments" in frames[0]["segments"]
    last = frames[-1]
    assert f"Done: {len(BACKEND_NAMES)}/{len(BACKEND_NAMES)} backends translated" in last["status"]
    assert "<td>Click OK.</td>" in last["segments"] and "<td>Then save the file.</td>" in last["segments"]
    api = client.predict(text, api_name="/compare")
    for name in BACKEND_NAMES:
        assert last[f"out-{name}"] == api["backends"][name]["text"]
    seg_outputs = [s["text"] for s in api["backends"]["pytorch"]["segments"]]
    assert all(f"<td>{html.escape(t)}</td>" in last["segments"] for t in seg_outputs)


def test_page_shows_nothing_to_translate_without_calling_a_model(served):
    demo, _ = served
    [frame] = _ui(demo, "   ")
    assert "the input is empty" in frame["status"] and frame["out-pytorch"] == "" and frame["segments"] == ""


def test_non_finite_logits_reach_the_api_and_the_page_as_an_error(tiny_backends):
    fp16 = tiny_backends["ort_fp16"]
    backends = dict(tiny_backends, ort_fp16=_wrap(fp16, _NonFinite(fp16.model, step=2, value=np.nan)))
    demo, client = _launch(backends)
    try:
        out = client.predict("Click OK to save.", api_name="/compare")
        last = _ui(demo, "Click OK to save.")[-1]
    finally:
        demo.close()
    assert out["backends"]["ort_fp16"]["error"] == "non-finite logits (NaN/Inf) at step 2"
    assert out["backends"]["ort_fp16"]["text"] is None
    assert last["out-ort_fp16"] == "" and "non-finite logits (NaN/Inf) at step 2" in last["stats-ort_fp16"]
    assert last["out-pytorch"] == out["backends"]["pytorch"]["text"]
    assert f"Done: {len(BACKEND_NAMES) - 1}/{len(BACKEND_NAMES)} backends translated" in last["status"]
