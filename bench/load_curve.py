"""python -m bench load-curve: the translate endpoint's throughput and P99 as users grow, per backend.

One app (launched, or a running one at --url) serves every point: for each backend, for each
number of users, `bench.load.drive` runs that many closed-loop users for --duration seconds, each
request naming the backend. A point records sentences/s, P50/P95/P99 end to end, ok/busy/error
counts and the app's memory at its start and end. The points go to curve.json (read by the
Benchmark tab, `service.load_curve`) and curve.md.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from . import load as load_mod

DEFAULT_USERS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CurveOptions:
    """The sweep; each point's driving is a `bench.load.LoadOptions` with its users and backend."""

    backends: tuple[str, ...]
    users: tuple[int, ...] = DEFAULT_USERS
    duration_s: float = 30.0
    base: load_mod.LoadOptions | None = None  # url or launch args, timeouts, sentences

    def __post_init__(self):
        problems = []
        if not self.backends:
            problems.append("--backends must name at least one backend")
        if not self.users or any(u < 1 for u in self.users):
            problems.append(f"--users must be positive counts, got {','.join(map(str, self.users))}")
        if list(self.users) != sorted(set(self.users)):
            problems.append(f"--users must rise without repeats, got {','.join(map(str, self.users))}")
        if not self.duration_s > 0:
            problems.append(f"--duration must be positive, got {self.duration_s}")
        if self.base is None:
            problems.append("no app to drive: give --url or --launch")
        if problems:
            raise ValueError("; ".join(problems))


def point(results: dict, backend: str, users: int) -> dict:
    """One point of the curve from one `drive`'s results."""
    e2e = results["latency_ms"]["end_to_end"] or {}
    c = results["counts"]
    rss = [m["rss_mb"] for m in (results.get("memory") or {}).get("samples", []) if "rss_mb" in m]
    served = results["served"]["backends"]
    return {
        "backend": backend,
        "users": users,
        "served_by": served,
        "sentences_per_s": results["throughput_ok_per_s"],
        "p50_ms": e2e.get("p50"),
        "p95_ms": e2e.get("p95"),
        "p99_ms": e2e.get("p99"),
        "ok": c["ok"],
        "busy": c["busy"],
        "errors": c["error"],
        "error_kinds": c["error_kinds"],
        "decoded_together_mean": (results.get("decoded_together") or {}).get("mean"),
        "rss_mb_start": rss[0] if rss else None,
        "rss_mb_end": rss[-1] if rss else None,
        "run_s": results["run_s"],
    }


def sweep(options: CurveOptions, url: str, pid: int | None, log: Callable[[str], None] = print
          ) -> tuple[list[dict], dict]:
    """The points, and the first run's environment (machine, versions, load average)."""
    points, env = [], None
    for backend in options.backends:
        for users in options.users:
            o = replace(options.base, url=url, launch_args=None, pid=pid, users=users, target="translate",
                        backend=backend, duration_s=options.duration_s,
                        requests=max(options.base.requests, users), baseline_export=None)
            log(f"{backend}: {users} users for {options.duration_s:g} s ...")
            results = load_mod.drive(url, o, pid, log=lambda m: None)
            env = env or results["environment"]
            p = point(results, backend, users)
            if p["served_by"] not in ([backend], []):
                raise RuntimeError(f"requests named {backend} but were served by {p['served_by']}")
            log(f"  {p['sentences_per_s']} sentences/s, P50 {p['p50_ms']} ms, P99 {p['p99_ms']} ms, "
                f"{p['ok']} ok, {p['busy']} busy, {p['errors']} errors")
            points.append(p)
    return points, env


def run(options: CurveOptions, out: Path, log: Callable[[str], None] = print) -> dict:
    """Launch (or attach to) the app, sweep, stop what was launched, write curve.json and curve.md."""
    from . import load_app

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base, app = options.base, None
    if base.launch_args is not None:
        app = load_app.launch(list(base.launch_args), out / "app.log", base.start_timeout_s)
        log(f"app serving {app.url} after {app.ready_s:.1f} s (pid {app.proc.pid})")
    started = dt.datetime.now(dt.timezone.utc)
    try:
        points, env = sweep(options, app.url if app else base.url, app.proc.pid if app else base.pid, log)
    finally:
        if app:
            load_app.stop(app)
    curve = {
        "kind": "load_curve",
        "date_utc": started.strftime("%Y-%m-%d %H:%M"),
        "environment": env,
        "duration_s": options.duration_s,
        "method": (f"closed loop: N users, one sentence per request (10-40-word dev sentences), the next as soon "
                   f"as the answer is in, {options.duration_s:g} s per point after a warm-up, against the app's "
                   "translate endpoint; latency end to end in the client; P99 over ok requests"),
        "points": points,
    }
    (out / "curve.json").write_text(json.dumps(curve, indent=1), encoding="utf-8")
    (out / "curve.md").write_text(markdown(curve), encoding="utf-8")
    return curve


def markdown(curve: dict) -> str:
    rows = ["| backend | users | sentences/s | P50 ms | P95 ms | P99 ms | ok | busy | errors | RSS MB start → end |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for p in curve["points"]:
        rss = f"{p['rss_mb_start']} → {p['rss_mb_end']}" if p["rss_mb_start"] is not None else "–"
        rows.append(f"| {p['backend']} | {p['users']} | {p['sentences_per_s']} | {p['p50_ms']} | {p['p95_ms']} | "
                    f"{p['p99_ms']} | {p['ok']} | {p['busy']} | {p['errors']} | {rss} |")
    return f"Load curve, {curve['date_utc']} UTC: {curve['method']}.\n\n" + "\n".join(rows) + "\n"
