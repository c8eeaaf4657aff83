"""This process's resident memory: now, its peak, and restarting the peak.

Stdlib only, below every layer: the exporter, the app's quick run and the benchmark's workers
each report the memory of their own process with it.
"""

from __future__ import annotations

import os
import resource


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
