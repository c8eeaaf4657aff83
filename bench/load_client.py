"""One load-test user of a Gradio app's queued endpoint, speaking the queue's HTTP protocol itself.

This is what the browser's client does: POST the call to `queue/join`, read its messages from the
`queue/data` event stream as they arrive, and keep one connection open between requests.
gradio_client reads the same stream, but hands each message to the caller through a list it polls
every 50 ms and opens a new connection for every call; in a closed loop where a batch starts once
its last user is back, that polling lag is paid on every batch, so the load test would be measuring
the client.

Each call ends as its answer, or raises `QueueFull` (HTTP 503: the queue is full), `AppError` (the
app raised, or its stream ended with an error) or `TimeoutError` (the call is then cancelled on the
server, as gradio_client's `Job.cancel` does).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urljoin

import httpx


class QueueFull(Exception):
    """The app's queue was full (HTTP 503)."""


class AppError(Exception):
    """The app answered the call with an error, or its stream broke off."""


@dataclass
class Answer:
    """A call's output and when its messages arrived, in seconds after the call was sent."""

    output: object
    process_starts_s: float | None
    completed_s: float
    rank_on_join: int | None


class QueueClient:
    """One user: its own session on the app and one keep-alive connection."""

    def __init__(self, url: str, api_name: str, *, ssl_verify: bool):
        self._http = httpx.Client(verify=ssl_verify, timeout=httpx.Timeout(30.0),
                                  limits=httpx.Limits(max_connections=2, max_keepalive_connections=2))
        root = url if url.endswith("/") else url + "/"
        config = self._http.get(urljoin(root, "config"))
        config.raise_for_status()
        config = config.json()
        prefix = config.get("api_prefix", "/gradio_api").strip("/") + "/"
        self._api = urljoin(root, prefix)
        names = [d.get("api_name") for d in config["dependencies"]]
        if api_name not in names:
            raise ValueError(f"the app at {url} has no endpoint {api_name!r}; it has "
                             f"{', '.join(sorted(n for n in names if n))}")
        dependency = config["dependencies"][names.index(api_name)]
        self._fn_index = dependency.get("id", names.index(api_name))
        self._session = uuid.uuid4().hex[:11]

    def call(self, data: list, timeout_s: float) -> Answer:
        start = time.perf_counter()
        joined = self._http.post(self._api + "queue/join", json={
            "data": data, "fn_index": self._fn_index, "session_hash": self._session,
            "event_data": None, "trigger_id": None})
        if joined.status_code == 503:
            raise QueueFull("Queue is full! Please try again.")
        if joined.status_code != 200:
            raise AppError(f"queue/join answered HTTP {joined.status_code}: {joined.text[:300]}")
        event_id = joined.json()["event_id"]
        deadline = start + timeout_s
        started = rank = None
        try:
            left = max(0.01, deadline - time.perf_counter())
            with self._http.stream("GET", self._api + "queue/data", params={"session_hash": self._session},
                                   timeout=httpx.Timeout(left)) as stream:
                for message in _messages(stream, deadline):
                    if message.get("event_id") not in (None, event_id):
                        continue
                    kind = message["msg"]
                    if kind == "estimation" and rank is None:
                        rank = message.get("rank")
                    elif kind == "process_starts":
                        started = time.perf_counter() - start
                    elif kind == "process_completed":
                        done = time.perf_counter() - start
                        output = message.get("output") or {}
                        if not message.get("success"):
                            raise AppError(str(output.get("error") or output)[:500])
                        return Answer(output["data"][0], started, done, rank)
                    elif kind == "unexpected_error":
                        raise AppError(message.get("message") or "unexpected error")
        except httpx.TimeoutException:
            pass
        if time.perf_counter() < deadline:
            raise AppError("the app's event stream ended before the answer")
        self._cancel(event_id)
        raise TimeoutError(f"no final answer in {timeout_s:g} s")

    def _cancel(self, event_id: str) -> None:
        r = self._http.post(self._api + "cancel", json={
            "session_hash": self._session, "fn_index": self._fn_index, "event_id": event_id})
        r.raise_for_status()

    def close(self) -> None:
        self._http.close()


def _messages(stream: httpx.Response, deadline: float):
    """The event stream's JSON messages until it closes or the deadline passes."""
    if stream.status_code != 200:
        raise AppError(f"queue/data answered HTTP {stream.status_code}")
    for line in stream.iter_lines():
        if time.perf_counter() >= deadline:
            return
        if not line.startswith("data:"):
            continue
        message = json.loads(line[5:])
        if message["msg"] == "close_stream":
            return
        if message["msg"] != "heartbeat":
            yield message
