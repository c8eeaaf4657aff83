"""Keep a long-running server's C heap from creeping up, request after request.

Two glibc behaviours do it:

- Freed blocks stay in the heap for reuse, so one long request (a 256-token output, a long text)
  leaves resident memory at its high-water mark. `trim_heap()` (malloc_trim) after each request
  returns the free part; it costs a few milliseconds and changes nothing still in use. A server
  that answers several batches a second trims through `HeapTrimmer`, at most once a second:
  malloc_trim holds the heap's lock while it walks it, and the request threads wait on it.
- Each new thread that allocates gets an arena of its own, up to 8 per core. Gradio runs each
  step of a streaming endpoint on whichever worker thread is free, so a request's tensors land in
  a different arena each time, and each arena keeps its own fragments: an in-process replay of the
  load test reached 16 arenas and went 681 -> 1,244 MB in 120 requests (661 -> 884 MB, flat from
  request 60, with two). `limit_arenas()` caps
  them (mallopt M_ARENA_MAX, what MALLOC_ARENA_MAX=2 does), which must happen before the threads
  start allocating: the app calls it first thing.
"""

from __future__ import annotations

import time

from runtime.memory import glibc

_M_ARENA_MAX = -8  # <malloc.h>
ARENAS = 2  # the main arena plus one that every other thread shares


def trim_heap() -> bool:
    """Trim where the C library can (glibc): True; False elsewhere (musl, macOS), nothing done."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)  # 1 if pages went back, 0 if none were free: both fine
    return True


class HeapTrimmer:
    """`trim_heap()` when called, unless it already ran within the last `min_interval_s` seconds."""

    def __init__(self, min_interval_s: float = 1.0, clock=time.monotonic):
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be a number of seconds >= 0, got {min_interval_s!r}")
        self.min_interval_s, self._clock = min_interval_s, clock
        self._last: float | None = None

    def __call__(self) -> bool:
        """True when it trimmed now."""
        now = self._clock()
        if self._last is not None and now - self._last < self.min_interval_s:
            return False
        self._last = now
        return trim_heap()


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas for this process: True if set; False where there is no glibc."""
    if arenas < 1:
        raise ValueError(f"arenas must be at least 1, got {arenas}")
    libc = glibc()
    if libc is None:
        return False
    if libc.mallopt(_M_ARENA_MAX, arenas) != 1:
        raise OSError(f"mallopt(M_ARENA_MAX, {arenas}) failed")
    return True
