"""The machine and software a measurement ran on: recorded beside every benchmark and spot-check result."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # its git commit is recorded
VERSIONED = ("numpy", "onnxruntime", "torch", "transformers", "sentencepiece", "sacrebleu", "onnx")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def version(package: str) -> str | None:
    """The installed version of `package`, None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")


def environment(threads: int) -> dict:
    """CPU, cores, threads, exact versions, date and load: printed beside every result."""
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "threads": threads,
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: v for p in VERSIONED if (v := version(p))},
        "git": _git(),
        # the decoding loop's scoring passes: compiled here, or numpy and why (backends/native.py)
        "scoring": _scoring(),
    }


def _scoring() -> str:
    from backends import native

    return native.describe()
