"""bench/load.py: options, statistics, timeouts and the deadline on a stub app in this process, and
one short run against the real `python app.py` started by `--launch`, with a queue small enough to
turn users away."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bench.load import LoadOptions, drive, run
from bench.load_results import memory_change, summary


# ---------------------------------------------------------------------------------------------
# Options and arithmetic


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(), "give exactly one of --url URL and --launch"),
        (dict(url="http://x/", launch_args=()), "give exactly one of --url URL and --launch"),
        (dict(url="localhost:7860"), "--url must start with http:// or https://"),
        (dict(launch_args=(), pid=123), "--pid is for --url"),
        (dict(url="http://x/", users=0), "--users must be at least 1, got 0"),
        (dict(url="http://x/", users=8, requests=7), "--requests must be at least --users (8), got 7"),
        (dict(url="http://x/", timeout_s=0), "timeout_s must be positive"),
        (dict(url="http://x/", busy_backoff_s=-1), "busy_backoff_s must be 0 or more"),
        (dict(url="http://x/", repeat=21), "--repeat must be in 1..20"),
        (dict(url="http://x/", rss_every=0), "--rss-every must be at least 1"),
        (dict(url="http://x/", target="nope"), "--target must be one of compare, translate, http, serve, got 'nope'"),
        (dict(launch_args=(), target="serve"), "--target serve drives a running `python -m service.serve`"),
        (dict(url="http://x/", target="serve", repeat=2), "--repeat is the compare endpoint's; serve runs"),
        (dict(url="http://x/", duration_s=0), "--duration must be positive"),
        (dict(url="http://x/", rate=0), "--rate must be a positive number of requests per second"),
        (dict(url="http://x/", rate=5, arrivals="bursty"), "--arrivals must be one of poisson, fixed"),
        (dict(url="http://x/", rate=5, think_s=1), "--think and --busy-backoff are the closed loop's"),
        (dict(url="http://x/", target="translate", repeat=2), "--repeat is the compare endpoint's"),
        (dict(url="http://x/", baseline_export=Path("x")), "--baseline-export is for --target translate or http or serve"),
        (dict(url="http://x/", baseline_batches=(32, 0)), "--baseline-batches must be whole numbers of at least 1"),
        (dict(url="http://x/", baseline_batches=()), "--baseline-batches must be whole numbers of at least 1"),
        (dict(url="http://x/", baseline_rounds=0), "--baseline-rounds must be at least 1, got 0"),
    ],
)
def test_options_refuse_what_cannot_run(fields, message):
    with pytest.raises(ValueError) as e:
        LoadOptions(**fields)
    assert message in str(e.value)


def test_options_report_every_problem_at_once():
    with pytest.raises(ValueError) as e:
        LoadOptions(url="ftp://x/", users=0, warmup=-1)
    assert str(e.value).count(";") == 2, str(e.value)


def test_summary_percentiles_are_linear_and_skip_missing():
    s = summary([40.0, None, 10.0, 30.0, float("nan"), 20.0])
    assert s == {"n": 4, "p50": 25.0, "p95": 38.5, "p99": 39.7, "mean": 25.0, "min": 10.0, "max": 40.0}
    assert summary([None]) is None


def test_memory_change_is_from_the_first_checkpoint_to_the_last():
    samples = [{"finished": 0, "rss_mb": 500.0}, {"finished": 100, "rss_mb": 800.0},
               {"finished": 200, "rss_mb": 820.0}, {"finished": 300, "rss_mb": 840.0}]
    assert memory_change(samples, 100) == {"from_finished": 100, "from_mb": 800.0, "to_finished": 300,
                                           "to_mb": 840.0, "change_mb": 40.0, "change_pct": 5.0}
    assert memory_change(samples[:2], 100) is None


def test_batch_sizes_and_decoder_busy_share_count_each_batch_once():
    from bench.load import Request
    from bench.load_results import batch_sizes, decoder_busy_share

    # a batch of 4 decoded in 400 ms, one of 2 in 100 ms, a lone request in 50 ms, over 2 s
    ok = [Request(i, i, i, decoded_together=4, compute_ms=400.0) for i in range(4)]
    ok += [Request(4 + i, i, i, decoded_together=2, compute_ms=100.0) for i in range(2)]
    ok += [Request(6, 0, 0, decoded_together=1, compute_ms=50.0)]
    assert batch_sizes(ok) == {1: 1, 2: 2, 4: 4}
    assert decoder_busy_share(ok, 2.0) == 0.275  # (400 + 100 + 50) ms of 2,000
    assert batch_sizes([]) is None and decoder_busy_share([], 2.0) is None


# ---------------------------------------------------------------------------------------------
# A stub `compare` endpoint in this process: what it does is set per test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stub():
    import gradio as gr

    mode = {"seconds": 0.0, "error": None, "answer": None, "backends_named": []}

    def compare(text: str, repeat: int = 1) -> Iterator[dict]:  # gr.api reads its outputs from the annotation
        end = time.monotonic() + mode["seconds"]
        while time.monotonic() < end:  # short steps: a cancelled request stops at the next yield
            time.sleep(0.05)
            yield {"backends": {}}
        b = {"error": mode["error"], "runs": {"totals_ms": [mode["seconds"] * 1e3]}}
        yield mode["answer"] or {"reference": "pytorch", "backends": {"pytorch": b, "ort_int8": dict(b, error=None)}}

    # the real endpoint's signature and answer, as ui/translate_tab.py and service/translate.py write them
    def translate(text: str, num_beams: int | None = None, backend: str | None = None) -> dict:
        mode["backends_named"].append(backend)
        if mode.get("raise_"):
            raise gr.Error(mode["raise_"])
        time.sleep(mode["seconds"])
        if mode["error"]:
            return {"text": None, "error": mode["error"], "backend": None, "decoding": {}, "segments": [],
                    "warnings": [], "batch": {"requests": 1, "refused": 1}, "timings_ms": {"decode": 0.0}}
        return {"text": "点击确定。", "error": None, "backend": "ort_fp32_kv_cache",
                "decoding": {"strategy": "beam search", "num_beams": 4, "max_new_tokens": 511},
                "segments": [{"text": text, "translation": "点击确定。", "stop_reason": "eos"}], "warnings": [],
                "batch": {"requests": 3, "refused": 0, "decoded_together": 3, "sentences": 3, "calls": 1},
                "timings_ms": {"decode": 12.5}}

    with gr.Blocks() as demo:
        gr.api(compare, api_name="compare", concurrency_limit=1, concurrency_id="model")
        gr.api(translate, api_name="translate", concurrency_limit=1, concurrency_id="translate")
    demo.queue(max_size=8, default_concurrency_limit=1)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/", mode
    finally:
        demo.close()


def _quiet(_msg: str) -> None:
    pass


def test_a_request_past_its_timeout_is_cancelled_and_counted(stub):
    url, mode = stub
    mode.update(seconds=30.0, error=None, answer=None)
    options = LoadOptions(url=url, users=1, requests=2, timeout_s=0.5, warmup=0, busy_backoff_s=0)
    start = time.monotonic()
    r = drive(url, options, pid=None, log=_quiet)
    elapsed = time.monotonic() - start
    assert r["counts"]["error"] == 2 and r["counts"]["error_kinds"] == {"timeout": 2}, r["counts"]
    assert r["counts"]["ok"] == 0 and r["counts"]["unfinished_users"] == []
    assert all(0.5e3 <= q["end_to_end_ms"] < 5e3 for q in r["requests"]), r["requests"]
    assert elapsed < 15, f"two 0.5 s timeouts took {elapsed:.1f} s"


def test_no_request_is_sent_after_the_deadline(stub):
    url, mode = stub
    mode.update(seconds=0.4, error=None, answer=None)
    options = LoadOptions(url=url, users=2, requests=200, deadline_s=2.0, warmup=0)
    start = time.monotonic()
    r = drive(url, options, pid=None, log=_quiet)
    elapsed = time.monotonic() - start
    c = r["counts"]
    assert 1 <= c["sent"] < 200 and c["not_sent"] == 200 - c["sent"], c
    assert c["finished"] == c["sent"] == c["ok"] and c["error"] == 0, c
    assert max(q["start_s"] for q in r["requests"]) < 2.0
    assert elapsed < 2.0 + 10, f"a 2 s deadline took {elapsed:.1f} s"


def test_an_answer_naming_a_failed_backend_is_an_error(stub):
    url, mode = stub
    mode.update(seconds=0.0, error="failed to load: decoder_fp16.onnx is missing", answer=None)
    r = drive(url, LoadOptions(url=url, users=1, requests=2, warmup=0), pid=None, log=_quiet)
    assert r["counts"]["error_kinds"] == {"backend_error": 2} and r["counts"]["ok"] == 0
    assert r["requests"][0]["message"] == "pytorch: failed to load: decoder_fp16.onnx is missing"
    assert r["latency_ms"]["end_to_end"] is None  # percentiles are over ok requests only


def test_an_answer_without_backends_is_an_error(stub):
    url, mode = stub
    mode.update(seconds=0.0, error=None, answer={"reference": "pytorch"})
    r = drive(url, LoadOptions(url=url, users=1, requests=1, warmup=0), pid=None, log=_quiet)
    assert r["counts"]["error_kinds"] == {"malformed_answer": 1}, r["requests"]
    assert r["requests"][0]["message"] == "KeyError: 'backends'"


def test_translate_answers_are_counted_with_their_batch(stub):
    url, mode = stub
    mode.update(seconds=0.0, error=None, answer=None)
    r = drive(url, LoadOptions(url=url, users=2, requests=4, warmup=0, target="translate"), pid=None, log=_quiet)
    assert r["target"] == "translate" and r["counts"]["ok"] == 4, r["error_examples"]
    assert r["decoded_together"]["p50"] == 3 and r["latency_ms"]["compute"]["p50"] == 12.5
    assert r["batch_sizes"] == {3: 4}
    # each request's third of a 12.5 ms decode, over the run's wall time; the report rounds run_s to
    # 10 ms, which on a run this short moves the share by more than 10%, so bound it by that rounding
    busy_s = 4 * 12.5 / 3 / 1000
    assert busy_s / (r["run_s"] + 0.005) - 0.001 <= r["decoder_busy_share"] <= busy_s / max(r["run_s"] - 0.005, busy_s) + 0.001
    assert r["served"] == {"backends": ["ort_fp32_kv_cache"],
                           "decodings": [{"strategy": "beam search", "num_beams": 4, "max_new_tokens": 511}]}


def test_a_refused_translate_request_is_an_error_of_its_kind(stub):
    url, mode = stub
    mode.update(seconds=0.0, error="the input is empty: type an English sentence to translate", answer=None)
    r = drive(url, LoadOptions(url=url, users=1, requests=2, warmup=0, target="translate"), pid=None, log=_quiet)
    assert r["counts"]["error_kinds"] == {"refused": 2} and r["counts"]["ok"] == 0
    assert r["requests"][0]["message"].startswith("the input is empty")


def test_translate_phases_are_stamped_as_the_messages_arrive(stub):
    url, mode = stub
    mode.update(seconds=0.2, error=None, answer=None, raise_=None)
    mode["backends_named"].clear()
    options = LoadOptions(url=url, users=1, requests=2, warmup=0, target="translate", backend="ort_int8")
    r = drive(url, options, pid=None, log=_quiet)
    assert r["counts"]["ok"] == 2, r["error_examples"]
    assert mode["backends_named"] == ["ort_int8", "ort_int8"]
    for q in r["requests"]:
        # the stub sleeps 0.2 s inside the call: the service phase holds it, and the phases fit the request
        assert 180 <= q["service_ms"] < 2000 and q["queue_wait_ms"] >= 0, q
        assert q["queue_wait_ms"] + q["service_ms"] <= q["end_to_end_ms"] + 1, q


def test_a_translate_request_past_its_timeout_is_cancelled_and_counted(stub):
    url, mode = stub
    mode.update(seconds=3.0, error=None, answer=None)
    options = LoadOptions(url=url, users=1, requests=1, timeout_s=0.5, warmup=0, target="translate")
    r = drive(url, options, pid=None, log=_quiet)
    assert r["counts"]["error_kinds"] == {"timeout": 1}, r["requests"]
    assert 500 <= r["requests"][0]["end_to_end_ms"] < 3000, r["requests"]
    mode.update(seconds=0.0)
    time.sleep(3.0)  # the stub's call runs out (a cancelled call's thread is not stopped) before the next test


def test_a_translate_call_the_app_fails_is_an_error_naming_its_message(stub):
    url, mode = stub
    mode.update(seconds=0.0, error=None, answer=None, raise_="the decoder is gone")
    try:
        r = drive(url, LoadOptions(url=url, users=1, requests=1, warmup=0, target="translate"), pid=None, log=_quiet)
    finally:
        mode.update(raise_=None)
    assert r["counts"]["error_kinds"] == {"AppError": 1}, r["requests"]
    assert "the decoder is gone" in r["requests"][0]["message"]


def test_a_full_queue_turns_translate_requests_away_as_busy(stub):
    url, mode = stub
    mode.update(seconds=0.3, error=None, answer=None)
    # one call at a time and 8 waiting (the stub's queue): 12 users at once leave some of them out
    options = LoadOptions(url=url, users=12, requests=12, warmup=0, target="translate", busy_backoff_s=0)
    r = drive(url, options, pid=None, log=_quiet)
    c = r["counts"]
    assert c["busy"] >= 1 and c["ok"] >= 9 and c["error"] == 0, (c, r["error_examples"])


@pytest.fixture
def serve_stub():
    """An HTTP JSON endpoint as `python -m service.serve` answers, one status per request in turn."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    statuses = [200, 422, 500, 503]

    class Seen(list):
        paths: list[str] = []

    seen = Seen()
    seen.paths = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            text = json.loads(self.rfile.read(int(self.headers["content-length"])))["text"]
            status = statuses[len(seen) % len(statuses)]
            seen.append(text)
            seen.paths.append(self.path)
            ok = {"text": "点击确定。", "error": None, "backend": "ort_fp32_kv_cache",
                  "decoding": {"strategy": "greedy", "num_beams": 1, "max_new_tokens": 511},
                  "segments": [{"text": text, "translation": "点击确定。", "stop_reason": "eos"}], "warnings": [],
                  "batch": {"requests": 5, "refused": 1, "decoded_together": 4, "sentences": 4, "calls": 1},
                  "timings_ms": {"decode": 7.5}}
            body = {200: ok, 422: dict(ok, text=None, error="the input is empty", segments=[]),
                    500: {"raw": "Internal Server Error"}, 503: {"raw": "queue full"}}[status]
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/translate", seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_serve_target_counts_each_status_as_its_outcome(serve_stub):
    url, seen = serve_stub
    options = LoadOptions(url=url, users=1, requests=8, warmup=0, target="serve", busy_backoff_s=0)
    r = drive(url, options, pid=None, log=_quiet)
    c = r["counts"]
    assert len(seen) == 8 and (c["ok"], c["busy"], c["error"]) == (2, 2, 4), c
    assert c["error_kinds"] == {"refused": 2, "http_500": 2}
    assert r["decoded_together"]["p50"] == 4 and r["latency_ms"]["compute"]["p50"] == 7.5
    assert r["served"]["backends"] == ["ort_fp32_kv_cache"] and r["latency_ms"]["queue_wait"] is None
    refused = [q for q in r["requests"] if q["kind"] == "refused"]
    assert refused[0]["message"] == "the input is empty"
    from bench.load_report import memory_lines, summary_table

    assert "RSS" not in summary_table(r)  # no --pid: no memory read, none reported as None
    assert memory_lines(r) == ["Not sampled: give `--pid PID` with `--url`, or use `--launch`."]


def test_the_http_target_posts_to_the_apps_route_under_its_url(serve_stub):
    """--target http takes the app's URL (as --launch gives it) and POSTs to its /translate, read
    as the serve target reads Ray Serve's answers; serve's URL is the endpoint itself."""
    from bench.load import post_url

    assert post_url("http://h:7860/", "http") == post_url("http://h:7860", "http") == "http://h:7860/translate"
    assert post_url("http://h:8000/translate", "serve") == "http://h:8000/translate"
    endpoint, seen = serve_stub
    app = endpoint.removesuffix("translate")
    r = drive(app, LoadOptions(url=app, users=1, requests=8, warmup=0, target="http", busy_backoff_s=0),
              pid=None, log=_quiet)
    assert len(seen) == 8 and r["target"] == "http" and set(seen.paths) == {"/translate"}
    assert (r["counts"]["ok"], r["counts"]["busy"], r["counts"]["error"]) == (2, 2, 4), r["counts"]


def test_a_run_with_a_duration_stops_sending_when_it_is_up(stub):
    url, mode = stub
    mode.update(seconds=0.2, error=None, answer=None)
    options = LoadOptions(url=url, users=2, requests=10_000, warmup=1, target="translate", duration_s=1.5)
    start = time.monotonic()
    r = drive(url, options, pid=None, log=_quiet)
    c = r["counts"]
    assert 2 <= c["sent"] < 30 and c["requests"] == c["sent"] == c["ok"] and c["not_sent"] == 0, c
    assert max(q["start_s"] for q in r["requests"]) < 0.2 * 2 + 1.5 + 1, r["requests"][-1]
    assert time.monotonic() - start < 10


def test_open_loop_arrivals_are_seeded_at_the_rate():
    from bench.load import arrival_schedule

    assert arrival_schedule(LoadOptions(url="http://x/")) is None  # closed loop
    fixed = arrival_schedule(LoadOptions(url="http://x/", users=1, rate=4.0, arrivals="fixed", requests=5))
    assert fixed == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    poisson = arrival_schedule(LoadOptions(url="http://x/", rate=20.0, requests=4000, seed=3))
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.1) and len(set(gaps)) == len(gaps)
    assert poisson == arrival_schedule(LoadOptions(url="http://x/", rate=20.0, requests=4000, seed=3))


def test_an_open_loop_sends_every_arrival_on_schedule_whatever_the_answers(stub):
    url, mode = stub
    mode.update(seconds=0.25, error=None, answer=None)  # the stub answers one at a time: 4 a second at most
    options = LoadOptions(url=url, users=3, requests=10_000, warmup=0, target="translate", duration_s=1.0,
                          rate=10.0, arrivals="fixed")
    r = drive(url, options, pid=None, log=_quiet)
    c, o = r["counts"], r["open_loop"]
    assert c["sent"] == c["ok"] == 10, c  # arrivals at 0, 0.1, ..., 0.9 s: all sent, none dropped
    assert (o["rate_per_s"], o["arrivals"], o["connections"]) == (10.0, "fixed", 3)
    late = [q for q in r["requests"] if q["late_ms"] > 0]
    assert o["sent_late"] == len(late) >= 5  # 3 connections, answers 0.25 s apart: most wait for one
    for q in r["requests"]:  # latency counts from the scheduled arrival, the wait for a connection included
        assert q["end_to_end_ms"] >= q["late_ms"] + 200
    assert r["latency_ms"]["end_to_end"]["p99"] > 1000  # the backlog shows in the P99


# ---------------------------------------------------------------------------------------------
# The real app, started and stopped by the benchmark


@pytest.fixture(scope="module")
def launched(app_args, tmp_path_factory):
    """4 users x 24 requests against `python app.py --queue-size 1`: one running, one waiting. Its
    own app process (this test stops it), on the model the app tests serve (conftest's app_args)."""
    launch_args = [*app_args, "--queue-size", "1", "--threads", "2"]
    options = LoadOptions(launch_args=tuple(launch_args), users=4, requests=24, warmup=1, rss_every=8,
                          busy_backoff_s=0.2, timeout_s=120, deadline_s=300)
    out = tmp_path_factory.mktemp("load")
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    return run(options, out, log=_quiet), out


def test_every_request_is_ok_busy_or_error_and_none_is_an_error(launched):
    r, _ = launched
    c = r["counts"]
    assert c["ok"] + c["busy"] + c["error"] == c["finished"] == c["sent"] == c["requests"] == 24, c
    assert c["error"] == 0, r["error_examples"]
    assert c["ok"] >= 1 and c["busy"] >= 1, c  # 4 users, room for 2: someone is turned away
    assert r["busy_messages"] == ["Queue is full! Please try again."]
    assert r["rates"]["busy_rate"] == pytest.approx(c["busy"] / 24, abs=1e-4)


def test_percentiles_are_ordered_and_positive(launched):
    r, _ = launched
    for phase in ("end_to_end", "queue_wait", "service", "compute"):
        s = r["latency_ms"][phase]
        assert s["n"] == r["counts"]["ok"], phase
        assert 0 < s["min"] <= s["p50"] <= s["p95"] <= s["p99"] <= s["max"], (phase, s)


def test_phases_fit_inside_each_request(launched):
    """Queue wait + service end before the client has the result; the backends' compute happens
    within the service window (whose ends gradio_client stamps up to 50 ms late)."""
    r, _ = launched
    ok = [q for q in r["requests"] if q["outcome"] == "ok"]
    for q in ok:
        assert q["queue_wait_ms"] + q["service_ms"] <= q["end_to_end_ms"] + 5, q
        assert 0 < q["compute_ms"] <= q["service_ms"] + 100, q
        assert q["rank_on_join"] in (0, 1), q  # queue size 1: next, or behind the one waiting
        assert q["tokens"] >= 1 and isinstance(q["capped"], list), q
    for q in r["requests"]:
        if q["outcome"] == "busy":
            assert q["kind"] == "QueueError" and q["compute_ms"] is None and q["service_ms"] is None, q


def test_app_memory_is_sampled_at_each_checkpoint(launched):
    r, _ = launched
    samples = r["memory"]["samples"]
    assert [s["finished"] for s in samples] == [0, 8, 16, 24]
    for s in samples:
        assert "memory_error" not in s, s
        assert s["rss_mb"] > 50 and s["processes"] >= 1, s
    assert [s["ok"] + s["busy"] + s["error"] for s in samples[1:]] == [8, 16, 24]
    change = r["memory"]["change"]
    assert change["from_finished"] == 8 and change["to_finished"] == 24
    assert change["change_mb"] == pytest.approx(samples[-1]["rss_mb"] - samples[1]["rss_mb"], abs=0.11)
    assert r["cpu_s"]["app"] > 0


def test_launched_app_is_stopped_cleanly(launched):
    r, _ = launched
    stop = r["launched"]["stop"]
    assert stop["signal"] == "SIGINT" and stop["returncode"] == 0, stop
    assert not psutil.pid_exists(r["pid"]) or psutil.Process(r["pid"]).status() == psutil.STATUS_ZOMBIE


def test_results_and_report_are_written(launched):
    r, out = launched
    assert json.loads((out / "results.json").read_text(encoding="utf-8"))["counts"] == r["counts"]
    report = (out / "report.md").read_text(encoding="utf-8")
    c = r["counts"]
    assert f"24 requests: {c['ok']} ok, {c['busy']} busy" in report
    assert "| end to end | " in report and "Queue is full! Please try again." in report


def test_the_user_threads_are_gone(launched):
    assert not [t.name for t in threading.enumerate() if t.name.startswith("load-user-")]
