"""The Benchmark tab: a speed report in bench-results/, and a quick run on the app's own backends.

Reports are read with `service.reports` (newest first; by default the newest one for the model
this app serves). A quick run is `service.quickbench.quick_run` on the backends the app already
loaded, in the app's process, saved with `service.quickbench.save_quick` as the newest report.
Running in process means no second copy of every model in memory and no minutes of loading; the
price, load time and memory are not measured, which the report says. The run takes the app's one
model-run-at-a-time slot (concurrency_id "model"), so no translation overlaps its timings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from backends import REFERENCE
from service.fmt import num, ratio
from service.quickbench import (
    FULL_COMMAND,
    QUICK_RUN_LIMIT,
    check_count,
    quick_run,
    quick_sentences,
    save_quick,
)
from service.reference import load_reference
from service.reports import failure_line, find_reports, load_report
from service.speedrun import GREEDY, not_measured

from . import load_plots
from .machine import load_warning
from .state import REPO

QUICK_DEFAULT = 10
QUICK_CAP = 256  # output cap when the app sets none: `python -m bench speed`'s own, so runs compare


@dataclass
class ReportView:
    """What the report half of the tab shows for one report, or for none."""

    choices: list[tuple[str, str]] = field(default_factory=list)  # (label, results.json path), newest first
    selected: str | None = None
    header: str = ""
    table: pd.DataFrame | None = None
    notes: str = ""
    claims: str = ""
    method: str = ""
    plots: list[str] = field(default_factory=list)
    markdown: str = ""


def _shown_path(path: str | Path) -> str:
    path = Path(path)
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:  # outside the repo (a test's temporary folder): the full path
        return str(path)


def export_of(loaded) -> Path | None:
    """The export folder the app serves: its own record, else what its backends were loaded from."""
    if loaded.export_dir:
        return Path(loaded.export_dir)
    first = next(iter(loaded.backends.values()), None)
    return Path(first.manifest.root) if first else None


def _same_export(results: dict, export: Path | None) -> bool:
    return export is not None and Path(results["model"]["export"]).resolve() == export.resolve()


def _label(entry: dict) -> str:
    r = entry["results"]
    run = "quick run in the app" if r.get("quick") else "full run"
    return (
        f"{r['environment']['date_utc']} · {Path(r['model']['export']).name} · {run}, "
        f"{r['sentences']['count']} sentences · {_shown_path(Path(entry['path']).parent)}"
    )


# ---------------------------------------------------------------------------------------------
# Rendering one report


def header_md(report: dict, export: Path | None, newest_is_other: dict | None = None) -> str:
    r = report["results"]
    m, e, s, o = r["model"], r["environment"], r["sentences"], r["options"]
    how = (
        "**Quick run from this app** (every backend in the app's process)"
        if r.get("quick")
        else f"**Full run** (`{FULL_COMMAND}`: every runtime in its own process)"
    )
    params = f"{m['parameters']:,} parameters, " if m.get("parameters") else ""
    lines = [
        f"{how} · folder `{_shown_path(Path(report['path']).parent)}` · {e['date_utc']}",
        f"Model **{Path(m['export']).name}**: {params}{m['layers']} layers, d_model {m['d_model']} "
        f"(export `{_shown_path(m['export'])}`)",
    ]
    if not _same_export(r, export):
        lines.append(f"⚠️ Not the model this app serves (`{_shown_path(export) if export else '?'}`).")
    if newest_is_other:
        lines.append(
            f"A newer report exists for another model: {_label(newest_is_other)} (pick it in the list above)."
        )
    forced = o.get("forced_tokens")
    length = f"forced to {forced} tokens" if forced else f"to eos, capped at {o['max_new_tokens']}"
    source = f" from {s['source']}" if s.get("source") else ""
    search = (r.get("decoding") or GREEDY)["label"]  # a report made before beam runs existed: greedy
    lines.append(
        f"Sentences: {s['count']}{source}; batch-1 latency over {s['latency_sentences']}, throughput over "
        f"{s['throughput_sentences']} at batch {', '.join(map(str, o['batch_sizes']))}; output {length}; {search}."
    )
    load = f"load average {e.get('load_average_1m_at_start')} at start, {e.get('load_average_1m_at_end', '–')} at end"
    lines.append(
        f"Machine: {e['cpu']}, {e['logical_cores']} logical / {e.get('physical_cores')} physical cores, "
        f"{e['threads']} threads per runtime; {load}; git {e.get('git') or 'unknown'}"
    )
    if warning := load_warning(e):
        lines.append(f"**{warning}**")
    versions = ", ".join(f"{k} {v}" for k, v in e["versions"].items())
    lines.append(f"Versions: Python {e['python']}, {versions}")
    if e.get("peer_environment"):
        lines.append("Peers: " + ", ".join(f"{k} {v}" for k, v in e["peer_environment"]["versions"].items()))
    return "  \n".join(lines)


def table(results: dict) -> pd.DataFrame:
    """One row per runtime; columns a quick run does not measure (load, memory, size) left out."""
    rt, o = results["runtimes"], results["options"]
    ref = results.get("reference") or REFERENCE
    bs = [str(b) for b in o["batch_sizes"]]
    big = bs[-1]
    measured = {k: any(r.get(k) is not None for r in rt.values()) for k in ("load_s", "peak_rss_mb", "size_bytes")}
    quality = any("quality_vs_references" in r.get("comparison", {}) for r in rt.values())
    rows = []
    for name, r in rt.items():
        lat, c = r["latency"], r.get("comparison", {})
        row: dict[str, Any] = {"runtime": name, "dtype": r["info"].get("precision", "?")}
        if measured["load_s"]:
            row["load s"] = num(r.get("load_s"), 2)
        row |= {
            "batch-1 p50 ms": num(lat["p50"]),
            "p90 ms": num(lat["p90"]),
            "p99 ms": num(lat["p99"]),
            "ms/token": num(lat["ms_per_token_p50"], 2),
            f"p50 vs {ref}": ratio(c.get("latency_p50_ratio")),
        }
        for b in bs:
            row[f"batch {b} sent/s"] = num(r["throughput"].get(b, {}).get("sentences_per_s"), 2)
        row[f"batch {big} vs {ref}"] = ratio(c.get(f"throughput_b{big}_ratio"))
        if measured["peak_rss_mb"]:
            row["peak RSS MB"] = num(r.get("peak_rss_mb"), 0)
        if measured["size_bytes"]:
            row["size MB"] = num(r["size_bytes"] / 1e6 if r.get("size_bytes") else None, 1)
        share = c.get("identical_to_reference")
        row[f"identical to {ref}"] = "–" if share is None else f"{share:.0%}"
        if quality:
            q = c.get("quality_vs_references", {})
            row["BLEU"], row["chrF"] = num(q.get("bleu")), num(q.get("chrf"))
        rows.append(row)
    return pd.DataFrame(rows)


def notes_md(results: dict) -> str:
    ref = results.get("reference") or REFERENCE
    big = results["options"]["batch_sizes"][-1]
    lines = [
        f"p50 vs {ref}: latency ratio (below 1× is faster); batch {big} vs {ref}: throughput ratio "
        "(above 1× is faster). ms/token: median over sentences of time ÷ generated tokens."
    ]
    if any("quality_vs_references" in r.get("comparison", {}) for r in results["runtimes"].values()):
        n = results["sentences"]["latency_sentences"]
        lines.append(f"BLEU (sacrebleu, tokenize=\"zh\") and chrF of the batch-1 outputs over {n} sentences"
                     + (": few sentences, so a noisy figure." if n < 100 else "."))
    for name, err in results.get("failed", {}).items():
        lines.append(f"`{name}` did not run: {failure_line(err)}")
    for name, why in results.get("not_run", {}).items():
        lines.append(f"`{name}` not run: {why}")
    cap = results["options"]["max_new_tokens"]
    for name, r in results["runtimes"].items():
        if r["latency"].get("hit_cap"):
            lines.append(f"`{name}`: {r['latency']['hit_cap']} of {r['latency']['n']} outputs hit the {cap}-token cap")
    return "  \n".join(lines)


def claims_md(results: dict) -> str:
    claims = results.get("claims") or []
    if not claims:
        return ""
    rows = ["| claim | measured | held? |", "|---|---|---|"]
    for c in claims:
        rows.append(f"| {c['claim']} | {c['measured']} | {({True: 'yes', False: 'no', None: '–'})[c['held']]} |")
    caveat = (
        f" Measured on {results['sentences']['latency_sentences']} sentences in the app's process: an indication, "
        f"not a verdict; `{FULL_COMMAND}` is the measurement." if results.get("quick") else ""
    )
    return (
        "#### The migration article's claims, in this run\n" + "\n".join(rows)
        + "\n\nA speed claim holds at 90% of the claimed speed-up or more; \"identical\" only at 100%." + caveat
    )


def method_md(results: dict) -> str:
    return f"**What is timed.** {results['what_is_timed']}\n\n**Not measured:** {not_measured(results)}."


def _without_image_links(markdown: str) -> str:
    # report.md links its PNGs by file name; the tab shows them in the gallery instead
    return re.sub(r"^!\[[^\]]*\]\([^)]*\)\s*$", "", markdown, flags=re.M).rstrip() + "\n"


def _markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    cells = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in cells)


def reference_view(loaded, none_yet: str) -> ReportView | None:
    """The shipped reference results, marked as measured elsewhere; None when the app has none."""
    path = loaded.reference_results
    if path is None or not Path(path).is_file():
        return None
    try:
        ref = load_reference(path)
    except ValueError as e:
        return ReportView(header=f"{none_yet}  \n⚠️ The shipped reference results cannot be shown: {e}")
    first, *others = ref["runs"]
    export = export_of(loaded)
    lines = [
        f"**Reference results, not measured on this host**: {first['title']}, {first['date_utc']}, on "
        f"{ref['machine']} ({ref['threads']} threads per runtime), commit {first['commit'] or 'unknown'}; shipped "
        f"with the app in `{_shown_path(path)}`, from {first['source']}.",
    ]
    if export is None or export.name != ref["model"]:
        lines.append(f"⚠️ Measured on the embedded model `{ref['model']}`, not the model this app serves "
                     f"(`{_shown_path(export) if export else '?'}`).")
    lines.append(none_yet)
    versions = ", ".join(f"{k} {v}" for k, v in ref["versions"].items())
    more = [
        f"#### {run['title']}: reference, not measured on this host\n{run['date_utc']}, commit "
        f"{run['commit'] or 'unknown'}, `{run['command']}`; {run['method']} (from {run['source']}).\n\n"
        + _markdown_table(run["columns"], run["rows"])
        for run in others
    ]
    return ReportView(
        header="  \n".join(lines),
        table=pd.DataFrame(first["rows"], columns=first["columns"]),
        notes=f"`{first['command']}`: {first['method']}. Versions: {versions}.",
        method="\n\n".join(more),
    )


def view(loaded, path: str | None = None) -> ReportView:
    """The report at `path`, else the newest for the app's model, else the newest of any."""
    reports = find_reports(loaded.results_dir, kind="speed")
    if not reports:
        none_yet = (
            f"**No benchmark report yet** in `{_shown_path(loaded.results_dir)}`. Make one with "
            f"`{FULL_COMMAND}` (every backend in its own process over 200 dev sentences, with load time, "
            "memory and the output-length sweep), or run a quick one below."
        )
        return reference_view(loaded, none_yet) or ReportView(header=none_yet)
    export = export_of(loaded)
    choices = [(_label(r), r["path"]) for r in reports]
    ours = [r for r in reports if _same_export(r["results"], export)]
    chosen = next((r for r in reports if r["path"] == path), None) or (ours or reports)[0]
    newer_other = reports[0] if path is None and ours and reports[0] is not chosen else None
    report = load_report(chosen["path"], chosen["results"])
    r = report["results"]
    return ReportView(
        choices=choices,
        selected=chosen["path"],
        header=header_md(report, export, newer_other),
        table=table(r),
        notes=notes_md(r),
        claims=claims_md(r),
        method=method_md(r),
        plots=report["plots"],
        markdown=_without_image_links(report["markdown"]),
    )


# ---------------------------------------------------------------------------------------------
# A quick run


def run_quick(loaded, count: Any, progress=None) -> tuple[str, ReportView]:
    """Validate, time the loaded backends, save the report as the newest, show it as saved."""
    n = check_count(count)
    if not loaded.backends:
        raise ValueError("no backend is loaded: nothing to benchmark")
    sentences, references, source = quick_sentences(n, loaded.examples)
    not_run = {name: f"failed to load in the app: {err}" for name, err in loaded.load_errors.items()}
    results = quick_run(loaded.backends, sentences, progress=progress,
                        max_new_tokens=loaded.max_new_tokens or QUICK_CAP, references=references, source=source,
                        not_run=not_run)
    saved = save_quick(results, loaded.results_dir, export_of(loaded))
    status = (
        f"Done: {len(results['runtimes'])} backends over {n} sentences in {results['wall_s']:.1f} s; saved to "
        f"`{_shown_path(saved.parent)}` and shown below as the newest report."
    )
    return status, view(loaded, str(saved))


# ---------------------------------------------------------------------------------------------
# Layout and events


def build(loaded) -> None:
    """The tab, inside the caller's gr.Tabs(); its run shares the "model" concurrency slot."""
    with gr.Tab("Benchmark", id="benchmark", elem_id="tab-benchmark") as tab:
        gr.Markdown(
            "### Speed benchmark\nThe newest report in `bench-results/` for this app's model (pick another in the "
            f"list). The full benchmark is `{FULL_COMMAND}`: every backend alone in its own process, with load time "
            "and memory. A quick run here times the backends this app has loaded, in the app's process, while no "
            "translation runs, and saves its report as the newest."
        )
        with gr.Row(equal_height=True):
            count = gr.Number(
                value=QUICK_DEFAULT, label=f"quick run: sentences (1–{QUICK_RUN_LIMIT})", step=1,
                elem_id="bench-count", scale=1, min_width=200,
            )
            go = gr.Button("Run quick benchmark", variant="primary", elem_id="bench-run", scale=3)
        status = gr.Markdown("", elem_id="bench-status")
        first = view(loaded)
        picker = gr.Dropdown(
            choices=first.choices, value=first.selected, label="report", elem_id="bench-report-picker",
            interactive=True,
        )
        header = gr.Markdown(first.header, elem_id="bench-header")
        results_table = gr.Dataframe(  # hidden without a table: an empty one shows bare column numbers
            value=first.table, interactive=False, wrap=True, elem_id="bench-table", label="results",
            show_search="none", visible=first.table is not None,
        )
        notes = gr.Markdown(first.notes, elem_id="bench-notes")
        images = [
            gr.Image(value=path, label=label, visible=path is not None, interactive=False, buttons=["fullscreen"],
                     elem_id=f"bench-plot-{name}")
            for name, label, path in _plots(first)
        ]
        claims = gr.Markdown(first.claims, elem_id="bench-claims")
        method = gr.Markdown(first.method, elem_id="bench-method")
        with gr.Accordion("The full report (report.md)", open=False):
            markdown = gr.Markdown(first.markdown, elem_id="bench-markdown")
        load_shown, load_values = load_plots.build(loaded)

    shown = [picker, header, results_table, notes, *images, claims, method, markdown]

    def values(v: ReportView) -> tuple:
        plots = [gr.Image(value=path, visible=path is not None) for _, _, path in _plots(v)]
        return (gr.Dropdown(choices=v.choices, value=v.selected), v.header,
                gr.Dataframe(value=v.table, visible=v.table is not None), v.notes, *plots, v.claims, v.method,
                v.markdown)

    def refresh() -> tuple:
        return (*values(view(loaded)), *load_values())

    def pick(path: str | None) -> tuple:
        return values(view(loaded, path))

    def run(n: Any, progress=gr.Progress()) -> tuple:
        try:
            msg, v = run_quick(loaded, n, progress=progress)
        except ValueError as e:  # a bad count, or nothing to run: said next to the button
            return (f"⚠️ **{e}**", *[gr.skip()] * len(shown))
        return (msg, *values(v))

    tab.select(refresh, outputs=[*shown, *load_shown], api_visibility="private", show_progress="hidden")
    picker.input(pick, inputs=[picker], outputs=shown, api_visibility="private")
    go.click(
        run, inputs=[count], outputs=[status, *shown], concurrency_limit=1, concurrency_id="model",
        api_visibility="private", show_progress="full",
    )


PLOTS = (
    ("speed", "batch-1 latency (p50, whisker to p90) and throughput"),
    ("sweep", "output-length sweep: ms per sentence and per token at forced lengths"),
)


def _plots(v: ReportView) -> list[tuple[str, str, str | None]]:
    """(name, label, path or None) for each plot a report can have, in a fixed order."""
    by_name = {Path(p).stem: p for p in v.plots}
    return [(name, label, by_name.get(name)) for name, label in PLOTS]
