"""A runtime's results over several rounds, merged into one, and the line each result logs."""

from __future__ import annotations

import json

import numpy as np


def log_result(name: str, r: dict, log) -> None:
    lat = r["latency"]
    thr = " ".join(f"b{b} {t['sentences_per_s']:.2f} sent/s" for b, t in r["throughput"].items())
    log(f"{name}: load {r['load_s']:.2f} s; batch 1 p50 {lat['p50']:.1f} ms p90 {lat['p90']:.1f} p99 {lat['p99']:.1f} "
        f"({lat['ms_per_token_p50']:.2f} ms/token); {thr}; peak RSS {r['peak_rss_mb']:.0f} MB")


def merge_rounds(rounds: list[dict]) -> dict:
    """One runtime's results over several rounds -> the first round's result with every timing
    replaced by its median over the rounds, peak RSS by its maximum, and the per-round figures
    kept under `rounds` so the spread is on record."""
    if len(rounds) == 1:
        return rounds[0]
    merged = json.loads(json.dumps(rounds[0]))  # a deep copy: outputs, info and the sweep of round 1
    med = lambda values: float(np.median(values))  # noqa: E731
    merged["load_s"] = med([r["load_s"] for r in rounds])
    merged["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rounds)
    for key, value in rounds[0]["latency"].items():
        if isinstance(value, (int, float)) and key not in ("n", "hit_cap", "tokens_mean"):
            merged["latency"][key] = med([r["latency"][key] for r in rounds])
    for batch, first in rounds[0]["throughput"].items():
        seconds = med([r["throughput"][batch]["seconds"] for r in rounds])
        merged["throughput"][batch]["seconds"] = seconds
        merged["throughput"][batch]["sentences_per_s"] = first["sentences"] / seconds
        merged["throughput"][batch]["tokens_per_s"] = first["generated_tokens"] / seconds
        if "engine_seconds" in first:
            merged["throughput"][batch]["engine_seconds"] = med([r["throughput"][batch]["engine_seconds"] for r in rounds])
    merged["rounds"] = [
        {"b1_p50_ms": r["latency"]["p50"], **{f"b{b}_sent_per_s": t["sentences_per_s"] for b, t in r["throughput"].items()},
         **({"ms_per_token_p50": r["latency"].get("ms_per_token_p50"),
             "engine_ms_per_token_p50": r["latency"].get("engine_ms_per_token_p50"),
             "floor_beside": r["floor_beside"]} if "floor_beside" in r else {})}
        for r in rounds
    ]
    return merged
