"""service/batcher.py with a fake decode function: who is batched with whom, and what each caller gets."""

from __future__ import annotations

import threading
import time

import pytest

from service.batcher import BatchFailed, Batcher, BatchPolicy


class FakeDecode:
    """Records each batch; answers item -> item * 10, refuses negative items, raises on "boom"."""

    def __init__(self, hold: threading.Event | None = None, seconds: float = 0.0):
        self.batches: list[list] = []
        self.hold = hold
        self.seconds = seconds
        self.started = threading.Event()

    def __call__(self, items: list) -> list:
        self.batches.append(list(items))
        self.started.set()
        if self.hold is not None:
            assert self.hold.wait(10), "the test never released the decode"
        if self.seconds:
            time.sleep(self.seconds)
        if "boom" in items:
            raise RuntimeError("the engine broke")
        return [{"error": f"refused {i}"} if i < 0 else {"answer": i * 10} for i in items]


def submit_all(batcher: Batcher, items: list, stagger_s: float = 0.0) -> dict:
    """Each item from its own thread; returns item -> its answer or the exception it raised."""
    out: dict = {}

    def one(item):
        try:
            out[item] = batcher.submit(item)
        except Exception as e:  # what the caller raised is what the test checks
            out[item] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in items]
    for t in threads:
        t.start()
        if stagger_s:
            time.sleep(stagger_s)
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a caller never got its answer"
    return out


@pytest.fixture
def make():
    made = []

    def _make(decode, wait_ms=100.0, max_requests=32):
        b = Batcher(decode, BatchPolicy(max_requests, max_wait_ms=wait_ms))
        made.append(b)
        return b

    yield _make
    for b in made:
        b.close()


def test_a_lone_request_is_decoded_at_once(make):
    decode = FakeDecode()
    batcher = make(decode, wait_ms=5_000)
    start = time.monotonic()
    assert batcher.submit(3) == {"answer": 30}
    assert time.monotonic() - start < 1.0  # nothing else was in flight: no reason to wait
    assert decode.batches == [[3]]


def test_requests_waiting_through_a_decode_are_taken_together_each_with_its_own_answer(make):
    hold = threading.Event()
    decode = FakeDecode(hold)
    batcher = make(decode)
    first = threading.Thread(target=batcher.submit, args=(0,))
    first.start()
    assert decode.started.wait(5)
    waiting = threading.Thread(target=lambda: out.update(submit_all(batcher, [1, 2, 3, 4, 5])))
    out: dict = {}
    waiting.start()
    time.sleep(0.3)  # all five are waiting behind the held decode
    hold.set()
    waiting.join(10)
    first.join(10)
    assert decode.batches == [[0], sorted(decode.batches[1])] and sorted(decode.batches[1]) == [1, 2, 3, 4, 5]
    assert out == {i: {"answer": i * 10} for i in (1, 2, 3, 4, 5)}


def test_a_closed_loop_keeps_its_batches_whole(make):
    """8 users, each sending its next request as soon as its answer is back, with a little jitter:
    after the start every batch has all 8 (the batcher waits for as many as were in flight)."""
    decode = FakeDecode(seconds=0.02)
    batcher = make(decode, wait_ms=200)
    rounds = 8

    def user(u):
        for r in range(rounds):
            time.sleep(0.002 * ((u * 7 + r * 3) % 5))  # the answer's trip back, uneven across users
            assert batcher.submit(u * 100 + r) == {"answer": (u * 100 + r) * 10}

    threads = [threading.Thread(target=user, args=(u,)) for u in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    sizes = [len(b) for b in decode.batches]
    # The first batches go before every user's thread has submitted (on a busy machine threads start
    # late), so those users run a batch ahead and the last batches lack them; once all 8 are in
    # flight, every batch has all 8.
    assert sum(sizes) == 8 * rounds, sizes
    assert sizes[2:-2] == [8] * (len(sizes) - 4) and sizes.count(8) >= rounds - 3, sizes


def test_a_refused_request_gets_its_own_answer_and_its_batch_is_answered(make):
    hold = threading.Event()
    decode = FakeDecode(hold)
    batcher = make(decode)
    first = threading.Thread(target=batcher.submit, args=(0,))
    first.start()
    assert decode.started.wait(5)
    out: dict = {}
    waiting = threading.Thread(target=lambda: out.update(submit_all(batcher, [1, -2, 3])))
    waiting.start()
    time.sleep(0.3)
    hold.set()
    waiting.join(10)
    first.join(10)
    assert sorted(decode.batches[1]) == [-2, 1, 3]
    assert out == {1: {"answer": 10}, -2: {"error": "refused -2"}, 3: {"answer": 30}}


def test_a_failed_decode_reaches_every_caller_of_its_batch_and_the_next_batch_runs(make):
    hold = threading.Event()
    decode = FakeDecode(hold)
    batcher = make(decode)
    first = threading.Thread(target=batcher.submit, args=(0,))
    first.start()
    assert decode.started.wait(5)
    out: dict = {}
    waiting = threading.Thread(target=lambda: out.update(submit_all(batcher, [1, "boom", 2])))
    waiting.start()
    time.sleep(0.3)
    hold.set()
    waiting.join(10)
    first.join(10)
    assert len(decode.batches[1]) == 3
    for item in (1, "boom", 2):
        assert isinstance(out[item], BatchFailed), out
        assert str(out[item]) == ("the batch of 3 requests this one was part of failed: "
                                  "RuntimeError: the engine broke")
        assert isinstance(out[item].__cause__, RuntimeError)
    assert batcher.submit(7) == {"answer": 70}  # the decoder thread survived


def test_a_decode_that_returns_the_wrong_number_of_answers_fails_its_batch(make):
    batcher = make(lambda items: [])
    with pytest.raises(BatchFailed, match="returned 0 answers for 1 requests"):
        batcher.submit(1)


def test_the_wait_is_capped_and_counted_from_when_the_decoder_is_free(make):
    """Two were in flight, only one comes back: it goes alone after the wait, counted from the end of
    the decode it waited through (not from its arrival, long before), and not held longer."""
    hold = threading.Event()
    decode = FakeDecode(hold)
    batcher = make(decode, wait_ms=300)
    first = threading.Thread(target=batcher.submit, args=(1,))
    first.start()
    assert decode.started.wait(5)
    out: dict = {}
    second = threading.Thread(target=lambda: out.update(submit_all(batcher, [2])))
    second.start()
    time.sleep(0.4)  # longer than the wait: 2 arrived well before the decoder was free
    released = time.monotonic()
    hold.set()
    second.join(10)
    first.join(10)
    waited = time.monotonic() - released
    assert decode.batches == [[1], [2]] and out == {2: {"answer": 20}}
    assert 0.3 <= waited < 0.3 + 0.5, waited  # the wait, plus scheduling slack


def test_no_batch_is_larger_than_max_requests(make):
    hold = threading.Event()
    decode = FakeDecode(hold)
    batcher = make(decode, max_requests=4)
    first = threading.Thread(target=batcher.submit, args=(0,))
    first.start()
    assert decode.started.wait(5)
    out: dict = {}
    waiting = threading.Thread(target=lambda: out.update(submit_all(batcher, list(range(1, 11)))))
    waiting.start()
    time.sleep(0.3)
    hold.set()
    waiting.join(10)
    first.join(10)
    assert [len(b) for b in decode.batches] == [1, 4, 4, 2]
    assert out == {i: {"answer": i * 10} for i in range(1, 11)}


def test_after_batch_runs_once_the_answers_are_out(make):
    seen = []
    answered = threading.Event()

    def decode(items):
        return [i * 10 for i in items]

    def after():
        seen.append(answered.wait(5))  # the caller has its answer before the housekeeping runs

    batcher = make(decode)
    batcher._after_batch = after
    assert batcher.submit(1) == 10
    answered.set()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [True]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's failure is the point
def test_a_failing_after_batch_stops_the_batcher_and_says_why(make):
    def after():
        raise OSError("trim failed")

    batcher = Batcher(lambda items: [i * 10 for i in items], BatchPolicy(4), after_batch=after)
    assert batcher.submit(1) == 10  # the answer is out before the housekeeping fails
    batcher._thread.join(5)
    with pytest.raises(RuntimeError, match="closed: its decoder thread failed: OSError: trim failed"):
        batcher.submit(2)


def test_close_answers_what_is_waiting_then_refuses_new_requests(make):
    decode = FakeDecode()
    batcher = make(decode)
    assert batcher.submit(1) == {"answer": 10}
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(2)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(max_requests=0), "max requests per batch must be a whole number of at least 1, got 0"),
        (dict(max_requests=2.5), "got 2.5"),
        (dict(max_requests=4, max_wait_ms=-1), "batch wait must be a number of milliseconds from 0 to 10000, got -1"),
        (dict(max_requests=4, max_wait_ms=float("nan")), "got nan"),
        (dict(max_requests=4, max_wait_ms=True), "got True"),
    ],
)
def test_policy_refuses_what_cannot_run(fields, message):
    with pytest.raises(ValueError, match=message):
        BatchPolicy(**fields)
