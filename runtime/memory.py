"""This process's resident memory: now, its peak, and restarting the peak; and glibc's heap controls.

Stdlib only, below every layer: the exporter, the app's quick run and the benchmark's workers
each report the memory of their own process with it, and the exporter and the app
(`backends.memory`) reach glibc through `glibc()`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import resource
import threading
from contextlib import contextmanager


def rss_mb() -> float:
    """Resident memory of this process now, MB (1e6 bytes), from /proc."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def reset_peak_rss() -> bool:
    """Restart this process's high-water mark (VmHWM) at its current RSS; False where the kernel
    refuses. A worker calls it first, so its peak is its own runtime's and not its launcher's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """Peak resident memory of this process's own address space, MB: /proc's VmHWM.

    Not getrusage's ru_maxrss: Linux keeps it across fork and exec, so a worker started by a
    process that once held gigabytes (an export made in the benchmark's own process) reported the
    launcher's peak for every runtime. VmHWM belongs to the address space exec created, and
    reset_peak_rss() restarts it. ru_maxrss only where /proc is missing (not Linux: there it is the
    process's own)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # bytes on macOS


class PhasePeaks:
    """Peak RSS of each named phase inside one step, MB, sampled by a thread every `interval` s.

    Sampled rather than read from VmHWM, so the step around it keeps its own high-water mark; an
    allocation that lives for less than one interval can be missed, a gigabyte of weights cannot.
    Phases nest: a sample counts for every phase open at the time."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peaks: dict[str, float] = {}
        self._open: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        now = rss_mb()
        with self._lock:
            for name in self._open:
                self.peaks[name] = max(self.peaks.get(name, 0.0), now)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "PhasePeaks":
        self._thread = threading.Thread(target=self._loop, name="phase-peaks", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @contextmanager
    def phase(self, name: str):
        """Attribute the samples taken until the block ends to `name` (its start and end included)."""
        with self._lock:
            self._open.append(name)
        self._sample()
        try:
            yield
        finally:
            self._sample()
            with self._lock:
                self._open.remove(name)

    def rounded(self) -> dict[str, float]:
        return {name: round(mb, 1) for name, mb in self.peaks.items()}


@functools.cache
def glibc():
    """The C library through ctypes where it is glibc (it has `malloc_trim` and `mallopt`), else None
    (musl, macOS): the heap controls below, and the app's (`backends.memory`), are glibc's."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def release_freed_memory() -> bool:
    """Collect garbage, then hand the C heap's free pages back to the system (glibc's
    `malloc_trim`): after a model or a graph's weights are released, malloc keeps much of what it
    held on its free lists, resident, and every later peak counts it. False where there is no glibc."""
    gc.collect()
    libc = glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


_M_MMAP_THRESHOLD = -3  # <malloc.h>
# Blocks at least this large get pages of their own, unmapped when freed: an activation or a slice
# of weights, never the small objects that a mapping per block would slow down.
MMAP_THRESHOLD = 2**20


def map_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Give every C heap block of at least `threshold` bytes its own mapping, returned to the system
    the moment it is freed; False where there is no glibc. For a one-shot process that holds a
    model's weights and wants its peak near them (the export).

    glibc maps large blocks alone at first, but raises its threshold to the largest block freed
    (up to 32 MB), so after the first large tensor is freed the later ones come from the heap and
    stay resident once freed: a step that allocates its activations in a different order each time
    then peaks hundreds of MB above what it holds. A fixed threshold turns that adjustment off."""
    if threshold < 1:
        raise ValueError(f"threshold must be a positive number of bytes, got {threshold}")
    libc = glibc()
    return libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1
