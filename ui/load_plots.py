"""The Benchmark tab's load section: users against throughput and P99, one line per backend.

The curve comes from `service.load_curve` (this host's newest `bench load-curve` run, else the
shipped reference, marked as measured elsewhere)."""

from __future__ import annotations

import gradio as gr
import pandas as pd

from service.load_curve import curve_to_show, rows

COLUMNS = ["backend", "users", "sentences/s", "P50 ms", "P99 ms"]


def frame(loaded) -> tuple[pd.DataFrame, str]:
    curve, source = curve_to_show(loaded.results_dir, loaded.reference_results)
    if curve is None:
        return pd.DataFrame(columns=COLUMNS), source
    head = (f"**Load curve**, {curve['date_utc']} UTC, {source}. Method: {curve['method']}. "
            f"Refused or failed requests over the whole curve: "
            f"{sum(p['busy'] for p in curve['points'])} busy, {sum(p['errors'] for p in curve['points'])} errors.")
    return pd.DataFrame(rows(curve), columns=COLUMNS), head


def build(loaded) -> tuple[list, callable]:
    """The section inside the caller's tab; returns (its components, a function giving their values)."""
    data, head = frame(loaded)
    gr.Markdown("### Under load: the translate endpoint")
    header = gr.Markdown(head, elem_id="load-curve-header")
    with gr.Row():
        throughput = gr.LinePlot(data, x="users", y="sentences/s", color="backend", title="users → sentences/s",
                                 elem_id="load-curve-throughput", visible=not data.empty)
        p99 = gr.LinePlot(data, x="users", y="P99 ms", color="backend", title="users → P99 latency (ms)",
                          elem_id="load-curve-p99", visible=not data.empty)

    def values() -> tuple:
        d, h = frame(loaded)
        return h, gr.LinePlot(value=d, visible=not d.empty), gr.LinePlot(value=d, visible=not d.empty)

    return [header, throughput, p99], values
