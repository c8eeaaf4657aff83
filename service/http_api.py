"""The `translate` API over plain HTTP: one contract, served by the app and by `python -m service.serve`.

    POST /translate  {"text": "...", "num_beams": null|1..8, "backend": null|NAME}
    200  the answer JSON (`TranslateAnswer.to_json`)
    422  the request is refused (empty, too long, unknown backend, ...): the same JSON, `error` says why
    400  the body is not a JSON object with a string `text` and known fields only: {"error": ...}
    500  the decode this request was part of failed: the answer JSON, or {"error": ...}
    503  the server is full (more requests in flight than it takes): {"error": ...}; try again

The app serves it on its own web server (`AppTranslateRoute`, beside Gradio's queue API), into the
same batcher as its Gradio `translate` API: a request costs the server one JSON parse and one
response instead of Gradio's queue protocol (a join, an event stream and its status messages),
which on a small CPU is time the decoder waits for between batches.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

ROUTE = "/translate"
FIELDS = ("text", "num_beams", "backend")  # what the app's translate API takes, in its order


def parse_request(body: bytes) -> dict[str, Any]:
    """The request's fields from a POST body, or ValueError saying what is wrong (answered 400)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"the body is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object with fields {', '.join(FIELDS)}; got {type(data).__name__}")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; expected: {', '.join(FIELDS)}")
    if not isinstance(data.get("text"), str):
        raise ValueError(f"`text` must be a string, got {type(data.get('text')).__name__}")
    return {name: data.get(name) for name in FIELDS}


def status_for(answer) -> int:
    """The HTTP status of one `TranslateAnswer`."""
    if answer.error is None:
        return 200
    return 422 if answer.refused else 500


class AppTranslateRoute:
    """POST /translate on the app's web server: `submit((text, num_beams, backend))` blocks until the
    request's `TranslateAnswer`, on a thread of its own, at most `max_in_flight` at once; more are
    answered 503 at once."""

    def __init__(self, submit: Callable[[tuple], Any], max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        import anyio

        self._submit = submit
        self.max_in_flight = max_in_flight
        # A thread for every request let in: anyio's default pool would hold those past its 40 back.
        self._threads = anyio.CapacityLimiter(max_in_flight)
        self._lock = threading.Lock()
        self._in_flight = 0

    def mount(self, app) -> None:
        """Add the route to a FastAPI / Starlette app (the one Gradio's launch serves)."""
        app.add_route(ROUTE, self.handle, methods=["POST"])

    async def handle(self, request):
        import anyio
        from starlette.responses import JSONResponse

        try:
            fields = parse_request(await request.body())
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        with self._lock:
            if self._in_flight >= self.max_in_flight:
                return JSONResponse({"error": f"the server is full: {self._in_flight} requests in flight, it takes "
                                              f"{self.max_in_flight}; try again shortly"}, status_code=503)
            self._in_flight += 1
        try:
            answer = await anyio.to_thread.run_sync(
                self._submit, (fields["text"], fields["num_beams"], fields["backend"]), limiter=self._threads)
        except Exception as e:  # the batch failed (BatchFailed) or the batcher stopped: this request's answer
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
        finally:
            with self._lock:
                self._in_flight -= 1
        return JSONResponse(answer.to_json(), status_code=status_for(answer))
