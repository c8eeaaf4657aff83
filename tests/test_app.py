"""app.py end to end: `python app.py` in a subprocess, driven through gradio_client's `compare`.

The app runs on `app_model`: the embedded model when assets/marian-en-zh-small exists (its export
made once per session by conftest's `embedded_export_dir`, which the app reuses through
--export-dir), else the tiny test export. One app process (conftest's `app_url`) serves this module
and tests/test_browser.py.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest
from gradio_client import Client

from backends import APPROXIMATE, BACKEND_NAMES
from conftest import EMBEDDED_MODEL, QUEUE_SIZE, REPO, dev_sentences, free_port

BACKENDS = list(BACKEND_NAMES)
FP32 = [n for n in BACKENDS if n != "pytorch" and n not in APPROXIMATE]
SENTENCE = "Click outside the spreadsheet to view the slide."
@pytest.fixture(scope="module")
def client(app_url):
    return Client(app_url, verbose=False)


@pytest.fixture(scope="module")
def result(client):
    return client.predict(SENTENCE, api_name="/compare")


def test_only_compare_and_translate_are_in_the_api(client):
    assert list(client.view_api(print_info=False, return_format="dict")["named_endpoints"]) == [
        "/compare", "/translate"]


def test_compare_returns_every_backend(result, app_model):
    if app_model == EMBEDDED_MODEL:  # a trained model ends the sentence itself
        assert result["backends"]["pytorch"]["stop_reason"] == "eos"
    assert result["reference"] == "pytorch"
    assert list(result["backends"]) == BACKENDS
    for name, b in result["backends"].items():
        assert b["error"] is None, f"{name}: {b['error']}"
        assert b["text"] and len(b["token_ids"]) >= 1
        assert len(b["tokens"]) == len(b["token_ids"])
        assert b["info"]["precision"] and b["info"]["provider"] and b["info"]["threads"] >= 1



def test_fp32_backends_agree_with_pytorch(result):
    ref = result["backends"]["pytorch"]
    assert ref["divergence"] is None
    assert FP32 == ["ort_fp32_single_step", "ort_fp32_kv_cache"]
    for name in FP32:
        b = result["backends"][name]
        assert b["token_ids"] == ref["token_ids"] and b["text"] == ref["text"]
        d = b["divergence"]
        assert d["identical"] and d["first"] is None
        assert d["teacher_forced"]["max_abs_dlogit_overall"] < 1e-4
        # beam search may pick non-top-1 tokens (in PyTorch too): the fp32 claim is the same top-1
        assert d["teacher_forced"]["steps_top1_differs"] == []
    for name in APPROXIMATE:  # reduced precision drifts, measurably and finitely
        tf = result["backends"][name]["divergence"]["teacher_forced"]
        assert 0 < tf["max_abs_dlogit_overall"] < 50 and tf["non_finite_mismatch_steps"] == []
    assert result["backends"]["ort_fp16"]["divergence"]["teacher_forced"]["max_abs_dlogit_overall"] < 0.5


def test_timings_are_positive(result):
    for name, b in result["backends"].items():
        t = b["timings_ms"]
        for key in ("tokenize", "encode", "first_token", "per_token", "decode", "total"):
            assert t[key] > 0, f"{name} {key} = {t[key]}"
        assert t["total"] >= t["first_token"] and t["total"] >= t["decode"]
        assert b["runs"]["n"] == 1 and b["runs"]["cold_ms"] == pytest.approx(t["total"])


@pytest.mark.parametrize("text", ["", "   \n "])
def test_empty_input_gives_a_clear_error(client, text):
    with pytest.raises(Exception, match="the input is empty: type an English sentence to translate"):
        client.predict(text, api_name="/compare")


def test_repeat_reports_cold_run_and_median(client):
    out = client.predict(SENTENCE, 3, api_name="/compare")
    for name, b in out["backends"].items():
        runs = b["runs"]
        assert runs["n"] == 3 and len(runs["totals_ms"]) == 3 and runs["cold_ms"] == runs["totals_ms"][0]
        assert runs["median_ms"] == pytest.approx(statistics.median(runs["totals_ms"][1:]))
        assert runs["min_ms"] <= runs["median_ms"] <= runs["max_ms"]


def test_full_queue_answers_busy(client):
    """One running, QUEUE_SIZE waiting; the next ones are turned away with 'try again'."""
    jobs = [client.submit(SENTENCE, 2, api_name="/compare") for _ in range(QUEUE_SIZE + 3)]
    outcomes = []
    for job in jobs:
        try:
            job.result(timeout=600)
            outcomes.append("ok")
        except Exception as e:  # gradio_client raises QueueError("Queue is full! Please try again.")
            outcomes.append(f"{type(e).__name__}: {e}")
    busy = [o for o in outcomes if "Queue is full" in o and "try again" in o]
    assert outcomes.count("ok") >= 1 and busy, outcomes
    assert all(o == "ok" or o in busy for o in outcomes), outcomes


# --- translate: Gradio's batching --------------------------------------------------------------------

# Greedy, so 120 sentences fit one request's work limit; long enough (about a second) that requests
# sent just after it wait together and are handed over as one batch.
BUSY_TEXT = "\n".join(dev_sentences(120))


def while_translate_is_busy(client, *requests, backend=None):
    """`requests` ((text, num_beams) each) sent while a long translate request on `backend` runs
    (None: the default); their answers."""
    busy = client.submit(BUSY_TEXT, 1, backend, api_name="/translate")
    time.sleep(0.3)  # the long one has started: the next ones wait behind it
    jobs = [client.submit(*r, api_name="/translate") for r in requests]
    assert busy.result(timeout=600)["error"] is None
    return [job.result(timeout=600) for job in jobs]


def test_translate_batches_concurrent_requests_each_answered_as_alone(client):
    # An exact backend named, since the default is whichever verified backend was fastest (fp16 can be).
    short, long = SENTENCE, "Select the cells that you want to copy, then choose Edit - Copy and paste them below."
    exact = "ort_fp32_kv_cache"
    together = while_translate_is_busy(client, (short, None, exact), (long, None, exact), backend=exact)
    alone = [client.predict(t, None, exact, api_name="/translate") for t in (short, long)]
    assert [a["batch"]["decoded_together"] for a in together] == [2, 2], together
    assert [a["batch"]["decoded_together"] for a in alone] == [1, 1]
    assert {a["backend"] for a in together + alone} == {exact}
    for t, a in zip(together, alone):
        assert t["error"] is None and t["text"] and t["text"] == a["text"]
        assert t["segments"] == a["segments"] and t["decoding"] == a["decoding"]


def test_translate_refuses_a_bad_request_without_failing_its_batch(client):
    good, bad = while_translate_is_busy(client, (SENTENCE, None), ("\x00\x07 \u200b", None))
    assert bad["text"] is None and "no visible text" in bad["error"]
    assert good["error"] is None and good["batch"]["requests"] == 2 and good["batch"]["refused"] == 1
    assert good["text"] == client.predict(SENTENCE, api_name="/translate")["text"]
    unknown = client.predict(SENTENCE, None, "ort_nonesuch", api_name="/translate")
    assert unknown["text"] is None and unknown["error"].startswith("unknown backend 'ort_nonesuch'; expected one of: ")


def test_the_http_route_answers_as_the_gradio_api_with_the_contracts_statuses(client, app_url):
    """POST /translate on the app's own server (service/http_api.py): the same batcher and answer as
    the Gradio `translate` API; a refusal is 422 with its JSON, a malformed body 400."""
    import json
    import urllib.error
    import urllib.request

    def post(body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(app_url + "translate", data=body, method="POST",
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    exact = "ort_fp32_kv_cache"
    status, answer = post(json.dumps({"text": SENTENCE, "backend": exact}).encode())
    gradio = client.predict(SENTENCE, None, exact, api_name="/translate")
    assert status == 200 and answer["error"] is None and answer["text"] == gradio["text"]
    assert answer["segments"] == gradio["segments"] and answer["decoding"] == gradio["decoding"]
    status, refused = post(json.dumps({"text": "   "}).encode())
    assert status == 422 and refused["text"] is None and "the input is empty" in refused["error"]
    for body, message in ((b"[1]", "expected a JSON object"), (b'{"txt": "x"}', "unknown field(s) txt"),
                          (b"not json", "the body is not JSON")):
        status, bad = post(body)
        assert status == 400 and message in bad["error"], (body, bad)


def test_compare_says_when_its_timings_overlapped_translate_traffic(client):
    busy = client.submit(BUSY_TEXT, 1, api_name="/translate")
    time.sleep(0.3)
    out = client.predict(SENTENCE, api_name="/compare")
    assert busy.result(timeout=600)["error"] is None
    first = out["backends"]["pytorch"]["warnings"]
    assert any(w.startswith("timed while 1 translate decode ran") for w in first), first
    quiet = client.predict(SENTENCE, api_name="/compare")
    assert not any("translate decode" in w for b in quiet["backends"].values() for w in b["warnings"])


def test_backend_that_failed_to_load_is_shown_while_others_work(tiny_backends):
    """In-process: the app built with one backend missing still serves the other three."""
    import app

    backends = {k: v for k, v in tiny_backends.items() if k != "ort_fp16"}
    others = [n for n in BACKENDS if n != "ort_fp16"]
    errors = {"ort_fp16": "FileNotFoundError: decoder_fp16.onnx is missing"}
    loaded = app.Loaded(backends, errors, model="tiny", export_note="in-process", max_new_tokens=6)
    demo = app.build_app(loaded)
    demo.queue(max_size=4, default_concurrency_limit=1)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        out = Client(f"http://127.0.0.1:{port}/", verbose=False).predict(SENTENCE, api_name="/compare")
    finally:
        demo.close()
    assert list(out["backends"]) == BACKENDS
    assert out["backends"]["ort_fp16"]["error"] == "failed to load: FileNotFoundError: decoder_fp16.onnx is missing"
    for name in others:
        assert out["backends"][name]["error"] is None and len(out["backends"][name]["token_ids"]) == 6


def test_the_queue_tabulates_no_event_history(monkeypatch):
    """Gradio's queue tabulates its event history in pandas after every request unless told not to;
    under load that work and the memory it left resident grew with the history."""
    import gradio as gr
    from gradio.queueing import Queue

    import app

    for name in app.GRADIO_QUEUE_ENV:
        monkeypatch.delenv(name, raising=False)  # start_queue sets them; restored after the test
    tables, tabulate = [], Queue._get_df

    def counted(records):
        tables.append(len(records))
        return tabulate(records)

    monkeypatch.setattr(Queue, "_get_df", staticmethod(counted))

    def echo(text: str) -> str:
        return text.upper()

    with gr.Blocks() as demo:
        gr.api(echo, api_name="echo")
    app.start_queue(demo, 4)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        answers = [client.predict(f"request {i}", api_name="/echo") for i in range(3)]
    finally:
        demo.close()
    assert answers == [f"REQUEST {i}" for i in range(3)]
    assert tables == []


def test_the_idle_queue_looks_for_requests_every_10_ms_not_every_millisecond(monkeypatch):
    """Gradio's queue sleeps 1 ms between looks while nothing waits; the app makes it 10 ms (under
    load those looks took the interpreter from the decoder). Checked by what the queue's loop
    actually sleeps, so a gradio that stops reading the setting fails here."""
    import asyncio

    import gradio as gr
    import gradio.queueing

    import app

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds, *args, **kwargs):
        slept.append(seconds)
        return await real_sleep(seconds, *args, **kwargs)

    monkeypatch.setattr(gradio.queueing.asyncio, "sleep", sleep)
    for name in app.GRADIO_QUEUE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert app.QUEUE_IDLE_POLL_S == 0.01
    monkeypatch.setattr(app, "QUEUE_IDLE_POLL_S", 0.0123)  # a value nothing else in gradio sleeps
    def echo(text: str) -> str:
        return text

    with gr.Blocks() as demo:
        gr.api(echo, api_name="echo")
    app.start_queue(demo, 4)
    demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        time.sleep(0.5)
    finally:
        demo.close()
    assert slept.count(0.0123) >= 10, slept[:20]
    assert 0.001 not in slept


@pytest.mark.slow
def test_cli_refuses_a_model_it_cannot_use(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [sys.executable, "app.py", "--model", str(missing), "--export-dir", str(tmp_path / "export")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, GRADIO_SERVER_PORT=str(free_port())),
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: cannot start with model '{missing}'" in proc.stderr


@pytest.mark.parametrize(
    "model, name",
    [
        ("Helsinki-NLP/opus-mt-en-zh", "Helsinki-NLP--opus-mt-en-zh"),
        (str(EMBEDDED_MODEL), "marian-en-zh-small"),
        ("/some/where/tiny", "tiny"),
    ],
)
def test_export_folder_name(model, name):
    import app

    assert app.export_name(model) == name


def test_importing_the_app_loads_no_model():
    """No import-time side effects: torch (and any model) is loaded by main(), not by `import app`."""
    code = "import sys, app; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
