"""The A/B app: English text through PyTorch and every ONNX Runtime backend, side by side.

    python app.py                           # the embedded model (assets/marian-en-zh-small)
    python app.py --model PATH_OR_HUB_ID    # or MODEL_ID=...; an export folder is used as is

The first start exports the model to exports/<name>; later starts reuse that export when the
sidecar's checksums match. GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (default 7860) are honoured.

This file only wires: it parses options, prepares the export, loads the backends, builds the tabs
(ui/) and launches. The requests themselves are service/'s, the engines backends/'s.
"""

from __future__ import annotations

import argparse
import html
import logging
import os
import re
import sys
from pathlib import Path

import gradio as gr

from backends.memory import limit_arenas
from corpus import read_sentences
from service import RequestLimits
from ui import benchmark_tab, compare_tab, locate_render, spotcheck_tab
from ui.compare_render import CSS, LABELS
from ui.state import REPO, Loaded

logger = logging.getLogger("app")

DEFAULT_MODEL = REPO / "assets" / "marian-en-zh-small"
EXAMPLES_TSV = REPO / "assets" / "examples.tsv"
QUEUE_SIZE = 8  # waiting requests beyond one running; more get "busy, try again"

__all__ = ["CSS", "Loaded", "build_app", "main"]


def build_app(loaded: Loaded) -> gr.Blocks:
    """The page: a header naming the model and what loaded, then the Compare, Benchmark and Batch
    spot-check tabs. Every tab's model work shares one slot (concurrency_id "model")."""
    names = loaded.names
    with gr.Blocks(title="MarianMT en→zh: PyTorch vs ONNX Runtime") as demo:
        failed = ", ".join(LABELS.get(n, n) for n in loaded.load_errors)
        failed = f" (could not load: {html.escape(failed)}; see their panels)" if failed else ""
        gr.Markdown(
            f"## MarianMT en→zh · PyTorch vs ONNX Runtime, side by side\n"
            f"Model **{html.escape(str(loaded.model))}** · export `{html.escape(str(loaded.export_dir))}` "
            f"({html.escape(loaded.export_note)}) · {len(loaded.backends)}/{len(names)} backends loaded{failed}. "
            "Each backend runs alone, one after the other; results appear as each finishes. Divergence and "
            "drift are measured against PyTorch.",
            elem_id="header",
        )
        with gr.Tabs():
            compare_tab.build(loaded)
            benchmark_tab.build(loaded)
            spotcheck_tab.build(loaded)
    return demo


def read_examples(path: Path) -> list[str]:
    """The example inputs (a TSV with an `en` column); none when the file is absent."""
    return [p.en for p in read_sentences(path)] if path.is_file() else []


def export_name(model: str) -> str:
    """exports/<this>: a folder's own name; a hub id `owner/name` as `owner--name`."""
    if Path(model).exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return Path(model).name
    return model.replace("/", "--")


def prepare(model: str, export_dir: Path | None, threads: int | None) -> tuple[Path, str]:
    """An export folder for `model`: used as is when `model` is one, else exported or reused."""
    if (Path(model) / "manifest.json").is_file():
        return Path(model), "an export folder, used as is"
    from export.ensure import ensure_export  # torch and the exporter: only when exporting

    out = export_dir or REPO / "exports" / export_name(model)
    said: list[str] = []

    def log(msg, **_):
        said.append(str(msg))
        print(msg, flush=True)

    ensure_export(model, out, log=log, threads=threads)
    return out, "reused: checksums match" if said and said[0].startswith("reusing") else "exported on this start"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("MODEL_ID") or str(DEFAULT_MODEL),
        help="Marian model folder, hub id, or an export folder (default: $MODEL_ID, else the embedded model)",
    )
    parser.add_argument("--export-dir", type=Path, default=None, help="where to export (default: exports/<model name>)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="cap per translation (default: model limit)")
    parser.add_argument("--threads", type=int, default=None, help="threads per backend (default: physical cores)")
    parser.add_argument("--examples", type=Path, default=EXAMPLES_TSV, help="TSV with an 'en' column of example inputs")
    parser.add_argument("--queue-size", type=int, default=QUEUE_SIZE, help="waiting requests before 'busy, try again'")
    limits = RequestLimits()
    parser.add_argument("--max-chars", type=int, default=limits.max_chars, help="longest text one request takes")
    parser.add_argument(
        "--max-segments", type=int, default=limits.max_segments, help="most sentences (or chunks) one request takes"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=limits.max_seconds, help="time one backend may take on one request"
    )
    parser.add_argument(
        "--max-beams", type=int, default=limits.max_beams, help="widest beam search one request may ask for"
    )
    args = parser.parse_args(argv)
    limit_arenas()  # before gradio's worker threads allocate: see backends/memory.py
    try:
        limits = RequestLimits(args.max_chars, args.max_segments, args.max_seconds, max_beams=args.max_beams)
    except ValueError as e:
        parser.error(str(e))
    # Our loggers at INFO; third-party ones (httpx, the quantizer's root logging) at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("app", "backends", "export"):
        logging.getLogger(name).setLevel(logging.INFO)

    from backends import SessionConfig, try_load_backends

    try:
        export_dir, note = prepare(args.model, args.export_dir, args.threads)
        backends, errors = try_load_backends(export_dir, session=SessionConfig(threads=args.threads))
        examples = read_examples(args.examples)
    except Exception as e:  # nothing can run without an export, a manifest and a tokenizer
        print(f"error: cannot start with model {args.model!r}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for name, err in errors.items():
        logger.warning("backend %s failed to load (shown in its panel): %s", name, err)
    loaded = Loaded(backends, errors, args.model, export_dir, note, args.max_new_tokens, examples, limits=limits)
    demo = build_app(loaded)
    demo.queue(max_size=args.queue_size, default_concurrency_limit=1)
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME") or None,
        server_port=int(os.environ.get("GRADIO_SERVER_PORT") or 7860),
        css=CSS + locate_render.CSS,
        theme=gr.themes.Soft(),
        show_error=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
