"""Load curves for the Benchmark tab: the newest measured on this host (`python -m bench load-curve`
writes curve.json under bench-results/), else the one shipped in the reference results, marked as
measured elsewhere. `read_curve` validates a curve once and raises ValueError naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

POINT = ("backend", "users", "sentences_per_s", "p50_ms", "p99_ms", "ok", "busy", "errors")


def read_curve(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the load curve: {e}") from e
    return check_curve(data, str(path))


def check_curve(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict) or data.get("kind") != "load_curve":
        raise ValueError(f"{where}: not a load curve (kind {data.get('kind') if isinstance(data, dict) else None!r})")
    points = data.get("points")
    problems = [] if points else ["no points"]
    for i, p in enumerate(points or []):
        missing = [k for k in POINT if k not in p]
        if missing:
            problems.append(f"point {i + 1}: no {', '.join(missing)}")
    problems += [f"no {k!r}" for k in ("date_utc", "method") if k not in data]
    if problems:
        raise ValueError(f"{where}: malformed load curve: {'; '.join(problems)}")
    return data


def newest_curve(results_dir: Path) -> Path | None:
    """The most recently written curve.json under `results_dir`, or None."""
    found = sorted(Path(results_dir).glob("**/curve.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None


def curve_to_show(results_dir: Path, reference: Path | None) -> tuple[dict | None, str]:
    """(the curve, where it comes from) : this host's newest, else the reference's; (None, why) when neither.
    A malformed file is said, not skipped silently."""
    measured = newest_curve(results_dir)
    if measured is not None:
        try:
            return read_curve(measured), f"measured on this host: `{measured}`"
        except ValueError as e:
            return None, f"⚠️ {e}"
    if reference is not None and Path(reference).is_file():
        try:
            data = json.loads(Path(reference).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return None, f"⚠️ {reference}: cannot read the reference results: {e}"
        if "load_curve" in data:
            try:
                curve = check_curve(data["load_curve"], f"{reference} (load_curve)")
            except ValueError as e:
                return None, f"⚠️ {e}"
            return curve, (f"**reference, not measured on this host**: {data.get('machine', 'another machine')}, "
                           f"commit {curve.get('commit') or 'unknown'}, shipped in `{Path(reference).name}`")
    return None, ("No load curve yet: make one with `python -m bench load-curve --launch --backends "
                  "ort_fp32_kv_cache,ort_int8`.")


def rows(curve: dict) -> list[dict]:
    """One row per point, for the plots: backend, users, sentences/s, P50 and P99 in ms."""
    return [{"backend": p["backend"], "users": p["users"], "sentences/s": p["sentences_per_s"],
             "P50 ms": p["p50_ms"], "P99 ms": p["p99_ms"]} for p in curve["points"]]
