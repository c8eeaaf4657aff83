"""Summaries of repeated timings: run 1 is cold, the median and spread are over the warm runs."""

from __future__ import annotations

import statistics
from typing import Any


def summarize_runs(totals: list[float]) -> dict[str, Any]:
    """Run 1 is the cold one (first call on this input: caches, allocator, lazy init); median and
    spread are over the warm runs when there are any, else over the one run."""
    warm = totals[1:] or totals
    return {
        "n": len(totals),
        "totals_ms": totals,
        "cold_ms": totals[0],
        "median_ms": statistics.median(warm),
        "min_ms": min(warm),
        "max_ms": max(warm),
        "spread_ms": max(warm) - min(warm),
        "stdev_ms": statistics.stdev(warm) if len(warm) > 1 else 0.0,
        "over": "warm runs 2..n" if len(totals) > 1 else "the single (cold) run",
    }


def median_timings(runs: list[dict[str, float]]) -> dict[str, float]:
    warm = runs[1:] or runs
    return {k: statistics.median(r[k] for r in warm) for k in warm[0]}
