"""python -m bench load: many users at once against the app's `compare` endpoint (through gradio_client),
its `translate` endpoint (through the Gradio queue's own HTTP protocol, `load_client.py`, or as plain
HTTP JSON), or the same `translate` API on Ray Serve (`python -m service.serve`), over HTTP.

Each user is one client (its own session) in its own thread, sending one request
at a time and the next as soon as the answer is in (a closed loop). Every request ends as exactly
one of:

  ok      the final JSON arrived and no backend in it reports an error (translate: its `error` is null)
  busy    the app's queue was full: gradio answers HTTP 503 and gradio_client raises
          `QueueError("Queue is full! Please try again.")` (checked against gradio 6.31 /
          gradio_client 2.7.2); the user waits `busy_backoff_s` before its next request
  error   anything else, by kind: `timeout` (no final answer within `timeout_s`; the job is then
          cancelled), `backend_error` (the JSON names a failed backend), `refused` (translate: the
          answer's `error` refuses the request), `malformed_answer`, or the exception's type
          (`AppError` for an error the app raised, e.g. on an empty input)

Time per request, from three clocks:

  end to end   time.perf_counter around submit -> final result, in the user's thread
  queue wait   submit -> the `process_starts` message arrives (gradio_client: status PROCESSING)
  service      `process_starts` -> `process_completed` (gradio_client: status FINISHED)
  compute      the sum over backends of their own translate timings (`runs.totals_ms`, the hot path);
               service - compute is the rest of the server's work: teacher-forced scoring and
               alignment for the divergence view, JSON, the streamed diffs. translate: the wall time
               of the decode the request shared with the others batched with it (`timings_ms.decode`)

`--target translate` sends one sentence per request to the `translate` endpoint (the app's default
backend and decoding), which Gradio batches; each answer's `batch.decoded_together` is recorded.
`--target http` sends the same requests as JSON POSTs to the app's own `POST /translate` (under `--url`,
or the app `--launch` starts; `service/http_api.py`), the same batcher without Gradio's queue protocol;
`--target serve` sends them to `python -m service.serve`'s endpoint (`--url http://HOST:8000/translate`),
which Ray Serve batches. Both: one keep-alive HTTP connection per user; 200 is read as the translate
answer, 503 (the server is full) is busy, 422 is `refused`, any other status is an error of kind
`http_STATUS`; there is no queue wait or service phase to read.
`duration_s` runs for that many seconds after the warm-up instead of a number of requests.

For compare, the status times are stamped by gradio_client's per-job worker, which polls for messages
every 50 ms, so each phase boundary (and the end) can be late by up to 50 ms; translate's client stamps
each message as it arrives.
"""

from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urljoin, urlparse

from corpus import default_sample
from service.environment import environment
from service.http_api import ROUTE

from .data import DEFAULT_TSV
from .load_results import OUTCOMES, collect, cpu_s

TARGETS = ("compare", "translate", "http", "serve")
BATCHED = ("translate", "http", "serve")  # the targets answering with the translate JSON
POSTED = ("http", "serve")  # the targets taking one JSON POST per request (service/http_api.py)
ARRIVALS = ("poisson", "fixed")
CANCEL_GRACE_S = 10.0  # a cancelled job settles in well under a second when the app is alive


@dataclass(frozen=True)
class LoadOptions:
    """What to drive and how hard; validated once here."""

    url: str | None = None  # a running app; exactly one of url and launch_args
    launch_args: tuple[str, ...] | None = None  # start `python app.py *launch_args` and stop it after
    pid: int | None = None  # with url: the app's process, for its RSS (with launch: the started one)
    users: int = 16  # concurrent clients, one request in flight each
    requests: int = 400  # requests sent in all, busy rejections included
    timeout_s: float = 120.0  # per request, submit to final result; then cancelled, counted as an error
    deadline_s: float = 1800.0  # warm-up and run: no request is sent after this
    busy_backoff_s: float = 1.0  # a user turned away waits this long, as a person told "try again" would
    think_s: float = 0.0  # a user's pause after each answered request
    warmup: int = 2  # requests one at a time before the run, not counted
    rss_every: int = 100  # sample the app's memory each time this many requests have finished
    repeat: int = 1  # the endpoint's `repeat`: runs per backend per request
    tsv: Path = DEFAULT_TSV
    seed: int = 0
    start_timeout_s: float = 900.0  # with launch: a first start exports the embedded model
    target: str = "compare"  # the endpoint driven, one of TARGETS
    duration_s: float | None = None  # send requests for this long after the warm-up (then `requests` is a cap)
    # translate: after the run, the served backend's offline throughput from this export
    baseline_export: Path | None = None
    threads: int | None = None  # the baseline's threads: the app's --threads
    # the baseline's batch sizes, timed in alternating rounds so each ratio is side by side with the others
    baseline_batches: tuple[int, ...] = (32, 16)
    baseline_rounds: int = 3
    backend: str | None = None  # translate: the backend each request names (None: the app's default)
    # Open loop: requests arrive at this rate (per second) whatever the answers, on `users` connections;
    # None is the closed loop (each user sends its next request when its answer is in).
    rate: float | None = None
    arrivals: str = "poisson"  # open loop: exponential gaps ("poisson") or equal ones ("fixed")

    def __post_init__(self):
        problems = []
        if (self.url is None) == (self.launch_args is None):
            problems.append("give exactly one of --url URL and --launch")
        if self.url is not None and urlparse(self.url).scheme not in ("http", "https"):
            problems.append(f"--url must start with http:// or https://, got {self.url!r}")
        if self.pid is not None and self.launch_args is not None:
            problems.append("--pid is for --url; --launch samples the app it starts")
        if self.pid is not None and self.pid < 1:
            problems.append(f"--pid must be a process id, got {self.pid}")
        if self.rate is not None and not self.rate > 0:
            problems.append(f"--rate must be a positive number of requests per second, got {self.rate}")
        if self.arrivals not in ARRIVALS:
            problems.append(f"--arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        if self.rate is not None and (self.think_s or self.busy_backoff_s != 1.0):
            problems.append("--think and --busy-backoff are the closed loop's; an open loop sends on its schedule")
        if self.users < 1:
            problems.append(f"--users must be at least 1, got {self.users}")
        if self.requests < self.users:
            problems.append(f"--requests must be at least --users ({self.users}), got {self.requests}")
        if self.target not in TARGETS:
            problems.append(f"--target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.duration_s is not None and not self.duration_s > 0:
            problems.append(f"--duration must be positive, got {self.duration_s}")
        if self.target in BATCHED and self.repeat != 1:
            problems.append(f"--repeat is the compare endpoint's; {self.target} runs each request once")
        if self.backend is not None and self.target not in BATCHED:
            problems.append(f"--backend is for --target {' or '.join(BATCHED)} (compare runs every backend)")
        if self.baseline_export is not None and self.target not in BATCHED:
            problems.append(f"--baseline-export is for --target {' or '.join(BATCHED)}")
        if self.target == "serve" and self.launch_args is not None:
            problems.append("--target serve drives a running `python -m service.serve`: give --url "
                            "http://HOST:PORT/translate (--launch starts app.py)")
        if not self.baseline_batches or any(not isinstance(b, int) or b < 1 for b in self.baseline_batches):
            problems.append(f"--baseline-batches must be whole numbers of at least 1, got {self.baseline_batches}")
        if self.baseline_rounds < 1:
            problems.append(f"--baseline-rounds must be at least 1, got {self.baseline_rounds}")
        for name in ("timeout_s", "deadline_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("busy_backoff_s", "think_s"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must be 0 or more, got {getattr(self, name)}")
        if self.warmup < 0:
            problems.append(f"--warmup must be 0 or more, got {self.warmup}")
        if self.rss_every < 1:
            problems.append(f"--rss-every must be at least 1, got {self.rss_every}")
        if not 1 <= self.repeat <= 20:
            problems.append(f"--repeat must be in 1..20 (the endpoint's range), got {self.repeat}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass
class Request:
    """One request as the client saw it."""

    index: int  # -1 .. -warmup for warm-up requests
    user: int
    sentence: int  # index into the drawn sentences
    outcome: str = "error"  # one of OUTCOMES
    kind: str | None = None  # busy / error: the exception type, `timeout` or `backend_error`
    message: str | None = None
    start_s: float = 0.0  # from the start of the run
    end_to_end_ms: float | None = None
    queue_wait_ms: float | None = None
    service_ms: float | None = None
    compute_ms: float | None = None
    rank_on_join: int | None = None  # the first queue position the app announced (0 = next)
    tokens: int | None = None  # the longest output among the backends, in tokens
    capped: list[str] | None = None  # backends that stopped at the length cap, not at eos
    decoded_together: int | None = None  # translate: requests in the decode this one was part of
    backend: str | None = None  # translate: the backend that answered
    decoding: dict | None = None  # translate: the decoding it ran (resolved by the app)
    # open loop: how late it was sent after its scheduled arrival (every connection busy), in ms;
    # end_to_end_ms counts from the scheduled arrival, so that wait is in the latency too
    late_ms: float | None = None


@dataclass
class _Progress:
    """Shared by the user threads: the next request to send, the tallies, the memory samples."""

    total: int
    deadline: float  # time.monotonic()
    every: int
    sample: Callable[[], dict] | None
    log: Callable[[str], None]
    schedule: list[float] | None = None  # open loop: each request's arrival, seconds after `start`
    start: float = 0.0
    sent: int = 0
    finished: int = 0
    tally: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    samples: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim(self) -> int | None:
        with self.lock:
            if self.sent >= self.total:
                return None
            if self.schedule is None:
                if time.monotonic() >= self.deadline:
                    return None
            # open loop: every request that arrives before the deadline is sent, late if it must be
            elif self.sent >= len(self.schedule) or self.start + self.schedule[self.sent] >= self.deadline:
                return None
            self.sent += 1
            return self.sent - 1

    def done(self, outcome: str, t0: float) -> None:
        with self.lock:
            self.finished += 1
            self.tally[outcome] += 1
            if self.finished % self.every and self.finished != self.total:
                return
            # sampled under the lock so the samples stay in order; psutil reads /proc, ~1 ms
            sample = {"finished": self.finished, **self.tally, "t_s": round(time.monotonic() - t0, 2)}
            if self.sample:
                sample.update(self.sample())
            self.samples.append(sample)
        rss = f"; app RSS {sample['rss_mb']:.0f} MB" if "rss_mb" in sample else ""
        self.log(f"{sample['finished']}/{self.total} finished: {sample['ok']} ok, {sample['busy']} busy, "
                 f"{sample['error']} errors{rss}")


def _phases(job, sent: datetime) -> dict:
    """Queue wait, service and first queue rank from the job's status updates."""
    if job.communicator is None:
        raise RuntimeError("the endpoint is not queued: gradio_client gives no status updates for it")
    # gradio_client puts every status update of a job in this queue (what `async for` over a Job
    # reads); the last one goes in before the job completes, so after `result()` it is complete.
    updates = job.communicator.updates
    stamps, rank = {}, None
    while not updates.empty():
        u = updates.get_nowait()
        if u.type != "status":
            continue
        stamps.setdefault(u.code.value, u.time)
        if rank is None and u.code.value == "IN_QUEUE":
            rank = u.rank
    start, end = stamps.get("PROCESSING"), stamps.get("FINISHED")
    ms = lambda a, b: round((b - a).total_seconds() * 1e3, 1) if a and b else None  # noqa: E731
    return {"queue_wait_ms": ms(sent, start), "service_ms": ms(start, end), "rank_on_join": rank}


def _check(out, req: Request) -> str | None:
    """Fills compute, tokens and capped from an answer; returns why it is not ok, or None."""
    backends = out["backends"]  # KeyError / TypeError on a malformed answer: the caller counts it
    failed = [f"{name}: {b['error']}" for name, b in backends.items() if b.get("error")]
    if failed:
        return "; ".join(failed)
    req.compute_ms = round(sum(sum(b["runs"]["totals_ms"]) for b in backends.values()), 1)
    # outliers in time and memory are mostly long outputs: a backend that never says eos
    req.tokens = max((len(b.get("token_ids") or ()) for b in backends.values()), default=0)
    req.capped = [name for name, b in backends.items() if b.get("stop_reason") == "max_new_tokens"]
    return None


def _check_translate(out, req: Request) -> str | None:
    """Fills compute, tokens and the batch from a translate answer; returns why it is not ok, or None."""
    if out["error"] is not None:
        return out["error"]
    if not out["text"]:
        raise TypeError("no text and no error")
    req.compute_ms = out["timings_ms"]["decode"]
    req.decoded_together = out["batch"]["decoded_together"]
    req.backend, req.decoding = out["backend"], out["decoding"]
    req.capped = [out["backend"]] if any(s["stop_reason"] != "eos" for s in out["segments"]) else []
    return None


def _judge(req: Request, check: Callable[[], str | None], failed_kind: str,
           malformed: tuple[type[Exception], ...] = (KeyError, TypeError)) -> None:
    """An answer's outcome from `check()`: ok, an error of `failed_kind` saying why, or a malformed answer."""
    try:
        failed = check()
    except malformed as e:
        req.kind, req.message = "malformed_answer", f"{type(e).__name__}: {e}"[:500]
        return
    if failed:
        req.kind, req.message = failed_kind, failed[:500]
    else:
        req.outcome = "ok"


def one_request(client, text: str, req: Request, options: LoadOptions, t0: float) -> Request:
    """Send one request and wait for its outcome, never longer than options.timeout_s."""
    if options.target in POSTED:
        return _one_post(client, text, req, options, t0)
    if options.target == "translate":
        return _one_queued(client, text, req, options, t0)
    from gradio_client.utils import QueueError

    req.start_s = round(time.monotonic() - t0, 3)
    sent, start = datetime.now(), time.perf_counter()
    job = client.submit(text, options.repeat, api_name="/compare")
    try:
        out = job.result(timeout=options.timeout_s)
    except QueueError as e:
        req.outcome, req.kind, req.message = "busy", type(e).__name__, str(e)
    except TimeoutError:
        job.cancel()
        req.kind, req.message = "timeout", f"no final answer in {options.timeout_s:g} s (cancelled)"
    except Exception as e:  # the load test's job is to count what the app answers, by kind
        req.kind, req.message = type(e).__name__, str(e)[:500]
    else:
        _judge(req, lambda: _check(out, req), "backend_error")
    req.end_to_end_ms = round((time.perf_counter() - start) * 1e3, 1)
    if job.done():  # a cancelled job may still be settling; its phases are not needed
        for key, value in _phases(job, sent).items():
            setattr(req, key, value)
    return req


def _one_queued(client, text: str, req: Request, options: LoadOptions, t0: float) -> Request:
    """`one_request` for the translate target, on the user's `QueueClient`."""
    from .load_client import AppError, QueueFull

    req.start_s = round(time.monotonic() - t0, 3)
    start = time.perf_counter()
    try:
        answer = client.call([text, None, options.backend], options.timeout_s)
    except QueueFull as e:
        req.outcome, req.kind, req.message = "busy", type(e).__name__, str(e)
    except TimeoutError:
        req.kind, req.message = "timeout", f"no final answer in {options.timeout_s:g} s (cancelled)"
    except Exception as e:  # the load test's job is to count what the app answers, by kind
        req.kind, req.message = type(e).__name__, str(e)[:500]
    else:
        if answer.process_starts_s is not None:
            req.queue_wait_ms = round(answer.process_starts_s * 1e3, 1)
            req.service_ms = round((answer.completed_s - answer.process_starts_s) * 1e3, 1)
        req.rank_on_join = answer.rank_on_join
        _judge(req, lambda: _check_translate(answer.output, req), "refused")
    req.end_to_end_ms = round((time.perf_counter() - start) * 1e3, 1)
    return req


def _one_post(client, text: str, req: Request, options: LoadOptions, t0: float) -> Request:
    """`one_request` for the http and serve targets: one JSON POST to the endpoint on the user's `_Poster`."""
    import httpx

    req.start_s = round(time.monotonic() - t0, 3)
    start = time.perf_counter()
    try:
        r = client.http.post(client.url, json={"text": text, "backend": options.backend}, timeout=options.timeout_s)
    except httpx.TimeoutException:
        req.kind, req.message = "timeout", f"no answer in {options.timeout_s:g} s"
    except Exception as e:  # the load test's job is to count what the server answers, by kind
        req.kind, req.message = type(e).__name__, str(e)[:500]
    else:
        if r.status_code == 503:
            req.outcome, req.kind, req.message = "busy", "http_503", r.text[:500]
        elif r.status_code not in (200, 422):
            req.kind, req.message = f"http_{r.status_code}", r.text[:500]
        else:
            def check() -> str | None:
                failed = _check_translate(r.json(), req)
                if r.status_code == 422 and not failed:
                    raise TypeError("status 422 with no error")
                return failed

            _judge(req, check, "refused", malformed=(KeyError, TypeError, ValueError))
    req.end_to_end_ms = round((time.perf_counter() - start) * 1e3, 1)
    return req


@dataclass
class _Poster:
    """One user of a JSON POST endpoint: its own keep-alive connection, and the endpoint's URL."""

    http: Any
    url: str

    def close(self) -> None:
        self.http.close()


def post_url(url: str, target: str) -> str:
    """Where the http and serve targets POST: the app's route under its URL; Ray Serve's URL as given."""
    return urljoin(url if url.endswith("/") else url + "/", ROUTE.lstrip("/")) if target == "http" else url


def _clients(url: str, options: LoadOptions) -> list:
    """One client per user: httpx's for the http and serve targets, the queue protocol's for translate,
    gradio_client's for compare (a streaming endpoint, whose diffs gradio_client applies)."""
    # httpx verifies TLS by loading the CA bundle again on every POST, CPU which
    # on a small machine the load generator would take from the app it measures; plain http needs none.
    ssl_verify = urlparse(url).scheme == "https"
    if options.target in POSTED:
        import httpx

        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        return [_Poster(httpx.Client(verify=ssl_verify, limits=limits), post_url(url, options.target))
                for _ in range(options.users)]
    if options.target == "translate":
        from .load_client import QueueClient

        return [QueueClient(url, "translate", ssl_verify=ssl_verify) for _ in range(options.users)]
    from gradio_client import Client

    return [Client(url, verbose=False, ssl_verify=ssl_verify) for _ in range(options.users)]


def _user(user: int, client, texts: list[str], options: LoadOptions, progress: _Progress,
          records: list[Request], crashes: list[BaseException], t0: float) -> None:
    try:
        while (i := progress.claim()) is not None:
            late = 0.0
            if progress.schedule is not None:  # open loop: wait for this request's arrival
                due = progress.start + progress.schedule[i]
                late = time.monotonic() - due
                if late < 0:
                    time.sleep(-late)
                    late = 0.0
            req = one_request(client, texts[i % len(texts)], Request(i, user, i % len(texts)), options, t0)
            if progress.schedule is not None:
                req.late_ms = round(late * 1e3, 1)
                req.end_to_end_ms = round(req.end_to_end_ms + late * 1e3, 1)
            records.append(req)  # list.append is atomic under the GIL
            progress.done(req.outcome, t0)
            pause = options.busy_backoff_s if req.outcome == "busy" else options.think_s
            if pause:
                time.sleep(pause)
    except BaseException as e:  # a bug here, not an answer of the app: drive() re-raises it
        crashes.append(e)


def arrival_schedule(options: LoadOptions) -> list[float] | None:
    """Open loop: each request's arrival in seconds from the run's start (seeded); None: closed loop."""
    if options.rate is None:
        return None
    import random

    rng, t, out = random.Random(options.seed), 0.0, []
    for _ in range(options.requests):
        out.append(t)
        t += rng.expovariate(options.rate) if options.arrivals == "poisson" else 1.0 / options.rate
    return out


def drive(url: str, options: LoadOptions, pid: int | None, log: Callable[[str], None] = print) -> dict:
    """Warm up, then `options.users` users send `options.requests` requests; returns plain data."""
    from .load_app import memory

    pairs = default_sample(options.requests, options.tsv, options.seed)
    texts = [p.en for p in pairs]
    clients = _clients(url, options)

    def sample() -> dict:
        import psutil

        try:
            return memory(pid)
        except psutil.Error as e:  # the app is gone or unreadable: recorded in the sample, shown in the report
            return {"memory_error": f"{type(e).__name__}: {e}"}

    t0 = time.monotonic()
    deadline = t0 + options.deadline_s
    env, rusage_start = environment(threads=0), resource.getrusage(resource.RUSAGE_SELF)  # date and load at start
    samples: list[dict] = []
    try:
        warmup = []
        for w in range(options.warmup):
            if time.monotonic() >= deadline:
                break
            i = w % len(texts)
            warmup.append(one_request(clients[0], texts[i], Request(-1 - w, 0, i), options, t0))
        if pid is not None:
            samples.append({"finished": 0, "after": f"{len(warmup)} warm-up requests", **sample()})
        if options.duration_s is not None:
            deadline = min(deadline, time.monotonic() + options.duration_s)
        progress = _Progress(options.requests, deadline, options.rss_every, sample if pid else None, log,
                             schedule=arrival_schedule(options), start=time.monotonic())
        records: list[Request] = []
        crashes: list[BaseException] = []
        # daemon: a user stuck past every limit must not keep the process alive (the caller reports it)
        threads = [threading.Thread(target=_user, args=(u, c, texts, options, progress, records, crashes, t0),
                                    daemon=True, name=f"load-user-{u}") for u, c in enumerate(clients)]
        run_start = time.monotonic()
        for t in threads:
            t.start()
        # every request ends within timeout_s (+ the cancel) and none starts after the deadline
        limit = deadline + options.timeout_s + options.busy_backoff_s + options.think_s + CANCEL_GRACE_S
        for t in threads:
            t.join(timeout=max(0.0, limit - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        run_s = time.monotonic() - run_start
        if crashes:
            raise RuntimeError(f"{len(crashes)} user thread(s) failed; the first: {crashes[0]!r}") from crashes[0]
        if pid is not None and (not progress.samples or progress.samples[-1]["finished"] != progress.finished):
            progress.samples.append({"finished": progress.finished, **progress.tally,
                                     "t_s": round(time.monotonic() - t0, 2), "after": "the end of the run", **sample()})
    finally:
        for c in clients:
            c.close()
    samples += progress.samples
    rusage_end = resource.getrusage(resource.RUSAGE_SELF)
    records.sort(key=lambda r: r.index)
    return collect(url, options, pid, pairs, warmup, records, samples, stuck, run_s, progress.sent,
                   env, cpu_s(rusage_end) - cpu_s(rusage_start))


def baseline(options: LoadOptions, results: dict, log: Callable[[str], None]) -> list[dict]:
    """The served backend's offline throughput at each baseline batch size on the run's sentences,
    and the run's share of each."""
    from .load_baseline import offline_throughput

    served, decodings = results["served"]["backends"], results["served"]["decodings"]
    if len(served) != 1 or len(decodings) != 1:
        raise RuntimeError(f"the translate answers named backends {served} and decodings {decodings}; the "
                           "baseline needs exactly one of each")
    texts = [p.en for p in default_sample(options.requests, options.tsv, options.seed)]
    sizes = ", ".join(map(str, options.baseline_batches))
    log(f"offline baseline: {served[0]} at batch {sizes}, {options.baseline_rounds} alternating rounds over "
        f"{len(texts)} sentences ...")
    d = decodings[0]
    out = offline_throughput(options.baseline_export, served[0], texts, batch_sizes=options.baseline_batches,
                             rounds=options.baseline_rounds, threads=options.threads,
                             num_beams=d["num_beams"], max_new_tokens=d["max_new_tokens"])
    rate = results["throughput_ok_per_s"]
    for b in out:
        b["load_over_offline"] = round(rate / b["sentences_per_s"], 3) if rate else None
    return out


def run(options: LoadOptions, out: Path, log: Callable[[str], None] = print) -> dict:
    """Attach to options.url or launch the app, drive it, stop what was launched, write the files."""
    from . import load_app, load_report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    app = None
    if options.launch_args is not None:
        log(f"starting app.py {' '.join(options.launch_args)} (log: {out / 'app.log'})")
        app = load_app.launch(list(options.launch_args), out / "app.log", options.start_timeout_s)
        log(f"app serving {app.url} after {app.ready_s:.1f} s (pid {app.proc.pid})")
    try:
        url = app.url if app else options.url
        pid = app.proc.pid if app else options.pid
        results = drive(url, options, pid, log)
    finally:
        stopped = load_app.stop(app) if app else None
    if app:
        results["launched"] = {"command": app.command[1:], "ready_s": round(app.ready_s, 1), "stop": stopped,
                               "log": str(app.log)}
    if options.baseline_export is not None:
        results["baseline"] = baseline(options, results, log)
    load_report.write(results, out)
    return results
