"""The Batch spot-check tab: a list of sentences through every loaded backend, compared with PyTorch.

The input (pasted or uploaded) is read by `service.inputs`; the work is
`service.spotcheck.spot_check`, which translates each sentence at batch 1 with each backend and
measures agreement, BLEU/chrF and latency. This module only lays out, renders its result and
writes it as a downloadable JSON file.
The run takes the app's one model-run-at-a-time slot (concurrency_id "model").
"""

from __future__ import annotations

import datetime as dt
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr

from service import inputs
from service.fmt import ms, num, signed
from service.reports import provenance
from service.spotcheck import SPOT_CHECK_LIMIT, spot_check

from .machine import load_warning

SUMMARY_HEADERS = [
    "backend", "identical tokens", "first divergence: step (sentences)", "BLEU vs refs (Δ)", "chrF vs refs (Δ)",
    "BLEU vs ref backend", "chrF vs ref backend", "p50 ms", "p90 ms", "p99 ms", "hit length cap",
]  # fmt: skip
SUMMARY_WIDTHS = ["14%", "10%", "11%", "10%", "10%", "9%", "9%", "7%", "7%", "7%", "6%"]
DIFF_HEADERS = ["backend", "#", "step", "English", "ref backend's output", "this backend's output", "reference"]
SHOWN_STEPS = 8  # divergence steps listed in one cell before "…"


@dataclass
class SpotCheckView:
    status: str
    summary: list[list[Any]] = field(default_factory=list)
    differing: list[list[Any]] = field(default_factory=list)
    json_path: Path | None = None
    result: dict | None = None


def _steps(histogram: dict) -> str:
    if not histogram:
        return "none"
    items = [f"{step} ({count})" for step, count in sorted(histogram.items(), key=lambda kv: int(kv[0]))]
    return ", ".join(items[:SHOWN_STEPS]) + (" …" if len(items) > SHOWN_STEPS else "")


def headers(reference: str) -> list[str]:
    return [h.replace("ref backend", reference) for h in SUMMARY_HEADERS]


def _score(q: dict, key: str) -> str:
    if not q:
        return "–"
    delta = q.get(f"{key}_delta")
    return num(q[key], 2) + ("" if delta is None else f" ({signed(delta)})")


def summary_rows(result: dict) -> list[list[Any]]:
    """One row per backend; Δ: the difference from the reference backend's score against the references."""
    rows = []
    for name, b in result["backends"].items():
        a, lat = b["agreement"], b["latency_ms"]
        q, qr = b.get("vs_references") or {}, b.get("vs_reference_backend") or {}
        is_ref = name == result["reference"]
        rows.append([
            name,
            f"{a['identical']}/{a['n']} ({a['identical_share']:.0%})",
            "– (reference)" if is_ref else _steps(a["first_divergence_histogram"]),
            _score(q, "bleu"), _score(q, "chrf"),
            "–" if is_ref else num(qr.get("bleu"), 2), "–" if is_ref else num(qr.get("chrf"), 2),
            ms(lat["p50"]), ms(lat["p90"]), ms(lat["p99"]),
            b["hit_max_new_tokens"],
        ])  # fmt: skip
    return rows


def differing_rows(result: dict) -> list[list[Any]]:
    rows = []
    for name, b in result["backends"].items():
        for d in b["differing"]:
            rows.append([name, d["index"] + 1, d["first_divergence"], d["en"], d["reference_output"], d["output"],
                         d.get("reference") or "–"])
    return rows


def summary_md(result: dict, shown_from: str) -> str:
    e, ref = result["environment"], result["reference"]
    n, refs = len(result["sentences"]), result.get("references")
    diff = sum(len(b["differing"]) for b in result["backends"].values())
    lines = [
        f"**{n} sentences** from {shown_from} through {len(result['backends'])} backends, each at batch 1, "
        f"compared with `{ref}`; outputs to eos, capped at {result['max_new_tokens']} tokens. "
        + ("References given: BLEU (sacrebleu, tokenize=\"zh\") and chrF against them; Δ is the difference "
           f"from `{ref}`'s score." if refs else "No references (a .tsv or a pasted table with a `zh` column "
           "gives them): quality is measured against "
           f"`{ref}`'s output only."),
        f"{diff} of the other backends' {n * (len(result['backends']) - 1)} outputs differ from `{ref}`'s"
        + (": listed below with both translations." if diff else "."),
        f"Latency: {result['what_is_timed']} Few sentences make p99 close to the maximum.",
        f"{e['date_utc']} · {e['cpu']}, {e['threads']} threads · load average "
        f"{e.get('load_average_1m_at_start')} at start, {e.get('load_average_1m_at_end', '–')} at end",
    ]
    if warning := load_warning(e):
        lines.append(f"**{warning}**")
    for name, b in result["backends"].items():
        if origin := provenance(b.get("info") or {}):
            lines.append(f"`{name}`: {origin}")
    for name, why in result.get("not_run", {}).items():
        lines.append(f"`{name}` not run: {why}")
    return "  \n".join(lines)


def write_json(result: dict) -> Path:
    """The whole result as a JSON file for the download button; gradio serves it from its cache."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = Path(tempfile.mkdtemp(prefix="spot-check-")) / f"spot-check-{stamp}.json"
    path.write_text(json.dumps(result, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


def run(loaded, text: str | None, file: str | None, progress=None) -> SpotCheckView:
    """Read the input, run every loaded backend over it, render; a bad input is a message."""
    try:
        given = inputs.read(text, file)
        not_run = {name: f"failed to load in the app: {err}" for name, err in loaded.load_errors.items()}
        result = spot_check(loaded.backends, given.en, references=given.zh, max_new_tokens=loaded.max_new_tokens,
                            progress=progress, not_run=not_run)
    except ValueError as e:  # bad input (InputError is one): said in the status, nothing runs
        return SpotCheckView(f"⚠️ **{e}**")
    result["source"] = given.source
    return SpotCheckView(
        status=summary_md(result, given.source),
        summary=summary_rows(result),
        differing=differing_rows(result),
        json_path=write_json(result),
        result=result,
    )


# ---------------------------------------------------------------------------------------------
# Layout and events


def build(loaded) -> None:
    """The tab, inside the caller's gr.Tabs(); its run shares the "model" concurrency slot."""
    first = next(iter(loaded.backends.values()), None)
    source_limit = f"{first.manifest.max_source_tokens} source tokens" if first else "the model's source-token limit"
    with gr.Tab("Batch spot-check", id="spot-check", elem_id="tab-spotcheck"):
        gr.Markdown(
            "### Batch spot-check\nEvery loaded backend translates each sentence (batch 1); per backend: how many "
            "outputs are token-identical to PyTorch's and where the others first diverge, BLEU and chrF (against "
            "your references when given, and against PyTorch's output), and latency percentiles. "
            f"**Limits:** up to {SPOT_CHECK_LIMIT} sentences, each within {source_limit}; files "
            f"up to {inputs.MAX_FILE_BYTES / 1e6:.0f} MB, `.txt` (one sentence per line) or `.tsv` (a header row "
            "naming `en`, and `zh` for references). Blank lines are skipped; over a limit nothing runs."
        )
        with gr.Row(equal_height=True):
            text = gr.Textbox(
                label="sentences, one per line (or a pasted table with a header row: en<TAB>zh)",
                lines=8, max_lines=20, scale=3, elem_id="spot-text",
            )
            file = gr.File(
                label="or upload .txt / .tsv", file_types=list(inputs.FILE_TYPES), type="filepath", scale=1,
                elem_id="spot-file",
            )
        go = gr.Button("Run spot-check", variant="primary", elem_id="spot-run")
        status = gr.Markdown("", elem_id="spot-status")
        summary = gr.Dataframe(
            headers=SUMMARY_HEADERS, interactive=False, wrap=True, elem_id="spot-summary",
            label="per backend (Δ: difference from the reference backend's score)", show_search="none",
            column_widths=SUMMARY_WIDTHS,
        )
        download = gr.DownloadButton(
            "Download the full report (JSON)", value=None, interactive=False, elem_id="spot-download", size="md",
        )
        gr.Markdown("#### Sentences where a backend differs from the reference backend")
        differing = gr.Dataframe(
            headers=DIFF_HEADERS, interactive=False, wrap=True, elem_id="spot-differing",
            label="every differing output, with both translations", show_search="search",
            column_widths=["10%", "4%", "5%", "27%", "18%", "18%", "18%"],
        )

    def on_run(text_in: str, file_in: str | None, progress=gr.Progress()) -> tuple:
        v = run(loaded, text_in, file_in, progress=progress)
        if v.result is None:
            return v.status, None, gr.DownloadButton(value=None, interactive=False), None
        ref = v.result["reference"]
        return (
            v.status,
            {"headers": headers(ref), "data": v.summary},
            gr.DownloadButton(value=str(v.json_path), interactive=True),
            {"headers": [h.replace("ref backend", ref) for h in DIFF_HEADERS], "data": v.differing},
        )

    go.click(
        on_run, inputs=[text, file], outputs=[status, summary, download, differing], concurrency_limit=1,
        concurrency_id="model", api_visibility="private", show_progress="full",
    )
