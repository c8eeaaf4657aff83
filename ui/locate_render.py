"""The "locate" view: per-module drift of one backend against PyTorch, as a figure and a table.

Plain functions from the report `service.locate.locate_for_ui` returns (no gradio, no model):
`locate_figure` draws the compared metric per module on a log scale, in execution order, with the
tolerance line and the first module over it marked; `locate_html` is the summary and the table.
A report with an `error` (an unmappable graph, ...) gives no figure and the message as HTML.
"""

from __future__ import annotations

import html
import math
from typing import Any

from backends.registry import LABELS

CSS = """
.locate-summary { font-weight: 600; margin: 4px 0; }
.locate-note { color: var(--body-text-color-subdued); font-size: 0.85em; margin: 2px 0 6px 0; }
.locate-error { color: #d62728; font-weight: 600; white-space: pre-wrap; }
table.locate { border-collapse: collapse; font-size: 0.82em; width: 100%; }
table.locate th, table.locate td { border: 1px solid var(--border-color-primary); padding: 1px 6px; text-align: left; }
table.locate td.num { text-align: right; font-variant-numeric: tabular-nums; font-family: var(--font-mono);
                      white-space: nowrap; }
.locate-rows { max-height: 28em; overflow-y: auto; }
table.locate tr.over td { background: #ffd9a8; color: #000; }
table.locate tr.first td { background: #ffc2c2; color: #000; font-weight: 600; }
"""

_METRIC = {"max_abs_diff": "max |Δ| vs PyTorch", "rel_error": "relative error vs PyTorch (‖Δ‖/‖ref‖)"}
_FLOOR = 1e-12  # exact zeros drawn at the bottom of the log axis


def _e(x: Any) -> str:
    return html.escape(str(x))


def _num(x: float | None) -> str:
    if x is None:
        return "–"
    return "inf" if math.isinf(x) else f"{x:.2e}"


def _ort_ops(row: dict[str, Any]) -> str:
    if row.get("read_from") == "exported":
        return "(fused into the next module's kernel)"
    return ", ".join(row.get("ort_op_types") or [])


def _section(module: str) -> str:
    """"enc 0", "dec 3", "lm_head": the layer a module belongs to, for the axis (an embedding
    goes with layer 0, whose inputs it makes)."""
    parts = module.split(".")
    side = {"encoder": "enc", "decoder": "dec"}.get(parts[0])
    if side and len(parts) > 2 and parts[1] == "layers":
        return f"{side} {parts[2]}"
    if side and parts[-1] == "embed_tokens":
        return f"{side} 0"
    return module


def locate_figure(report: dict[str, Any]):
    """log(metric) per module, the tolerance line, the first module over it marked; None on error."""
    from matplotlib.figure import Figure

    if report.get("error") or not report.get("layers"):
        return None
    layers = report["layers"]
    metric = report["tolerance"]["metric"]
    values = [max(row[metric], _FLOOR) if math.isfinite(row[metric]) else math.nan for row in layers]
    x = list(range(len(layers)))
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax = fig.subplots()
    colors = ["#1f77b4" if r["module"].startswith("encoder") else "#2ca02c" if r["module"].startswith("decoder")
              else "#9467bd" for r in layers]
    ax.plot(x, values, color="#888888", lw=0.8, zorder=1)
    own = [i for i, row in enumerate(layers) if row.get("read_from") != "exported"]
    ax.scatter(own, [values[i] for i in own], c=[colors[i] for i in own], s=12, zorder=2)
    fused = [i for i, row in enumerate(layers) if row.get("read_from") == "exported"]
    if fused:  # ORT fused these outputs away: read from the exported graph instead
        ax.scatter(fused, [values[i] for i in fused], facecolors="none", edgecolors=[colors[i] for i in fused],
                   s=14, zorder=2, label="fused by ORT: read from the exported graph")
    bad = [i for i, row in enumerate(layers) if not math.isfinite(row[metric])]
    for i in bad:  # NaN / Inf in the graph: a mark at the top
        ax.axvline(i, color="#d62728", lw=1, ls=":")
    tol = report["tolerance"]
    thresholds = [row["threshold"] for row in layers]
    label = f"tolerance {tol['value']:g}" if tol["rule"] == "absolute" else (
        f"jump: {tol['factor']:g}× the worst module before (floor {tol['floor']:.1e})")
    ax.step(x, thresholds, where="mid", color="#d62728", ls="--", lw=1, label=label)
    first = report.get("first_over_tolerance")
    if first:
        i = next(k for k, row in enumerate(layers) if row["module"] == first["module"])
        ax.scatter([i], [values[i]], marker="*", s=160, color="#d62728", zorder=3,
                   label=f"first over: {first['module']}")
        right = i > len(layers) / 2  # keep the label inside the axes
        ax.annotate(first["module"], (i, values[i]), textcoords="offset points", xytext=(-8 if right else 8, -4),
                    ha="right" if right else "left", va="top", fontsize=8, color="#d62728")
    jump = report.get("largest_jump")
    if jump and not first:  # nothing over the tolerance: where the error grew most
        i = next(k for k, row in enumerate(layers) if row["module"] == jump["module"])
        ax.scatter([i], [values[i]], marker="^", s=60, facecolors="none", edgecolors="#e07b00", zorder=3,
                   label=f"largest increase: {jump['module']} ({jump['ratio']:.2g}×)")
    # One tick per layer, at its first module; thin lines between layers.
    ticks, names = [], []
    for i, row in enumerate(layers):
        section = _section(row["module"])
        if not names or names[-1] != section:
            ticks.append(i)
            names.append(section)
            if i:
                ax.axvline(i - 0.5, color="#cccccc", lw=0.6, zorder=0)
    ax.set_xticks(ticks, names, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel(_METRIC.get(metric, metric), fontsize=8)
    ax.set_xlim(-0.8, len(layers) - 0.2)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", alpha=0.3)
    name = report["backend"]
    ax.set_title(f"{LABELS.get(name, name)}: step {report['step']} ({report['step_rule']}), module by module",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return fig


def locate_html(report: dict[str, Any]) -> str:
    """The summary sentence, what was compared, and the per-module table."""
    if report.get("error"):
        return f'<div class="locate-error">locate {_e(report.get("backend", ""))}: {_e(report["error"])}</div>'
    ref, got = report["reference_token"], report["backend_argmax"]
    first = (report.get("first_over_tolerance") or {}).get("module")
    reading = report["reading_max_abs_dlogit"]
    notes = [
        f"Teacher-forced on PyTorch's tokens; at step {report['step']} PyTorch chose {_e(ref['piece'])} "
        f"(id {ref['id']}), the backend's logits favour {_e(got['piece'])} (id {got['id']}); "
        f"max |Δlogit| {report['max_abs_dlogit']:.3g}.",
        f"Graphs: {_e(', '.join(report['graphs']))}. Module outputs are read from ONNX Runtime's own optimized "
        f"graph (logits as the backend's within {reading.get('onnxruntime', 0.0):.2g})"
        + (f"; outputs ORT fused away from a copy of the exported graph (logits within {reading['exported']:.2g})"
           if "exported" in reading else "") + ".",
    ]
    if report.get("largest_jump") and not first:
        jump = report["largest_jump"]
        notes.append(f"Largest increase: {_e(jump['module'])}, {jump['ratio']:.2g}× the worst module before it.")
    if report.get("unmapped"):
        notes.append(f"Not found in the graph: {_e(', '.join(report['unmapped']))}.")
    rows = []
    for row in report["layers"]:
        cls = "first" if row["module"] == first else ("over" if row["over"] else "")
        rows.append(
            f'<tr class="{cls}"><td>{_e(row["module"])}</td><td class="num">{_num(row["max_abs_diff"])}</td>'
            f'<td class="num">{_num(row["rel_error"])}</td><td class="num">{_num(row["threshold"])}</td>'
            f'<td>{_e(", ".join(row["op_types"]))}</td><td>{_e(_ort_ops(row))}</td></tr>'
        )
    metric = "max |Δ|" if report["tolerance"]["metric"] == "max_abs_diff" else "rel. error"
    return (
        f'<div class="locate-summary">{_e(report["summary"])}</div>'
        + "".join(f'<div class="locate-note">{n}</div>' for n in notes)
        + '<div class="locate-rows"><table class="locate"><tr><th>module</th><th>max |Δ|</th><th>rel. error</th>'
        f"<th>threshold ({metric})</th><th>ONNX ops since the module before</th><th>as ORT runs them</th></tr>"
        + "".join(rows)
        + "</table></div>"
    )
