"""The app under load: start `app.py` and stop it, and read its resident memory and CPU time.

Only psutil and the standard library: the load benchmark drives the app over HTTP and never
imports it, so the memory it reads is the app's alone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .data import REPO

STOP_GRACE_S = 30  # after SIGINT: gradio closes its server and main() returns


@dataclass
class LaunchedApp:
    proc: subprocess.Popen
    url: str
    command: list[str]
    log: Path
    ready_s: float  # process start to the page answering 200: imports, export check, backend loads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(app_args: list[str], log: Path, start_timeout_s: float) -> LaunchedApp:
    """`python app.py APP_ARGS` on a free local port; returns once its page answers."""
    port = free_port()
    env = dict(os.environ, GRADIO_SERVER_PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1",
               GRADIO_ANALYTICS_ENABLED="False")
    command = [sys.executable, "app.py", *app_args]
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        # SIGINT back to the default in the child: a shell's background job ignores it, and the
        # child would inherit that and could not be stopped cleanly by `stop`.
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    app = LaunchedApp(proc, f"http://127.0.0.1:{port}/", command, log, ready_s=float("nan"))
    try:
        _wait_until_serving(app, start + start_timeout_s)
    except BaseException:
        stop(app)
        raise
    app.ready_s = time.monotonic() - start
    return app


def _wait_until_serving(app: LaunchedApp, deadline: float) -> None:
    while time.monotonic() < deadline:
        if app.proc.poll() is not None:
            raise RuntimeError(f"app.py exited with {app.proc.returncode} before serving; the end of {app.log}:\n"
                               + app.log.read_text(encoding="utf-8", errors="replace")[-3000:])
        try:
            with urllib.request.urlopen(app.url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:  # not listening yet: connection refused or reset while it starts
            time.sleep(1)
    raise TimeoutError(f"app.py did not serve {app.url} in time; the end of {app.log}:\n"
                       + app.log.read_text(encoding="utf-8", errors="replace")[-3000:])


def stop(app: LaunchedApp) -> dict:
    """SIGINT first (gradio closes its server, main() returns), then SIGTERM, then SIGKILL."""
    start = time.monotonic()
    for sig, grace in ((signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if app.proc.poll() is not None:
            break
        app.proc.send_signal(sig)
        try:
            app.proc.wait(timeout=grace)
            return {"signal": sig.name, "returncode": app.proc.returncode,
                    "seconds": round(time.monotonic() - start, 2)}
        except subprocess.TimeoutExpired:
            continue
    return {"signal": None, "returncode": app.proc.poll(), "seconds": round(time.monotonic() - start, 2),
            "note": "had already exited before the stop"}


def memory(pid: int) -> dict:
    """Resident memory of `pid` and all its descendants now (MB = 1e6 bytes), and its CPU seconds."""
    import psutil

    root = psutil.Process(pid)  # NoSuchProcess propagates: the caller records that the app is gone
    rss, cpu, count = root.memory_info().rss, sum(root.cpu_times()[:2]), 1
    for child in root.children(recursive=True):
        try:
            rss += child.memory_info().rss
            cpu += sum(child.cpu_times()[:2])
            count += 1
        except psutil.NoSuchProcess:  # exited between listing and reading: it holds no memory now
            continue
    return {"rss_mb": round(rss / 1e6, 1), "cpu_s": round(cpu, 2), "processes": count}
