"""The Compare tab's latency table and figures, from the `compare` JSON (service/compare.py).

No gradio here and no model; matplotlib is imported when a figure is drawn.
"""

from __future__ import annotations

from typing import Any

from backends import REFERENCE
from service.fmt import ms

from .compare_render import COLORS, LABELS


def _short_provider(provider: str) -> str:
    return provider.replace("ExecutionProvider", "")


def latency_rows(out: dict) -> list[list[Any]]:
    ref_total = (out["backends"].get(REFERENCE) or {}).get("timings_ms", {}).get("total")
    rows = []
    for name, b in out["backends"].items():
        if b.get("error"):
            rows.append([LABELS.get(name, name), "error", "", "", "", "", "", "", "", "", ""])
            continue
        t, runs = b["timings_ms"], b["runs"]
        rows.append(
            [
                LABELS.get(name, name),
                f"{b['info'].get('precision', '')} · {_short_provider(str(b['info'].get('provider', '')))}",
                len(b["token_ids"]),
                ms(t["tokenize"]),
                ms(t["encode"]),
                ms(t["first_token"]),
                ms(t["per_token"]),
                ms(t["total"]),
                ms(runs["cold_ms"]),
                f"{ms(runs['min_ms'])}–{ms(runs['max_ms'])}" if runs["n"] > 1 else "1 run",
                f"{ref_total / t['total']:.2f}×" if ref_total and t["total"] else "",
            ]
        )
    return rows


LATENCY_HEADERS = [
    "backend", "precision", "tokens", "tokenize", "encode", "1st token", "per token",
    "total", "run 1 (cold)", "warm min–max", "vs PyTorch",
]


def latency_figure(out: dict):
    from matplotlib.figure import Figure

    items = [(n, b) for n, b in out["backends"].items() if not b.get("error")]
    if not items:
        return None
    fig = Figure(figsize=(10, 2.4), layout="constrained")
    ax_total, ax_tok = fig.subplots(1, 2)
    labels = [LABELS.get(n, n) for n, _ in items]
    y = list(range(len(items)))
    panels = ((ax_total, "total", "total per sentence (ms)"), (ax_tok, "per_token", "decode per token (ms)"))
    for ax, key, title in panels:
        vals = [b["timings_ms"][key] for _, b in items]
        ax.barh(y, vals, color=[COLORS.get(n, "#888") for n, _ in items])
        for yi, v, (_, b) in zip(y, vals, items):
            # the label goes right of the bar, its warm-run whisker and its cold-run marker
            r = b["runs"]
            end = max(v, r["max_ms"], r["cold_ms"]) if key == "total" and r["n"] > 1 else v
            ax.text(end, yi, f"  {ms(v)}", va="center", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_yticks(y, labels if ax is ax_total else [""] * len(y), fontsize=8)
        ax.invert_yaxis()
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(x=0.25)
    # repeat-N: the warm runs' min–max as an error bar, the cold first run as a hollow marker
    for yi, (_, b) in zip(y, items):
        r = b["runs"]
        if r["n"] > 1:
            med = b["timings_ms"]["total"]
            err = [[med - r["min_ms"]], [r["max_ms"] - med]]
            whisker_label = "warm runs: min–max" if yi == 0 else None
            ax_total.errorbar(med, yi, xerr=err, fmt="none", ecolor="black", capsize=3, label=whisker_label)
            cold_label = "run 1 (cold)" if yi == 0 else None
            ax_total.plot(r["cold_ms"], yi, ls="none", marker="o", mfc="none", mec="black", ms=6, label=cold_label)
    if any(b["runs"]["n"] > 1 for _, b in items):
        fig.legend(*ax_total.get_legend_handles_labels(), fontsize=7, ncol=2, loc="outside lower center")
    return fig


def forced_figure(out: dict):
    """Per step: max |Δlogit| against PyTorch, and rank / probability of PyTorch's token."""
    from matplotlib.figure import Figure

    series = {
        n: b["divergence"]["teacher_forced"]
        for n, b in out["backends"].items()
        if n != REFERENCE and b.get("divergence") and (b["divergence"].get("teacher_forced") or {}).get("steps")
    }
    if not series:
        return None
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax_d, ax_r, ax_p = fig.subplots(3, 1, sharex=True)
    ref_prob, ref_seg = None, ""
    for n, tf in series.items():
        steps = list(range(len(tf["max_abs_dlogit"])))
        # With several segments each backend is forced on its own first diverging one: say which.
        d = out["backends"][n]["divergence"]
        seg = f" · segment {d['segment'] + 1}" if d.get("segments", 1) > 1 else ""
        kw = dict(color=COLORS.get(n), label=LABELS.get(n, n) + seg, lw=1.3, marker=".", ms=4)
        ax_d.plot(steps, [max(x, 1e-12) for x in tf["max_abs_dlogit"]], **kw)
        ax_r.plot(steps, tf["ref_token_rank"], **kw)
        ax_p.plot(steps, [p if p is not None else 0.0 for p in tf["ref_token_prob"]], **kw)
        ref_prob, ref_seg = tf["ref_token_prob_reference"], seg
    if ref_prob:
        ax_p.plot(
            range(len(ref_prob)), [p or 0.0 for p in ref_prob], color="black", ls="--", lw=1, label="PyTorch" + ref_seg
        )
    ax_d.set_yscale("log")
    ax_d.set_ylabel("max |Δlogit|", fontsize=8)
    ax_r.set_ylabel("rank of\nPyTorch token", fontsize=8)
    ax_p.set_ylabel("p(PyTorch token)", fontsize=8)
    ax_p.set_xlabel("decoder step (teacher-forced on PyTorch's output)", fontsize=8)
    ax_r.yaxis.get_major_locator().set_params(integer=True)
    top_rank = max(max(tf["ref_token_rank"]) for tf in series.values())
    ax_r.set_ylim(-0.5, max(top_rank, 1) + 0.5)
    ax_p.set_ylim(-0.02, 1.02)
    for ax in (ax_d, ax_r, ax_p):
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    handles, labels = ax_p.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=len(labels), loc="outside upper center")
    return fig
