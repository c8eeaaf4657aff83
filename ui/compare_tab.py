"""The Compare tab: one text through every backend, side by side, and the `compare` API.

Layout and events only: the work is `service.compare_iter`, the HTML and figures come from
`compare_render`. The page's own handler streams a frame per finished backend; the named API
endpoint `compare` returns the same JSON the page renders.
"""

from __future__ import annotations

from collections.abc import Iterator

import gradio as gr

from backends import REFERENCE
from backends.memory import trim_heap
from service import MAX_REPEAT, InputError, compare_iter, plan, segments_json, to_json

from .compare_render import (
    LABELS,
    LATENCY_HEADERS,
    divergence_html,
    forced_figure,
    latency_figure,
    latency_rows,
    panel_html,
    segments_html,
)
from .state import Loaded

BOUNDARY_EXAMPLES = [
    (
        "long paragraph",
        "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
        "the members agreed to increase funding for public libraries, to repair the old bridge near the "
        "river, and to hire two more teachers for the primary school. Several residents asked why the park "
        "renovation had been postponed again, and the chair promised a detailed answer at the next meeting. "
        "The meeting ended shortly after nine in the evening.",
    ),
    ("punctuation only", "?!... ,;: -- !!"),
    ("mixed Chinese and English", "Please open the 设置 menu and click 保存 to save your changes."),
    ("emoji", "I love this song 🎵😊 and I want to hear it again 🔁!"),
    ("empty input", ""),
]


def build(loaded: Loaded) -> None:
    """The Compare tab and the `compare` endpoint; call inside the app's gr.Tabs()."""
    names = loaded.names
    opts = dict(max_new_tokens=loaded.max_new_tokens, load_errors=loaded.load_errors, limits=loaded.limits)

    def initial_panels() -> list[str]:
        out = []
        for n in names:
            if n in loaded.load_errors:
                out.append(panel_html(n, {"error": f"failed to load: {loaded.load_errors[n]}"}, "", {}))
            else:
                out.append(panel_html(n, None, "ready", loaded.backends[n].info))
        return out

    with gr.Tab("Compare", id="compare", elem_id="tab-compare"):
        with gr.Row(equal_height=False):
            text = gr.Textbox(
                label="English text",
                placeholder="Type an English sentence and press Enter",
                lines=1,  # one line submits on Enter; the box still grows up to max_lines as text wraps
                max_lines=8,
                scale=5,
                elem_id="input-text",
                autofocus=True,
            )
            with gr.Column(scale=1, min_width=240):
                go = gr.Button("Translate", variant="primary", elem_id="translate-btn")
                repeat = gr.Slider(1, MAX_REPEAT, value=1, step=1, label="runs per backend", elem_id="repeat")
        with gr.Row():
            if loaded.examples:
                gr.Examples(
                    [[s] for s in loaded.examples],
                    inputs=[text],
                    label="Examples (assets/examples.tsv)",
                    examples_per_page=6,
                )
            gr.Examples(
                [[t] for _, t in BOUNDARY_EXAMPLES],
                inputs=[text],
                label="Boundary inputs",
                example_labels=[label for label, _ in BOUNDARY_EXAMPLES],
            )
        status = gr.Markdown("", elem_id="status")

        outs_text, outs_stats = {}, {}
        panels0 = initial_panels()
        per_row = 2 if len(names) <= 4 else 3
        for row_names in [names[i : i + per_row] for i in range(0, len(names), per_row)]:
            with gr.Row(equal_height=True):
                for n in row_names:
                    with gr.Column(elem_id=f"panel-{n}", variant="panel"):
                        outs_text[n] = gr.Textbox(
                            label=LABELS.get(n, n), lines=2, interactive=False, buttons=["copy"],
                            elem_id=f"out-{n}",
                        )
                        outs_stats[n] = gr.HTML(panels0[names.index(n)], elem_id=f"stats-{n}")
        seg_html = gr.HTML("", elem_id="segments")  # the split of a multi-sentence input
        gr.Markdown("### Per-token divergence from PyTorch")
        div_html = gr.HTML(
            "<div class='state-wait'>Translate something to compare tokens.</div>", elem_id="divergence"
        )
        gr.Markdown(
            "#### Teacher-forced drift\nEvery ORT backend is fed PyTorch's own output tokens; per step: the "
            "largest logit difference from PyTorch, and the rank and probability it gives PyTorch's token. "
            "Drift shows here even when the translations agree."
        )
        forced_plot = gr.Plot(show_label=False, elem_id="forced-plot", format="png")
        gr.Markdown("### Latency")
        lat_table = gr.Dataframe(
            headers=LATENCY_HEADERS,
            interactive=False,
            elem_id="latency-table",
            wrap=True,
            label="milliseconds; with N > 1 runs per backend: median of the warm runs 2..N",
            column_widths=["17%", "9%", "7%", "8%", "7%", "8%", "8%", "8%", "10%", "10%", "8%"],
        )
        lat_plot = gr.Plot(show_label=False, elem_id="latency-plot", format="png")
        with gr.Accordion("Raw result (the `compare` API's JSON)", open=False):
            raw = gr.JSON(elem_id="raw-json")

    outputs = [
        status, *[outs_text[n] for n in names], *[outs_stats[n] for n in names], seg_html,
        div_html, forced_plot, lat_table, lat_plot, raw,
    ]  # fmt: skip

    def frame(msg: str, results: dict, running: str | None, segments: list[dict]):
        """Every output's value for the results so far; `running` is the backend now busy."""
        out = {"reference": REFERENCE, "segments": segments, "backends": results}
        texts = [(results[n]["text"] or "") if n in results else "" for n in names]
        stats = []
        for n in names:
            info = loaded.backends[n].info if n in loaded.backends else {}
            if n in results:
                stats.append(panel_html(n, results[n], "", info))
            elif n in loaded.load_errors:
                stats.append(panel_html(n, {"error": f"failed to load: {loaded.load_errors[n]}"}, "", info))
            else:
                stats.append(panel_html(n, None, "running…" if n == running else "waiting…", info))
        compared = any(n in results for n in names if n != REFERENCE)
        return (
            msg,
            *texts,
            *stats,
            segments_html(out),
            divergence_html(out) if compared else "<div class='state-wait'>waiting for the ORT backends…</div>",
            forced_figure(out) if compared else None,
            latency_rows(out) if results else None,
            latency_figure(out) if results else None,
            out,
        )

    def translate_ui(text_in: str, n_repeat: float):
        try:
            # Empty or too long an input is refused here, before any model call; the split is
            # shown from the first frame on.
            segments = segments_json(plan(loaded.backends, text_in, loaded.limits))
            split = f"Split into {len(segments)} segments. " if len(segments) > 1 else ""
            results: dict[str, dict] = {}
            order = [n for n in names if n not in loaded.load_errors]
            first = order[0] if order else None
            msg = f"{split}Running {LABELS.get(first, first)}…" if first else split
            yield frame(msg, results, first, segments)
            for r in compare_iter(loaded.backends, text_in, repeat=int(n_repeat), **opts):
                results[r.name] = r.to_json()
                nxt = next((n for n in order if n not in results), None)
                msg = f"{split}{len(results)}/{len(names)} done; running {LABELS.get(nxt, nxt)}…"
                yield frame(msg, results, nxt, segments)
        except InputError as e:
            yield (f"⚠️ **{e}**", *[""] * len(names), *initial_panels(), "", "", None, None, None, None)
            return
        finally:
            trim_heap()  # one long request must not leave the process at its high-water mark
        n_ok = sum(1 for b in results.values() if not b.get("error"))
        runs = f", {int(n_repeat)} runs each" if n_repeat > 1 else ""
        yield frame(f"{split}Done: {n_ok}/{len(names)} backends translated{runs}.", results, None, segments)

    def compare_api(text: str, repeat: int = 1) -> Iterator[dict]:
        """Translate `text` with every backend, one at a time; returns translations, tokens,
        timings and divergence from PyTorch as {"reference", "segments", "backends": {name: {...}}}.
        Text of several sentences is split into segments, translated as a batch and joined.
        Streams: one update per finished backend, the last one complete."""
        try:
            results = []
            for r in compare_iter(loaded.backends, text, repeat=repeat, **opts):
                results.append(r)
                yield to_json(results, REFERENCE)
        except (InputError, ValueError) as e:
            raise gr.Error(str(e)) from e
        finally:
            trim_heap()

    # One model run at a time across the page and the API: both share the "model" slot.
    events = dict(
        fn=translate_ui,
        inputs=[text, repeat],
        outputs=outputs,
        concurrency_limit=1,
        concurrency_id="model",
        api_visibility="private",  # UI-only: the API is `compare`
        show_progress="minimal",
    )
    go.click(**events)
    text.submit(**events)
    gr.api(compare_api, api_name="compare", concurrency_limit=1, concurrency_id="model")
