"""Concurrent requests collected into batches for one decoder thread.

The app's `translate` endpoint is called concurrently (one Gradio worker per request); each call
hands its request to a `Batcher` and blocks until its own answer is back. One decoder thread takes
the waiting requests as one batch: when as many are waiting as were in flight at once since it took
the previous batch (so a closed loop of 16 users is decoded 16 at a time), or when `max_wait_ms`
has passed since the decoder was free with a request waiting, whichever is first; never more than
`max_requests` at once. The batch goes through one call of the decode function, whose answers go
back one per request, in order.

Why not Gradio's own batching (`batch=True`): its queue hands over whatever is waiting at the
instant a worker frees, so a closed loop of users split into a large batch and the stragglers that
answered a moment late, and the stragglers' small batch then held the next large one back.

A decode function that raises, or returns the wrong number of answers, fails every request of
that batch with the same error, raised in each caller; the decoder thread goes on with the next
batch. Per-request refusals are the decode function's answers, not exceptions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

logger = logging.getLogger("service.batcher")

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class BatchPolicy:
    """How the batcher forms a batch; validated once here."""

    # Most requests one decode takes.
    max_requests: int
    # How long the decoder, once free, waits for more requests while fewer are waiting than recently
    # were in flight: the latency one request may give up so that others join its batch.
    max_wait_ms: float = 100.0

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.max_wait_ms, bool) or not isinstance(self.max_wait_ms, (int, float)) \
                or not 0 <= self.max_wait_ms <= 10_000:
            problems.append(f"batch wait must be a number of milliseconds from 0 to 10000, got {self.max_wait_ms!r}")
        if isinstance(self.max_requests, bool) or not isinstance(self.max_requests, int) or self.max_requests < 1:
            problems.append(f"max requests per batch must be a whole number of at least 1, got {self.max_requests!r}")
        if problems:
            raise ValueError("; ".join(problems))


class BatchFailed(RuntimeError):
    """The decode of the batch a request was part of failed; every request of that batch gets it."""


class _Slot(Generic[T, R]):
    """One waiting request: its item, then its answer or the batch's failure."""

    __slots__ = ("item", "answer", "error", "done")

    def __init__(self, item: T) -> None:
        self.item = item
        self.answer: R | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()


class Batcher(Generic[T, R]):
    """`submit(item)` from any number of threads; `decode(items)` runs on one thread of its own,
    started by the first submit, and must return one answer per item, in order. `after_batch`, if
    given, runs on that thread once a batch's answers are handed out (housekeeping such as
    returning freed memory, kept off the answers' path)."""

    def __init__(self, decode: Callable[[list[T]], Sequence[R]], policy: BatchPolicy, name: str = "batcher",
                 after_batch: Callable[[], object] | None = None) -> None:
        self._decode = decode
        self._after_batch = after_batch
        self.policy = policy
        self._name = name
        self._cond = threading.Condition()
        self._pending: list[_Slot] = []
        self._in_flight = 0  # submitted and not yet answered: waiting or being decoded
        self._peak = 0  # most requests in flight at once since the previous batch was taken
        self._thread: threading.Thread | None = None
        self._closed = False
        self._failure: BaseException | None = None  # what ended the decoder thread, if anything did

    def submit(self, item: T) -> R:
        """`item`'s answer, once the batch it joins is decoded; raises BatchFailed when that decode failed."""
        slot: _Slot = _Slot(item)
        with self._cond:
            if self._closed:
                why = f": its decoder thread failed: {type(self._failure).__name__}: {self._failure}" \
                    if self._failure is not None else ""
                raise RuntimeError(f"{self._name} is closed{why}")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._pending.append(slot)
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
            self._cond.notify_all()
        try:
            slot.done.wait()
        finally:
            with self._cond:
                self._in_flight -= 1
        if slot.error is not None:
            raise slot.error
        return slot.answer

    def close(self) -> None:
        """Stop the decoder thread once the requests already waiting are answered."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _take(self) -> list[_Slot] | None:
        """The next batch, once it is due; None when closed with nothing waiting."""
        policy = self.policy
        with self._cond:
            while not self._pending:
                if self._closed:
                    return None
                self._cond.wait()
            # Counted from now, not from the first arrival: requests that waited through the previous
            # decode would otherwise go at once, alone, ahead of that decode's users coming back.
            deadline = time.monotonic() + policy.max_wait_ms / 1000
            while not self._closed:
                wanted = min(policy.max_requests, self._peak)
                left = deadline - time.monotonic()
                if len(self._pending) >= wanted or left <= 0:
                    break
                self._cond.wait(left)
            batch = self._pending[:policy.max_requests]
            del self._pending[:policy.max_requests]
            self._peak = self._in_flight
            return batch

    def _run(self) -> None:
        current: list[_Slot] = []
        try:
            while (batch := self._take()) is not None:
                current = batch
                self._answer(batch)
                current = []
                if self._after_batch is not None:
                    self._after_batch()
        except BaseException as e:  # kept for the callers that come later, then raised as usual
            self._failure = e
            raise
        finally:  # a decoder thread that ends for any reason leaves no caller waiting
            with self._cond:
                left, self._pending = current + self._pending, []
                self._closed = True
            for slot in left:
                if not slot.done.is_set():
                    why = f": {type(self._failure).__name__}: {self._failure}" if self._failure is not None else ""
                    slot.error = RuntimeError(f"{self._name} stopped before this request was decoded{why}")
                    slot.done.set()

    def _answer(self, batch: list[_Slot]) -> None:
        try:
            answers = list(self._decode([s.item for s in batch]))
            if len(answers) != len(batch):
                raise ValueError(f"the decode returned {len(answers)} answers for {len(batch)} requests")
        except Exception as e:  # every caller of this batch raises it; the next batch still runs
            logger.exception("a batch of %d failed", len(batch))
            error = BatchFailed(f"the batch of {len(batch)} requests this one was part of failed: "
                                f"{type(e).__name__}: {e}")
            error.__cause__ = e
            for slot in batch:
                slot.error = error
                slot.done.set()
            return
        for slot, answer in zip(batch, answers):
            slot.answer = answer
            slot.done.set()
