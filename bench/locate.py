"""python -m bench locate EXPORT_DIR --backend NAME --text "..." [--step N|max] [--json OUT] [--max-new-tokens N]

Which module of the backend's ONNX graph drifted from PyTorch at one decoding step: the table of
`service.locate.locate` (max |Δ|, relative error and op types per module, the first module over
the tolerance), printed, and the report as JSON with --json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.locate import locate


def _number(x: float | None) -> str:
    return "–" if x is None else f"{x:.2e}"


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table, the first module over the tolerance marked."""
    tol = report["tolerance"]
    metric = "max |Δ|" if tol["metric"] == "max_abs_diff" else "rel. error"
    ref, got = report["reference_token"], report["backend_argmax"]
    lines = [
        f"{report['backend']} ({report['precision']}), step {report['step']} ({report['step_rule']}): "
        f"PyTorch's token {ref['piece']!r} (id {ref['id']}), the backend's argmax {got['piece']!r} (id {got['id']}), "
        f"max |Δlogit| {report['max_abs_dlogit']:.3g}",
        "",
        f"| module | max \\|Δ\\| | rel. error | threshold ({metric}) | op types | as ONNX Runtime runs them |",
        "|---|---:|---:|---:|---|---|",
    ]
    first = (report["first_over_tolerance"] or {}).get("module")
    for row in report["layers"]:
        name = f"**{row['module']}** ← first over" if row["module"] == first else row["module"]
        ort_ops = "fused: read from the exported graph" if row["read_from"] == "exported" else ", ".join(row["ort_op_types"])
        lines.append(
            f"| {name} | {_number(row['max_abs_diff'])} | {_number(row['rel_error'])} | "
            f"{_number(row['threshold'])} | {', '.join(row['op_types'])} | {ort_ops} |"
        )
    if report["unmapped"]:
        lines += ["", f"not found in the graph: {', '.join(report['unmapped'])}"]
    reading = ", ".join(f"{k} {v:.2g}" for k, v in report["reading_max_abs_dlogit"].items())
    lines += ["", f"reading the module outputs changed the logits by at most: {reading}", "", report["summary"]]
    return "\n".join(lines)


def run(export_dir: Path, backend: str, text: str, step: int | str | None, json_out: Path | None,
        threads: int | None, max_new_tokens: int | None = None) -> int:
    report = locate(export_dir, backend, text, step, threads=threads, max_new_tokens=max_new_tokens)
    print(table(report))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
        print(f"wrote {json_out}")
    return 0


def step_arg(value: str) -> int | str:
    """--step: a 0-based step index, or "max" (the largest teacher-forced |Δlogit|)."""
    if value == "max":
        return value
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--step must be a step index or 'max', got {value!r}") from None
