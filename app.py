"""The A/B app: English text through PyTorch and every ONNX Runtime backend, side by side.

    python app.py                           # the embedded model (assets/marian-en-zh-small)
    python app.py --model PATH_OR_HUB_ID    # or MODEL_ID=...; an export folder is used as is
    python app.py --model NLLB_FOLDER --src-lang eng_Latn --tgt-lang zho_Hans --backends pytorch,ort_int8
    python app.py --external optimum=exports/peers/optimum   # also an Optimum export of the same model

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
from families import FAMILIES
from service import RequestLimits
from service.batcher import BatchPolicy
from service.http_api import AppTranslateRoute
from service.translate import MAX_REQUESTS, default_backend, translate_batcher
from ui import benchmark_tab, compare_tab, locate_render, spotcheck_tab, translate_tab
from ui.compare_render import CSS, LABELS
from ui.state import REPO, Loaded, model_heading

logger = logging.getLogger("app")

DEFAULT_MODEL = REPO / "assets" / "marian-en-zh-small"
EXAMPLES_TSV = REPO / "assets" / "examples.tsv"
QUEUE_SIZE = 64  # waiting requests beyond those running; more get "busy, try again"
# Gradio's queue otherwise tabulates its event history (up to 10,000 events, in pandas) after every request
# for a monitoring page the app turns off: work and resident memory that grow with the history.
GRADIO_QUEUE_ENV = {"GRADIO_ANALYTICS_MAX_EVENTS": "1", "GRADIO_ANALYTICS_CACHE_FREQUENCY": str(sys.maxsize)}
# Seconds Gradio's queue sleeps between looks while no request is waiting (its own: 1 ms). On a
# small CPU that looking, a thousand times a second, takes the interpreter from the decoder thread
# under load; 10 ms adds at most that to a request's wait.
QUEUE_IDLE_POLL_S = 0.01

__all__ = ["CSS", "Loaded", "build_app", "main"]


def build_app(loaded: Loaded) -> gr.Blocks:
    """The page: a header naming the model and what loaded, then the Compare, Benchmark, Batch
    spot-check and Translate tabs. Every tab's model work shares one slot (concurrency_id "model"),
    except Translate's requests, which have their own ("translate") and are batched by its batcher."""
    names = loaded.names
    if loaded.translator is None:
        loaded.translator = translate_batcher(
            loaded.backends, loaded.batching, default=default_backend(loaded.backends), limits=loaded.limits,
            max_new_tokens=loaded.max_new_tokens, traffic=loaded.traffic)
    heading = model_heading(loaded.manifest)  # "NLLB-200 eng_Latn→zho_Hans", "Marian en→zh"
    with gr.Blocks(title=f"{heading}: PyTorch vs ONNX Runtime") as demo:
        failed = ", ".join(LABELS.get(n, n) for n in loaded.load_errors)
        failed = f" (could not load: {html.escape(failed)}; see their panels)" if failed else ""
        gr.Markdown(
            f"## {html.escape(heading)} · PyTorch vs ONNX Runtime, side by side\n"
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
            translate_tab.build(loaded)
    return demo


def start_queue(demo: gr.Blocks, max_size: int) -> None:
    """The app's queue: `max_size` waiting requests, one at a time per slot unless an event says
    otherwise, no event history kept (`GRADIO_QUEUE_ENV`, read when gradio makes the queue), and
    idle polling every `QUEUE_IDLE_POLL_S`."""
    os.environ.update(GRADIO_QUEUE_ENV)
    demo.queue(max_size=max_size, default_concurrency_limit=1)
    queue = demo._queue  # gradio has no public setting for it; tests/test_app.py checks gradio still reads it
    if not hasattr(queue, "sleep_when_free"):
        logger.warning("gradio's queue has no sleep_when_free: its idle polling stays gradio's own")
        return
    queue.sleep_when_free = QUEUE_IDLE_POLL_S


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


def available_memory() -> int | None:
    """Bytes the system can still give without swapping (MemAvailable); None where unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(export_dir: Path, names: tuple[str, ...], log=print) -> str | None:
    """Say what each chosen backend needs before loading it; the refusal message when they do not
    fit the memory available (None when they fit or it cannot be told)."""
    from backends import SessionConfig, memory_needs

    needs = memory_needs(export_dir, names, cpu=SessionConfig().providers() == ["CPUExecutionProvider"])
    gb = 1e9
    for name, need in needs.items():
        log(f"backend {name}: needs at least {need / gb:.2f} GB (its weights as it holds them)", flush=True)
    total, available = sum(needs.values()), available_memory()
    if available is not None and total > available:
        each = ", ".join(f"{n} {b / gb:.2f} GB" for n, b in needs.items())
        return (f"the chosen backends need at least {total / gb:.2f} GB ({each}) but only {available / gb:.2f} GB "
                "is available: loading them would swap. Choose fewer with --backends (e.g. --backends "
                "pytorch,ort_int8)")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default=os.environ.get("MODEL_ID") or str(DEFAULT_MODEL),
        help=f"model folder ({', '.join(f.title for f in FAMILIES.values())}), hub id, or an export folder "
        "(default: $MODEL_ID, else the embedded model)",
    )
    parser.add_argument("--export-dir", type=Path, default=None, help="where to export (default: exports/<model name>)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="cap per translation (default: model limit)")
    parser.add_argument("--threads", type=int, default=None, help="threads per backend (default: physical cores)")
    parser.add_argument("--examples", type=Path, default=EXAMPLES_TSV, help="TSV with an 'en' column of example inputs")
    parser.add_argument("--queue-size", type=int, default=QUEUE_SIZE, help="waiting requests before 'busy, try again'")
    parser.add_argument(
        "--batch-wait-ms", type=float, default=BatchPolicy.max_wait_ms,
        help="translate: how long a free decoder waits for more requests to join a batch (default: %(default)g)",
    )
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
    parser.add_argument(
        "--src-lang", default=None,
        help="source language code for NLLB/M2M100/mBART-50 models (default: the export's, e.g. eng_Latn, en_XX)",
    )
    parser.add_argument(
        "--tgt-lang", default=None,
        help="target language code, forced as the first token (default: the export's Chinese: zho_Hans, zh, zh_CN)",
    )
    from backends import BACKEND_NAMES

    parser.add_argument(
        "--backends", default=",".join(BACKEND_NAMES),
        help=f"comma-separated backends to load (default: all: {','.join(BACKEND_NAMES)})",
    )
    parser.add_argument(
        "--external", action="append", default=[], metavar="NAME=DIR",
        help="also run an Optimum-layout ONNX export of the same model as backend NAME (repeatable; "
             "DIR may name a variant's encoder file, e.g. DIR/encoder_model_quantized.onnx)",
    )
    args = parser.parse_args(argv)
    from backends.ort_external import parse_external

    try:
        external = parse_external(args.external)
    except ValueError as e:
        parser.error(str(e))
    names = tuple(n.strip() for n in args.backends.split(",") if n.strip())
    unknown = [n for n in names if n not in BACKEND_NAMES]
    if unknown or not names:
        parser.error(f"--backends: unknown {', '.join(unknown) or '(none given)'}; expected any of: {', '.join(BACKEND_NAMES)}")
    limit_arenas()  # before gradio's worker threads allocate: see backends/memory.py
    try:
        limits = RequestLimits(args.max_chars, args.max_segments, args.max_seconds, max_beams=args.max_beams)
        batching = BatchPolicy(MAX_REQUESTS, max_wait_ms=args.batch_wait_ms)
    except ValueError as e:
        parser.error(str(e))
    # Our loggers at INFO; third-party ones (httpx, the quantizer's root logging) at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name in ("app", "backends", "export"):
        logging.getLogger(name).setLevel(logging.INFO)

    from backends import SessionConfig, try_load_backends

    try:
        export_dir, note = prepare(args.model, args.export_dir, args.threads)
        refusal = check_memory(export_dir, names)
        if refusal:
            print(f"error: {refusal}", file=sys.stderr)
            return 2
        backends, errors = try_load_backends(
            export_dir, names, session=SessionConfig(threads=args.threads), src_lang=args.src_lang,
            tgt_lang=args.tgt_lang, external=external,
        )
        examples = read_examples(args.examples)
    except Exception as e:  # nothing can run without an export, a manifest and a tokenizer
        print(f"error: cannot start with model {args.model!r}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    for name, err in errors.items():
        logger.warning("backend %s failed to load (shown in its panel): %s", name, err)
    loaded = Loaded(backends, errors, args.model, export_dir, note, args.max_new_tokens, examples, limits=limits,
                    batching=batching)
    demo = build_app(loaded)
    start_queue(demo, args.queue_size)
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME") or None,
        server_port=int(os.environ.get("GRADIO_SERVER_PORT") or 7860),
        css=CSS + locate_render.CSS,
        theme=gr.themes.Soft(),
        show_error=True,
        enable_monitoring=False,
        prevent_thread_lock=True,  # the HTTP route joins the server launch made, then the process waits
    )
    # POST /translate (service/http_api.py): as many in flight as the Gradio API takes, running and queued.
    AppTranslateRoute(loaded.translator.submit, MAX_REQUESTS + args.queue_size).mount(demo.app)
    demo.block_thread()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
