"""The Translate tab and the `translate` API: one backend, concurrent requests batched together.

Gradio calls both concurrently (as many at once as one batch takes, in their own slot, concurrency_id
"translate", apart from the Compare tab's "model" slot); each call hands its request to one
`service.batcher.Batcher`, whose decoder thread takes the waiting requests as one batch through
`service.translate_batch` and gives each caller its own answer. A comparison that runs meanwhile
says so next to its timings. Not Gradio's `batch=True`: see service/batcher.py.
"""

from __future__ import annotations

import gradio as gr

from service.translate import default_backend

from .compare_render import LABELS
from .compare_tab import decoding_choices
from .state import Loaded


def build(loaded: Loaded) -> None:
    """The Translate tab and the `translate` endpoint; call inside the app's gr.Tabs()."""
    default = default_backend(loaded.backends)
    names = list(loaded.backends)
    why = ("the fastest backend the export's verification found token-identical to PyTorch "
           "(fp16 or int8 only where clearly faster than every exact one)"
           if default else "this export records no verification: choose a backend")

    batcher = loaded.translator  # answers TranslateAnswer objects: see service.translate.translate_batcher

    with gr.Tab("Translate", id="translate", elem_id="tab-translate") as tab:
        gr.Markdown(
            "One backend translates; requests arriving together (from this page or the `translate` API) are "
            f"decoded together, up to {loaded.batching.max_requests} at once, and each gets its own answer."
        )
        with gr.Row(equal_height=False):
            text = gr.Textbox(label="English text", lines=2, max_lines=8, scale=5, elem_id="translate-input")
            with gr.Column(scale=1, min_width=240):
                go = gr.Button("Translate", variant="primary", elem_id="translate-go")
                backend = gr.Dropdown(
                    [(LABELS.get(n, n), n) for n in names], value=default, label="backend",
                    info=f"default: {LABELS.get(default, default) if default else 'none'}: {why}",
                    elem_id="translate-backend",
                )
                decoding = gr.Dropdown(decoding_choices(loaded), value=0, label="decoding",
                                       elem_id="translate-decoding")
        out = gr.Textbox(label="Translation", lines=2, interactive=False, buttons=["copy"], elem_id="translate-output")
        status = gr.Markdown("", elem_id="translate-status")
        with gr.Accordion("Raw result (the `translate` API's JSON)", open=False):
            raw = gr.JSON(elem_id="translate-json")

    def translate_page(text: str, beams, backend_name) -> tuple[str, str, dict]:
        a = batcher.submit((text, beams, backend_name)).to_json()
        if a["error"]:
            return "", f"⚠️ **{a['error']}**", a
        others = a["batch"]["decoded_together"] - 1
        batch = f" with {others} other request{'s' if others > 1 else ''}" if others else ""
        warn = "".join(f" ⚠️ {w}." for w in a["warnings"])
        said = (f"{LABELS.get(a['backend'], a['backend'])}, {a['decoding']['strategy']}: decoded{batch} "
                f"in {a['timings_ms']['decode']:,.0f} ms.{warn}")
        return a["text"] or "", said, a

    # Concurrent calls, so that requests arriving together wait in the batcher, which forms the batches.
    slot = dict(concurrency_limit=loaded.batching.max_requests, concurrency_id="translate")
    events = dict(fn=translate_page, inputs=[text, decoding, backend], outputs=[out, status, raw],
                  api_visibility="private", show_progress="minimal", **slot)
    go.click(**events)
    text.submit(**events)

    def translate_api(text: str, num_beams: int | None = None, backend: str | None = None) -> dict:
        """Translate `text` with one backend (default: the fastest one the export's verification
        found token-identical to PyTorch). `num_beams`: None decodes as the model's own generation
        config says, 1 is greedy, 2..8 beam search. Returns {"text", "error", "backend", "decoding",
        "segments", "warnings", "batch", "timings_ms"}; a refused request has `error` set and `text`
        null, and requests decoded with it are not affected."""
        return batcher.submit((text, num_beams, backend)).to_json()

    with tab:  # an endpoint with no component; inside a Tab, so gr.Tabs holds only tabs
        gr.api(translate_api, api_name="translate", **slot)
