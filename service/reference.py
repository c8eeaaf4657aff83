"""Reference results shipped with the app (assets/reference-results.json): measured elsewhere.

A fresh start has no report in bench-results/; the Benchmark tab then shows these, each run with
its date, machine, commit and method, marked as not measured on this host. The file is copied
from docs/benchmarks.md's tables (a test checks that they agree). `load_reference` validates it
once and raises ValueError naming what is missing or malformed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOP = ("what", "model", "machine", "threads", "versions", "runs")
RUN = ("title", "date_utc", "commit", "command", "source", "method", "columns", "rows")


def load_reference(path: str | Path) -> dict[str, Any]:
    """The reference results at `path`, every run's rows as wide as its columns."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the reference results: {e}") from e
    problems = [f"no {k!r}" for k in TOP if k not in data]
    for i, run in enumerate(data.get("runs") or []):
        problems += [f"run {i + 1}: no {k!r}" for k in RUN if k not in run]
        width = len(run.get("columns") or [])
        problems += [f"run {i + 1}, row {j + 1}: {len(row)} cells for {width} columns"
                     for j, row in enumerate(run.get("rows") or []) if len(row) != width]
    if not problems and not data["runs"]:
        problems.append("no runs")
    if problems:
        raise ValueError(f"{path}: malformed reference results: {'; '.join(problems)}")
    return data
