"""The Compare tab: one text through every backend, side by side, and the `compare` API.

Layout and events only: the work is `service.compare_iter`, the HTML comes from `compare_render`,
the latency table and figures from `compare_figures`. The page's own handler streams a frame per
finished backend; the named API endpoint `compare` returns the same JSON the page renders.
"""

from __future__ import annotations

from collections.abc import Iterator

import gradio as gr

from backends import REFERENCE
from backends.memory import trim_heap
from service import MAX_REPEAT, InputError, compare_iter, decoding_for, decoding_json, plan, segments_json, to_json
from service.locate import locate_for_ui
from service.translate import overlap_warning

from .compare_figures import LATENCY_HEADERS, forced_figure, latency_figure, latency_rows
from .compare_render import LABELS, decoding_md, divergence_html, panel_html, segments_html
from .locate_render import locate_figure, locate_html
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


def decoding_choices(loaded: Loaded) -> list[tuple[str, int]]:
    """(label, num_beams) pairs; 0 stands for the model's own generation config."""
    backend = next(iter(loaded.backends.values()), None)
    own = backend.manifest.generation.num_beams if backend is not None else 1
    default = f"model default ({'greedy' if own == 1 else f'beam {own}'})"
    beams = [(f"beam {n}", n) for n in range(2, loaded.limits.max_beams + 1)]
    return [(default, 0), ("greedy", 1), *beams]


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

    with gr.Tab("Compare", id="compare", elem_id="tab-compare") as tab:
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
                decoding = gr.Dropdown(
                    decoding_choices(loaded), value=0, label="decoding", elem_id="decoding",
                    info="the model's own generation config, greedy, or beam search with N beams",
                )
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
        gr.Markdown(
            "#### Locate: which module drifted\nFor a backend that diverges, compare PyTorch's activations with the "
            "same values inside that backend's ONNX graphs, module by module, at the first diverging step (or, "
            "when the outputs agree, the step with the largest |Δlogit|)."
        )
        with gr.Row():
            loc_backend = gr.Dropdown(
                [(LABELS.get(n, n), n) for n in names if n != REFERENCE and n in loaded.backends],
                value=None, label="backend (default: the first that diverges)", elem_id="locate-backend", scale=3,
            )
            loc_go = gr.Button("Locate", elem_id="locate-btn", scale=1)
        loc_plot = gr.Plot(show_label=False, elem_id="locate-plot", format="png")
        loc_html = gr.HTML("", elem_id="locate-report")
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

    def frame(msg: str, results: dict, running: str | None, segments: list[dict], used: dict):
        """Every output's value for the results so far; `running` is the backend now busy."""
        out = {"reference": REFERENCE, "decoding": used, "segments": segments, "backends": results}
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

    def said_overlap(result, mark: tuple[int, int]) -> tuple[int, int]:
        """A warning on `result` when translate decodes ran while it was timed; the next mark."""
        note = overlap_warning(loaded.traffic.since(mark))
        if note:
            result.warnings.append(note)
        return loaded.traffic.mark()

    def translate_ui(text_in: str, n_repeat: float, beams: int | None = 0):
        beams = int(beams) or None if beams is not None else None  # 0: the model's own config
        try:
            # Empty or too long an input, or too much work for the beams, is refused here, before
            # any model call; the split and the decoding are shown from the first frame on.
            split_segments = plan(loaded.backends, text_in, loaded.limits)
            options = decoding_for(
                loaded.backends, split_segments, num_beams=beams, max_new_tokens=loaded.max_new_tokens,
                limits=loaded.limits,
            )
            used = decoding_json(options, beams) if loaded.backends else {}
            segments = segments_json(split_segments)
            split = f"Split into {len(segments)} segments. " if len(segments) > 1 else ""
            split = f"{decoding_md(used)} {split}"
            results: dict[str, dict] = {}
            order = [n for n in names if n not in loaded.load_errors]
            first = order[0] if order else None
            msg = f"{split}Running {LABELS.get(first, first)}…" if first else split
            yield frame(msg, results, first, segments, used)
            mark = loaded.traffic.mark()
            for r in compare_iter(loaded.backends, text_in, repeat=int(n_repeat), num_beams=beams, **opts):
                mark = said_overlap(r, mark)
                results[r.name] = r.to_json()
                nxt = next((n for n in order if n not in results), None)
                msg = f"{split}{len(results)}/{len(names)} done; running {LABELS.get(nxt, nxt)}…"
                yield frame(msg, results, nxt, segments, used)
        except InputError as e:
            yield (f"⚠️ **{e}**", *[""] * len(names), *initial_panels(), "", "", None, None, None, None)
            return
        finally:
            trim_heap()  # one long request must not leave the process at its high-water mark
        n_ok = sum(1 for b in results.values() if not b.get("error"))
        runs = f", {int(n_repeat)} runs each" if n_repeat > 1 else ""
        yield frame(f"{split}Done: {n_ok}/{len(names)} backends translated{runs}.", results, None, segments, used)

    def compare_api(text: str, repeat: int = 1, num_beams: int | None = None) -> Iterator[dict]:
        """Translate `text` with every backend, one at a time; returns translations, tokens,
        timings and divergence from PyTorch as {"reference", "decoding", "segments", "backends":
        {name: {...}}}. `num_beams`: None decodes as the model's own generation config says, 1 is
        greedy, 2..8 beam search (each backend then returns its n-best list with scores, and where
        PyTorch's best hypothesis ranks in it). Text of several sentences is split into segments,
        translated as a batch and joined. Streams: one update per finished backend, the last one
        complete."""
        try:
            results, mark = [], loaded.traffic.mark()
            for r in compare_iter(loaded.backends, text, repeat=repeat, num_beams=num_beams, **opts):
                mark = said_overlap(r, mark)
                results.append(r)
                yield to_json(results, REFERENCE)
        except (InputError, ValueError) as e:
            raise gr.Error(str(e)) from e
        finally:
            trim_heap()

    def locate_ui(out: dict | None, name: str | None):
        """The per-module drift report for one backend on the segment its divergence view details."""
        if not out or not out.get("backends") or REFERENCE not in out["backends"]:
            return None, "<div class='state-wait'>Translate something first: locate explains a comparison.</div>"
        results = out["backends"]
        compared = [n for n, b in results.items() if n != REFERENCE and (b.get("divergence") or {}).get("alignment")]
        if not name:
            name = next((n for n in compared if not results[n]["divergence"]["identical"]), None)
            name = name or (compared[0] if compared else None)
        if name not in compared:
            why = results.get(name, {}).get("error") or "it has no comparison with PyTorch in this result"
            return None, f"<div class='state-err'>cannot locate {LABELS.get(name, name)}: {why}</div>"
        seg = results[name]["divergence"].get("segment", 0)
        try:
            report = locate_for_ui(
                loaded.backends, name, out["segments"][seg]["text"],
                results[REFERENCE]["segments"][seg]["token_ids"], results[name]["segments"][seg]["token_ids"],
            )
        finally:
            trim_heap()
        return locate_figure(report), locate_html(report)

    loc_go.click(
        locate_ui, inputs=[raw, loc_backend], outputs=[loc_plot, loc_html], concurrency_limit=1,
        concurrency_id="model", api_visibility="private", show_progress="minimal",
    )

    # One model run at a time across the page and the API: both share the "model" slot.
    events = dict(
        fn=translate_ui,
        inputs=[text, repeat, decoding],
        outputs=outputs,
        concurrency_limit=1,
        concurrency_id="model",
        api_visibility="private",  # UI-only: the API is `compare`
        show_progress="minimal",
    )
    go.click(**events)
    text.submit(**events)
    with tab:  # an endpoint with no component; inside a Tab, so gr.Tabs holds only tabs
        gr.api(compare_api, api_name="compare", concurrency_limit=1, concurrency_id="model")
