"""python -m service.serve EXPORT --backend NAME --replicas N: the `translate` API as a Ray Serve deployment.

Each replica is one Ray actor process that loads the export once, with its own ONNX Runtime
session (`--threads` intra-op threads, and as many Ray CPUs reserved for it). Requests waiting at
a replica are gathered by `@serve.batch` (up to `--max-batch-size`, waiting at most
`--batch-wait-s` for more) and decoded by `service.translate.translate_batch`, the app's own
batched request, so every answer is the one the app's `translate` API gives, with the app's HTTP
contract (`service/http_api.py`), plus Ray Serve's own answers:

    POST /translate  {"text": "...", "num_beams": null|1..8, "backend": null|NAME}
    200  the answer JSON (`TranslateAnswer.to_json`); header x-serve-node: the Ray node that answered
    422  the request is refused (empty, too long, unknown backend, ...): the same JSON, `error` says why
    400  the body is not a JSON object with a string `text` and known fields only: {"error": ...}
    500  the decode failed, or the replica died with the request in it (Ray Serve's own answer)
    408  no answer within `--request-timeout-s` (Ray Serve's proxy)
    503  more requests waiting than `--max-queued` (Ray Serve's proxy): try again

Ray Serve checks each replica with `check_health` (one short decode through the session) every
`ServeOptions.health_period_s`; a replica that fails it or dies is replaced by the controller. A request in
flight at a dying replica is answered with an error status, never left waiting. SIGTERM or
SIGINT shuts the application and (when this process started it) the Ray runtime down.

`--address` joins a running cluster and ships the repository's code as the job's working
directory; the export itself is not shipped: it must be readable at the same path on every node.

Only this module of the request layer imports ray, inside the functions that need it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends import BACKEND_NAMES

from .http_api import ROUTE, parse_request, status_for
from .limits import RequestLimits
from .translate import MAX_REQUESTS

logger = logging.getLogger("service.serve")

APP_NAME = "translate"
DEPLOYMENT = "Translator"
HEALTH_TEXT = "Hello."
REPO = Path(__file__).resolve().parents[1]
# What a node needs of the repository is its code (as the corpus engine ships it): the rest stays here.
CODE_EXCLUDES = [".git", ".venv", ".venv-bench", "exports", "runs", "bench-results", "test-artifacts", "data",
                 "assets", "docs", "*.onnx", "*.safetensors", "*.tsv.gz", "*.parquet"]


@dataclass(frozen=True)
class ServeOptions:
    """What to serve and how; validated once here."""

    export: Path
    backend: str  # one of BACKEND_NAMES: the one backend each replica loads
    replicas: int = 1  # each one a process with its own session
    threads: int = 1  # intra-op threads per replica, and the Ray CPUs it reserves
    host: str = "127.0.0.1"  # 0.0.0.0 to be reached from other machines
    port: int = 8000
    max_batch_size: int = MAX_REQUESTS  # requests one decode takes
    # How long a replica waits for more requests to fill a batch: while a decode holds the GIL the
    # requests behind it reach the replica's queue late, so a shorter wait decodes them one by one.
    batch_wait_s: float = 0.05
    max_ongoing: int = 64  # requests one replica holds at once (batched or waiting for the next batch)
    max_queued: int = 256  # requests waiting for a replica, per proxy; more are answered 503
    request_timeout_s: float = 120.0  # the proxy answers 408 past it
    health_period_s: float = 10.0
    health_timeout_s: float = 30.0
    address: str | None = None  # a running Ray cluster; None starts a local one
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_new_tokens: int | None = None  # the output cap; None: the model's (as the app's)

    def __post_init__(self):
        problems = []
        if self.backend not in BACKEND_NAMES:
            problems.append(f"unknown backend {self.backend!r}; expected one of: {', '.join(BACKEND_NAMES)}")
        for name in ("replicas", "threads", "max_batch_size", "max_ongoing", "max_queued"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                problems.append(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_ongoing < self.max_batch_size:
            problems.append(f"max_ongoing ({self.max_ongoing}) must be at least max_batch_size "
                            f"({self.max_batch_size}), or no batch could fill")
        if not 0 < self.port < 65536:
            problems.append(f"port must be in 1..65535, got {self.port}")
        if not self.batch_wait_s >= 0:
            problems.append(f"batch_wait_s must be 0 or more, got {self.batch_wait_s}")
        for name in ("request_timeout_s", "health_period_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if problems:
            raise ValueError("; ".join(problems))


class Translator:
    """One replica: the export loaded once, requests batched into `translate_batch`."""

    def __init__(self, options: ServeOptions):
        import ray

        from backends import SessionConfig, load_backends

        self.options = options
        self.backends = load_backends(options.export, (options.backend,), session=SessionConfig(threads=options.threads))
        self.node = ray.get_runtime_context().get_node_id()
        logger.info("replica on node %s loaded %s from %s", self.node, options.backend, options.export)

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        if request.url.path.rstrip("/") != ROUTE:
            return JSONResponse({"error": f"no such path {request.url.path!r}; POST {ROUTE}"}, status_code=404)
        if request.method != "POST":
            return JSONResponse({"error": f"{ROUTE} takes POST"}, status_code=405)
        try:
            fields = parse_request(await request.body())
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        answer = await self.translate(fields)
        return JSONResponse(answer.to_json(), status_code=status_for(answer), headers={"x-serve-node": self.node})

    async def translate(self, fields: dict[str, Any]):
        """One request's `TranslateAnswer`, decoded with whatever waits here with it."""
        return await self._batch(fields)

    async def _batch(self, requests: list[dict[str, Any]]):
        raise NotImplementedError("`application` gives the deployment its @serve.batch method")

    async def _decode(self, requests: list[dict[str, Any]]):
        from .translate import translate_batch

        # In a thread: the replica's event loop keeps taking requests for the next batch meanwhile.
        return await asyncio.to_thread(
            translate_batch, self.backends, [r["text"] for r in requests], [r["num_beams"] for r in requests],
            [r["backend"] for r in requests], default=self.options.backend, limits=self.options.limits,
            max_new_tokens=self.options.max_new_tokens,
        )

    async def check_health(self):
        """Raises unless the session decodes: Ray Serve then replaces this replica."""
        [t] = await asyncio.to_thread(self.backends[self.options.backend].translate, [HEALTH_TEXT],
                                      max_new_tokens=2, top_k=1, output_scores=False)
        if not t.token_ids:
            raise RuntimeError(f"the health check's decode of {HEALTH_TEXT!r} gave no tokens")


def _serve():
    """ray.serve, or an error that says what to install."""
    try:
        from ray import serve
    except ImportError as e:
        raise RuntimeError("serving on Ray Serve needs its packages: pip install -r requirements-serve.txt "
                           f"(ray[serve]==2.60.0 and what it brings), or make serve ({e})") from e
    return serve


def application(options: ServeOptions):
    """The Ray Serve application: `options.replicas` replicas of `Translator` behind the HTTP proxy."""
    serve = _serve()

    class Batched(Translator):
        @serve.batch(max_batch_size=options.max_batch_size, batch_wait_timeout_s=options.batch_wait_s)
        async def _batch(self, requests: list[dict[str, Any]]):
            return await self._decode(requests)

    deployment = serve.deployment(
        Batched, name=DEPLOYMENT, num_replicas=options.replicas, ray_actor_options={"num_cpus": options.threads},
        max_ongoing_requests=options.max_ongoing, max_queued_requests=options.max_queued,
        health_check_period_s=options.health_period_s, health_check_timeout_s=options.health_timeout_s,
    )
    return deployment.bind(options)


def start(options: ServeOptions) -> str:
    """Serve on the Ray runtime already connected (or a new local one); returns the endpoint's URL."""
    serve = _serve()
    import ray

    if not ray.is_initialized():
        if options.address is None:  # "local": a new instance, not a cluster this machine happens to run
            ray.init(address="local", include_dashboard=False)
        else:  # other machines need the code: the repository without its data, models and outputs
            ray.init(address=options.address, runtime_env={"working_dir": str(REPO), "excludes": CODE_EXCLUDES})
    serve.start(http_options={"host": options.host, "port": options.port,
                              "request_timeout_s": options.request_timeout_s})
    serve.run(application(options), name=APP_NAME, route_prefix="/", blocking=False)
    host = "127.0.0.1" if options.host in ("0.0.0.0", "::") else options.host
    return f"http://{host}:{options.port}{ROUTE}"


def replica_actors() -> list[str]:
    """The names of the deployment's live replica actors (namespace "serve")."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and f"#{DEPLOYMENT}#" in a["name"] and "REPLICA" in a["name"])


def running_replicas() -> int:
    """Replicas of the deployment that are up and passed their health checks (0 when it is not deployed)."""
    app = _serve().status().applications.get(APP_NAME)
    deployment = app.deployments.get(DEPLOYMENT) if app else None
    return deployment.replica_states.get("RUNNING", 0) if deployment else 0


def stop() -> None:
    """Delete the application, stop Serve and leave the Ray runtime."""
    serve = _serve()
    import ray

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="an export folder (python -m export), readable on every node")
    parser.add_argument("--backend", required=True, help=f"one of: {', '.join(BACKEND_NAMES)}")
    parser.add_argument("--replicas", type=int, default=1, help="replicas, each a process with its own session")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (and Ray CPUs) per replica")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to take requests from other machines")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=MAX_REQUESTS, help="requests one decode takes")
    parser.add_argument("--batch-wait-s", type=float, default=ServeOptions.batch_wait_s, help="seconds a replica waits to fill a batch")
    parser.add_argument("--max-queued", type=int, default=256, help="waiting requests before 503")
    parser.add_argument("--request-timeout-s", type=float, default=120.0, help="the proxy answers 408 past it")
    parser.add_argument("--address", help="a running Ray cluster (e.g. auto, or HOST:6379); default: start one here")
    parser.add_argument("--max-new-tokens", type=int, help="the output cap (default: the model's)")
    args = parser.parse_args(argv)
    try:
        _serve()
    except RuntimeError as e:
        parser.error(str(e))
    options = ServeOptions(
        export=args.export, backend=args.backend, replicas=args.replicas, threads=args.threads, host=args.host,
        port=args.port, max_batch_size=args.max_batch_size, batch_wait_s=args.batch_wait_s,
        max_ongoing=max(64, args.max_batch_size), max_queued=args.max_queued,
        request_timeout_s=args.request_timeout_s, address=args.address, max_new_tokens=args.max_new_tokens,
    )
    if not (options.export / "manifest.json").is_file():
        parser.error(f"{options.export} is not an export folder (no manifest.json); make one with python -m export")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    done = threading.Event()
    try:
        url = start(options)
        # After ray.init, which installs its own SIGTERM handler (it aborts the process).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: done.set())
        print(f"serving {options.replicas} replica(s) of {options.backend} at {url}", flush=True)
        done.wait()
        print("stopping", flush=True)
    finally:
        stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
