"""The `translate` API on Ray Serve (service/serve.py), on a simulated two-node cluster.

Two 1-CPU nodes (`ray.cluster_utils.Cluster`), one 1-thread replica on each, serving the tiny
export: answers equal `translate_batch`'s for each request alone (the exact backend), answered
from both nodes; a refused request is answered 422 while the requests batched with it are answered
200; a body that is not a request is answered 400; a replica killed during a stream of requests
costs no request silently (each is answered correctly or with an explicit error status, none
hangs) and is replaced; SIGTERM stops `python -m service.serve` cleanly. The request parsing and
the options' checks run without Ray.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TINY_MAX_NEW_TOKENS, free_port
from corpus import dev_sentences

REPO = Path(__file__).resolve().parent.parent
BACKEND = "ort_fp32_kv_cache"
TIMEOUT_S = 60  # per request: far longer than any answer of the tiny model, so a hang is told from slowness
SAME = ("text", "error", "backend", "decoding", "segments", "warnings")  # what does not depend on the batch


def post(url: str, body: bytes, timeout: float = TIMEOUT_S) -> tuple[int, dict, dict]:
    """(status, JSON body, headers); an HTTP error status is an answer too. A timeout raises."""
    req = urllib.request.Request(url, data=body, method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            data = {"raw": raw.decode("utf-8", "replace")[:500]}
        return e.code, data, dict(e.headers)


def ask(url: str, text: str, **fields) -> tuple[int, dict, dict]:
    return post(url, json.dumps({"text": text, **fields}).encode())


# --- without Ray ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, says", [
    (b"not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"txt": "Hello."}', "unknown field(s) txt; expected: text, num_beams, backend"),
    (b'{"text": 3}', "`text` must be a string"),
    (b"\xff\xfe", "not JSON"),
])
def test_a_body_that_is_not_a_request_is_named(body, says):
    from service.http_api import parse_request

    with pytest.raises(ValueError) as e:
        parse_request(body)
    assert says in str(e.value)


def test_a_request_takes_the_apps_fields():
    from service.http_api import parse_request

    assert parse_request(b'{"text": "Hi.", "num_beams": 4}') == {"text": "Hi.", "num_beams": 4, "backend": None}


def test_the_apps_route_turns_a_request_away_while_it_is_full_and_answers_a_failed_batch():
    """`AppTranslateRoute` with room for one request: a second, while the first waits, is answered
    503 at once; once the first is answered there is room again; a batch that failed is a 500."""
    import threading

    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from service.batcher import BatchFailed
    from service.http_api import AppTranslateRoute
    from service.translate import TranslateAnswer

    release, started = threading.Event(), threading.Event()

    def submit(item):
        text, _, _ = item
        if text == "boom":
            raise BatchFailed("the batch of 2 requests this one was part of failed: RuntimeError: broke")
        started.set()
        assert release.wait(10)
        return TranslateAnswer(backend="ort_fp32_kv_cache", error=None)

    app = Starlette()
    AppTranslateRoute(submit, max_in_flight=1).mount(app)
    with TestClient(app) as http:
        first: dict = {}
        waiting = threading.Thread(target=lambda: first.update(r=http.post("/translate", json={"text": "a"})))
        waiting.start()
        assert started.wait(10)
        full = http.post("/translate", json={"text": "b"})
        assert full.status_code == 503 and "the server is full: 1 requests in flight, it takes 1" in full.json()["error"]
        release.set()
        waiting.join(10)
        assert first["r"].status_code == 200 and first["r"].json()["backend"] == "ort_fp32_kv_cache"
        assert http.post("/translate", json={"text": "c"}).status_code == 200  # room again
        failed = http.post("/translate", json={"text": "boom"})
        assert failed.status_code == 500 and "BatchFailed" in failed.json()["error"]
        assert http.get("/translate").status_code == 405
    with pytest.raises(ValueError, match="at least 1"):
        AppTranslateRoute(submit, max_in_flight=0)


def test_importing_it_imports_no_ray():
    code = "import sys, service.serve; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_without_ray_serve_the_command_says_what_to_install(tiny_export_dir):
    code = ("import sys; sys.modules['ray.serve'] = None; from service.serve import main; "
            f"sys.exit(main([{str(tiny_export_dir)!r}, '--backend', 'ort_fp32_kv_cache']))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr
    assert "pip install -r requirements-serve.txt (ray[serve]==2.60.0" in out.stderr


def test_options_are_checked_once_naming_the_choices(tiny_export_dir):
    from service.serve import ServeOptions

    with pytest.raises(ValueError) as e:
        ServeOptions(export=tiny_export_dir, backend="ort_fp64", replicas=0, port=70000, max_batch_size=128)
    said = str(e.value)
    assert "unknown backend 'ort_fp64'; expected one of: pytorch, ort_fp32_single_step, ort_fp32_kv_cache" in said
    assert "replicas must be an integer >= 1, got 0" in said
    assert "port must be in 1..65535, got 70000" in said
    assert "max_ongoing (64) must be at least max_batch_size (128)" in said


def test_refused_and_failed_answers_get_their_own_status(tiny_backends):
    from service.http_api import status_for
    from service.translate import translate_batch

    ok, empty, unknown = translate_batch({BACKEND: tiny_backends[BACKEND]}, ["Hello.", "  ", "Hi."],
                                         None, [None, None, "ort_int8"], default=BACKEND, max_new_tokens=4)
    assert [status_for(a) for a in (ok, empty, unknown)] == [200, 422, 422]
    ok.error = "the decode this request was part of failed: RuntimeError: boom"
    assert status_for(ok) == 500


@pytest.mark.ray
@pytest.mark.slow
def test_sigterm_stops_the_command_cleanly(tiny_export_dir, artifacts_dir):
    """Before the cluster tests: the command starts its own local Ray runtime."""
    port = free_port()
    log = artifacts_dir / "serve-sigterm.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service.serve", str(tiny_export_dir), "--backend", BACKEND,
                                 "--port", str(port), "--max-new-tokens", str(TINY_MAX_NEW_TOKENS)],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "serving 1 replica(s)" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(1)
        status, body, _ = ask(f"http://127.0.0.1:{port}/translate", "Hello.")
        assert status == 200 and body["text"], body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopping" in log.read_text()


# --- on a two-node cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_export_dir):
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    from ray.cluster_utils import Cluster

    from service.serve import ServeOptions, replica_actors, start, stop

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        # a long batch wait, so requests sent together are batched together
        options = ServeOptions(export=tiny_export_dir, backend=BACKEND, replicas=2, threads=1, port=free_port(),
                               max_batch_size=8, batch_wait_s=0.2, health_period_s=2, request_timeout_s=TIMEOUT_S,
                               max_new_tokens=TINY_MAX_NEW_TOKENS)
        url = start(options)
        # Both nodes' proxies listen on this machine's one port and the kernel spreads connections
        # between them; one that has not yet heard of the route answers 404 for a moment.
        deadline, answered = time.monotonic() + 120, 0
        while answered < 20 and time.monotonic() < deadline:
            answered = answered + 1 if ask(url, "Hello.")[0] == 200 else 0
        assert answered == 20, "the proxies did not all serve the route within 120 s"
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        yield SimpleNamespace(url=url, options=options, nodes=nodes, replicas=replica_actors)
    finally:
        stop()
        cluster.shutdown()


@pytest.fixture(scope="module")
def alone(tiny_export_dir):
    """Each dev sentence's answer from translate_batch, alone, in this process."""
    from backends import SessionConfig, load_backends
    from service.translate import translate_batch

    backends = load_backends(tiny_export_dir, (BACKEND,), session=SessionConfig(threads=1))
    texts = dev_sentences(24)
    answers = {t: translate_batch(backends, [t], default=BACKEND, max_new_tokens=TINY_MAX_NEW_TOKENS)[0].to_json()
               for t in texts}
    return texts, answers


def _same(answer: dict, expected: dict) -> dict:
    return {k: answer[k] for k in SAME}, {k: expected[k] for k in SAME}


@pytest.mark.ray
@pytest.mark.slow
def test_two_replicas_on_two_nodes_answer_as_translate_batch_does(served, alone):
    texts, expected = alone
    assert len(served.nodes) == 2 and len(served.replicas()) == 2
    # Each proxy prefers its own node's replica, and the kernel spreads connections between the
    # proxies; a proxy that fails its health check on a loaded machine is restarted and meanwhile
    # the other takes every connection, so bursts go on until both nodes have answered.
    nodes, together, deadline = set(), [], time.monotonic() + 120
    while nodes != served.nodes and time.monotonic() < deadline:
        with ThreadPoolExecutor(len(texts)) as pool:
            answers = list(pool.map(lambda t: ask(served.url, t), texts))
        for text, (status, body, headers) in zip(texts, answers):
            assert status == 200, body
            got, want = _same(body, expected[text])
            assert got == want
            nodes.add(headers["x-serve-node"])
            together.append(body["batch"]["decoded_together"])
    assert nodes == served.nodes  # both replicas answered
    assert max(together) > 1  # @serve.batch batched them


@pytest.mark.ray
@pytest.mark.slow
def test_a_refused_request_is_422_and_its_batch_is_answered(served, alone):
    texts, expected = alone
    sent = texts[:6] + ["   "] + texts[6:12] + [""] + texts[12:18] + [" "]
    for _ in range(5):  # until a burst puts a refused request in a batch with good ones
        with ThreadPoolExecutor(len(sent)) as pool:
            answers = list(pool.map(lambda t: ask(served.url, t), sent))
        refused = [b for t, (s, b, _) in zip(sent, answers) if not t.strip()]
        if any(b["batch"]["requests"] > b["batch"]["refused"] for b in refused):
            break
    for text, (status, body, _) in zip(sent, answers):
        if not text.strip():
            assert status == 422 and body["text"] is None and "empty" in body["error"], body
            continue
        assert status == 200, body
        got, want = _same(body, expected[text])
        assert got == want
    assert any(b["batch"]["requests"] > b["batch"]["refused"] for b in refused)  # refused beside good ones
    assert any(b["batch"]["refused"] for s, b, _ in answers if s == 200)


@pytest.mark.ray
@pytest.mark.slow
def test_a_body_that_is_not_a_request_is_400(served):
    status, body, _ = post(served.url, b"{not json")
    assert status == 400 and "not JSON" in body["error"]
    status, body, _ = post(served.url, b'{"text": "Hello.", "beams": 4}')
    assert status == 400 and body["error"] == "unknown field(s) beams; expected: text, num_beams, backend"
    status, body, _ = ask(served.url, "Hello.", backend="ort_int8")
    assert status == 422 and "unknown backend 'ort_int8'; expected one of: ort_fp32_kv_cache" in body["error"]


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_replica_loses_no_request_silently_and_is_replaced(served, alone):
    """Last of the cluster tests: four users send requests while one replica is killed."""
    import ray

    from service.serve import running_replicas

    texts, expected = alone
    before = served.replicas()
    assert len(before) == 2 and running_replicas() == 2
    outcomes: list[tuple[str, int | str, dict, str | None]] = []  # text, status, body, answering node
    stop_at = [time.monotonic() + 180]

    def user(u: int) -> None:
        i = u
        while time.monotonic() < stop_at[0]:
            text = texts[i % len(texts)]
            i += 4
            try:
                status, body, headers = ask(served.url, text)
            except OSError as e:  # a timeout or a dropped connection: what must not happen
                outcomes.append((text, type(e).__name__, {"error": str(e)}, None))
                continue
            outcomes.append((text, status, body, headers.get("x-serve-node")))

    users = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(4)]
    for t in users:
        t.start()
    time.sleep(3)
    answered_before_kill = len(outcomes)
    victim = before[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 120
    # A new name appears once the controller has seen the death; until then the status may still
    # count the dead replica as running.
    while time.monotonic() < deadline and not (set(served.replicas()) - set(before) and running_replicas() == 2):
        time.sleep(0.5)
    replaced_at = len(outcomes)
    stop_at[0] = time.monotonic() + 8  # then eight more seconds with the replacement up
    for t in users:
        t.join(timeout=stop_at[0] - time.monotonic() + TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in users), "a request never came back"

    after = served.replicas()
    assert victim not in after and len(after) == 2 and running_replicas() == 2, (before, after)
    assert answered_before_kill > 0 and len(outcomes) > replaced_at + 8
    by_status: dict = {}
    for text, status, body, _ in outcomes:
        by_status[status] = by_status.get(status, 0) + 1
        if status == 200:
            got, want = _same(body, expected[text])
            assert got == want
    errors = sorted({json.dumps(b)[:200] for _, s, b, _ in outcomes if s != 200})
    print(f"kill test: {len(outcomes)} requests, {by_status}, {answered_before_kill} before the kill, "
          f"{replaced_at} when the replacement was up; errors: {errors}")
    # every request came back: correct (200) or an explicit server error; no timeout, no dropped connection
    assert set(by_status) <= {200, 500, 502, 503}, by_status
    assert by_status.get(200, 0) >= len(outcomes) - 16  # at most the requests in flight at the killed replica
    late = outcomes[replaced_at + 4:]  # the replacement sits on the killed replica's node (one CPU each)
    assert all(s == 200 for _, s, _, _ in late) and {n for *_, n in late} == served.nodes
