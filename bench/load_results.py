"""A load run's results: the outcome counts, latency percentiles, memory and CPU of one `drive`.

Plain data for results.json; `bench/load_report.py` renders it.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from service.environment import version

PERCENTILES = (50, 95, 99)
OUTCOMES = ("ok", "busy", "error")

WHAT_IS_TIMED = (
    "End to end: time.perf_counter in the user's thread from `Client.submit` to the final result (the "
    "last streamed update), so it includes the client's HTTP join, waiting in the app's queue, the "
    "server's work and the streamed updates. Queue wait: submit to the app's `process_starts` message; "
    "service: `process_starts` to `process_completed` (both stamped on arrival by gradio_client's worker, "
    "which polls every 50 ms). Compute: the sum of every backend's own translate timings from the "
    "returned JSON. Percentiles are over ok requests only (numpy linear interpolation); busy rejections "
    "and errors are counted apart. Warm-up requests are not counted."
)
NOT_MEASURED = (
    "browser rendering and the page's own events (the UI path renders HTML and plots per update; only "
    "the API is driven), network latency (client and app on one machine, sharing its cores), "
    "inputs other than 10-40-word dev sentences, and queue sizes other than the app's"
)



def summary(values: list[float]) -> dict | None:
    """n, p50/p95/p99 (numpy linear interpolation), mean, min, max; None when there are none."""
    a = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    if a.size == 0:
        return None
    out = {"n": int(a.size)}
    out.update({f"p{p}": round(float(np.percentile(a, p)), 1) for p in PERCENTILES})
    out.update(mean=round(float(a.mean()), 1), min=round(float(a.min()), 1), max=round(float(a.max()), 1))
    return out


def memory_change(samples: list[dict], every: int) -> dict | None:
    """RSS at the last checkpoint against the first (after `every` requests), in MB and %."""
    points = [s for s in samples if "rss_mb" in s and s["finished"] >= every]
    if len(points) < 2:
        return None
    first, last = points[0], points[-1]
    return {"from_finished": first["finished"], "from_mb": first["rss_mb"], "to_finished": last["finished"],
            "to_mb": last["rss_mb"], "change_mb": round(last["rss_mb"] - first["rss_mb"], 1),
            "change_pct": round(100 * (last["rss_mb"] - first["rss_mb"]) / first["rss_mb"], 2)}


def cpu_s(r) -> float:
    return r.ru_utime + r.ru_stime


def collect(url, options, pid, pairs, warmup, records, samples, stuck, run_s, sent, env, client_cpu_s) -> dict:
    """results.json of one `drive`: its requests (`records`, `warmup`), memory `samples` and clocks."""
    ok = [r for r in records if r.outcome == "ok"]
    counts = {o: sum(r.outcome == o for r in records) for o in OUTCOMES}
    kinds: dict[str, int] = {}
    for r in records:
        if r.outcome == "error":
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
    overhead = [r.service_ms - r.compute_ms for r in ok if r.service_ms is not None]
    app_cpu = None
    if pid is not None and len(samples) >= 2 and "cpu_s" in samples[0] and "cpu_s" in samples[-1]:
        app_cpu = round(samples[-1]["cpu_s"] - samples[0]["cpu_s"], 1)
    env.pop("threads")  # the app's threads are its own flag; the load generator has one per user
    env["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    env["versions"].update({p: v for p in ("gradio", "gradio_client", "psutil") if (v := version(p))})
    return {
        "kind": "load",
        "url": url,
        "pid": pid,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()},
        "environment": env,
        "sentences": {"tsv": str(options.tsv), "seed": options.seed, "distinct": len(pairs),
                      "drawn": "10-40 English words (corpus.default_sample); request i sends sentence "
                               "i mod distinct"},
        "target": options.target,
        # with a duration, `requests` is only a cap: what was not sent when the time was up is not missing
        "counts": {"requests": sent if options.duration_s else options.requests, "sent": sent,
                   "not_sent": 0 if options.duration_s else options.requests - sent,
                   "finished": len(records), **counts, "error_kinds": kinds,
                   "unfinished_users": stuck},
        "rates": {"error_rate": _rate(counts["error"], len(records)), "busy_rate": _rate(counts["busy"], len(records))},
        "busy_messages": sorted({r.message for r in records if r.outcome == "busy"}),
        "error_examples": [asdict(r) for r in records if r.outcome == "error"][:10],
        "open_loop": None if options.rate is None else {
            "rate_per_s": options.rate, "arrivals": options.arrivals, "connections": options.users,
            "offered_per_s": round(sent / run_s, 3) if run_s > 0 else None,
            "late_ms": summary([r.late_ms for r in records if r.late_ms is not None]),
            "sent_late": sum(1 for r in records if (r.late_ms or 0) > 0)},
        "run_s": round(run_s, 2),
        "throughput_ok_per_s": round(len(ok) / run_s, 3) if run_s > 0 else None,
        "latency_ms": {
            "end_to_end": summary([r.end_to_end_ms for r in ok]),
            "queue_wait": summary([r.queue_wait_ms for r in ok]),
            "service": summary([r.service_ms for r in ok]),
            "compute": summary([r.compute_ms for r in ok]),
            "service_minus_compute": summary(overhead),
            "busy_answer": summary([r.end_to_end_ms for r in records if r.outcome == "busy"]),
        },
        "queue_rank_on_join": summary([r.rank_on_join for r in ok]),
        "output_tokens": summary([r.tokens for r in ok]),
        "decoded_together": summary([r.decoded_together for r in ok]),
        "batch_sizes": batch_sizes(ok),
        "decoder_busy_share": decoder_busy_share(ok, run_s),
        "served": {"backends": sorted({r.backend for r in ok if r.backend}),
                   "decodings": [dict(d) for d in {tuple(sorted(r.decoding.items())) for r in ok if r.decoding}]},
        "capped": {name: n for name in sorted({c for r in ok for c in r.capped})
                   if (n := sum(name in r.capped for r in ok))},
        "cpu_s": {"app": app_cpu, "load_generator": round(client_cpu_s, 1), "run_s": round(run_s, 1)},
        "memory": {"samples": samples, "every": options.rss_every, "change": memory_change(samples, options.rss_every)},
        "warmup": [asdict(r) for r in warmup],
        "requests": [asdict(r) for r in records],
        "what_is_timed": WHAT_IS_TIMED,
        "not_measured": NOT_MEASURED,
    }


def batch_sizes(ok) -> dict[int, int] | None:
    """translate: batch size -> the ok requests decoded in a batch of that size (divide by the size
    for batches; a batch cut by the run's start or end counts only its requests inside it)."""
    sizes = [r.decoded_together for r in ok if r.decoded_together is not None]
    return {size: sizes.count(size) for size in sorted(set(sizes))} or None


def decoder_busy_share(ok, run_s: float) -> float | None:
    """translate: the share of the run the decoder spent decoding, from each ok request's share of
    its batch's decode time (its decode wall time over its batch size)."""
    shares = [r.compute_ms / r.decoded_together for r in ok if r.decoded_together and r.compute_ms is not None]
    return round(sum(shares) / 1000 / run_s, 3) if shares and run_s > 0 else None


def _rate(n: int, of: int) -> float | None:
    return round(n / of, 4) if of else None
