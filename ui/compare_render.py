"""The Compare tab's HTML: plain functions from `compare` JSON to what one output component shows.

No gradio here and no model: each function takes the JSON the `compare` API returns
(service/compare.py). The latency table and the figures are in `compare_figures`.
"""

from __future__ import annotations

import html
from typing import Any

from backends import REFERENCE
from backends.registry import COLOURS as BACKEND_COLOURS
from backends.registry import LABELS as BACKEND_LABELS
from service.fmt import ms, prob

# How every screen names and colours a backend: the registry's, so a chart and a table agree.
LABELS = BACKEND_LABELS
COLORS = BACKEND_COLOURS

CSS = """
.panel-title { font-weight: 600; font-size: 1.05em; margin-bottom: 2px; }
.panel-info { color: var(--body-text-color-subdued); font-size: 0.82em; line-height: 1.35; }
.stats { font-size: 0.85em; }
.stats table { border-collapse: collapse; width: 100%; margin: 4px 0 2px 0; border: none !important; }
.stats table tr, .stats table th, .stats table td { border: none !important; }
.stats table th, .stats table td { padding: 1px 6px !important; text-align: right; }
.stats table th { font-weight: 400; color: var(--body-text-color-subdued); font-size: 0.9em; }
.stats table td { font-variant-numeric: tabular-nums; font-weight: 600; }
.state-ok { color: #2ca02c; font-weight: 600; }
.state-err { color: #d62728; font-weight: 600; white-space: pre-wrap; }
.state-wait { color: var(--body-text-color-subdued); }
.state-warn { color: #b35900; font-weight: 600; }
table.segments { border-collapse: collapse; font-size: 0.88em; width: 100%; }
table.segments th, table.segments td { border: 1px solid var(--border-color-primary); padding: 2px 6px;
                                       vertical-align: top; text-align: left; }
table.segments td.num { color: var(--body-text-color-subdued); text-align: right; }
.chunk { font-size: 0.8em; padding: 0 4px; border-radius: 3px; background: #ffd9a8; color: #000; }
.div-row { margin: 6px 0 12px 0; }
.div-head { font-weight: 600; margin-bottom: 3px; }
.tokgrid { display: flex; flex-wrap: wrap; gap: 3px; }
.tokcol { display: flex; flex-direction: column; border-radius: 4px; overflow: hidden;
          border: 1px solid var(--border-color-primary); font-family: var(--font-mono); font-size: 0.82em; }
.tokcol span { padding: 1px 5px; min-height: 1.3em; white-space: pre; }
.tokcol .ref { background: var(--background-fill-secondary); color: var(--body-text-color-subdued); }
.tokcol.changed { border-color: #e07b00; } .tokcol.changed span.tok { background: #ffd9a8; color: #000; }
.tokcol.extra { border-color: #d62728; } .tokcol.extra span.tok { background: #ffc2c2; color: #000; }
.tokcol.missing { border-color: #d62728; border-style: dashed; }
.tokcol.first { outline: 2px solid #d62728; outline-offset: 1px; }
table.first-div { border-collapse: collapse; font-size: 0.85em; margin-top: 4px; }
table.first-div th, table.first-div td { border: 1px solid var(--border-color-primary); padding: 2px 8px; }
details.nbest { margin-top: 3px; font-size: 0.85em; }
table.nbest { border-collapse: collapse; width: 100%; }
table.nbest td, table.nbest th { text-align: left !important; padding: 1px 4px !important; }
table.nbest td.hyp { font-weight: 400; white-space: normal; }
table.nbest tr.ref-best td { background: #ffe9cc; color: #000; }
.legend span { padding: 0 5px; border-radius: 3px; margin-right: 6px; font-size: 0.85em; color: #000; }
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _piece(token: str | None) -> str:
    # sentencepiece marks a word start with ▁; show it as a visible middle dot-space
    return "" if token is None else token.replace("▁", "·")


def info_html(info: dict[str, Any]) -> str:
    if not info:
        return ""
    return (
        f"<div class='panel-info'>ran on: {_e(info.get('runtime', ''))} · {_e(info.get('provider', ''))} · "
        f"{_e(info.get('precision', ''))} · {_e(info.get('threads', ''))} threads · "
        f"graph: {_e(info.get('graph', ''))}{_kept_html(info.get('kept_in_float'))}{_provenance_html(info.get('source'))}</div>"
    )


def _kept_html(kept: str | None) -> str:
    """What a low-precision graph computes in fp32 instead, as its export measured and recorded it."""
    return f"<br>{_e(kept)}" if kept else ""


def _provenance_html(source: dict | None) -> str:
    """An external export's origin, file by file: where a user's own export came from."""
    if not isinstance(source, dict) or not source.get("files"):
        return ""
    rows = "".join(
        f"<br>{_e(f['file'])}: {f['bytes'] / 2**20:,.1f} MB, sha256 {_e((f.get('sha256') or '')[:12])}…, "
        f"opset {_e(f.get('opset'))}, {_e(f.get('producer') or 'producer unknown')}, {_e(f.get('precision'))}"
        for f in source["files"]
    )
    return f"<br>from {_e(source.get('folder', ''))} ({_e(source.get('layout', ''))}){rows}"


def panel_html(name: str, result: dict | None, state: str, info: dict | None) -> str:
    """The block under one backend's translation: verdict, token count, timings, what it ran on."""
    foot = info_html(info or {})
    if result is None:
        return f"<div class='stats'><span class='state-wait'>{_e(state)}</span>{foot}</div>"
    if result.get("error"):
        return f"<div class='stats'><div class='state-err'>error: {_e(result['error'])}</div>{foot}</div>"
    t, runs = result["timings_ms"], result.get("runs") or {}
    div = result.get("divergence")
    if name == REFERENCE:
        verdict = "<span class='state-ok'>reference</span>"
    elif div and "error" in div:
        verdict = f"<span class='state-err'>{_e(div['error'])}</span>"
    elif div and div["identical"]:
        verdict = "<span class='state-ok'>identical to PyTorch</span>"
    elif div:
        where = f" in segment {div['segment'] + 1}" if div.get("segments", 1) > 1 else ""
        verdict = f"<span class='state-err'>diverges from PyTorch{where} at step {div['first']['step']}</span>"
    else:
        verdict = ""
    n_seg = len(result.get("segments") or [])
    verdict += f" · {len(result['token_ids'])} tokens" + (f" in {n_seg} segments" if n_seg > 1 else "")
    if runs.get("n", 1) > 1:
        verdict += f" · median of {runs['n'] - 1} warm runs (run 1, cold: {ms(runs['cold_ms'])} ms)"
    keys = [
        ("tokenize", "tokenize"), ("encode", "encode"), ("first_token", "first token"),
        ("per_token", "per token"), ("total", "total"),
    ]  # fmt: skip
    head = "".join(f"<th>{label}</th>" for _, label in keys)
    cells = "".join(f"<td class='num'>{ms(t.get(k))}</td>" for k, _ in keys)
    # Degenerate output (a repeated token, no eos before the cap) is shown, not hidden in the JSON.
    warn = "".join(f"<div class='state-warn'>⚠ {_e(w)}</div>" for w in result.get("warnings") or [])
    return (
        f"<div class='stats'><div>{verdict}</div>{warn}"
        f"<table><tr>{head}<th></th></tr><tr>{cells}<td>ms</td></tr></table>{nbest_html(name, result)}{foot}</div>"
    )


def nbest_html(name: str, result: dict) -> str:
    """A beam's final hypotheses with their scores, and where PyTorch's best one ranks among them.

    Shown for the segment the divergence view details (segment 0 when every segment agrees)."""
    segs = result.get("segments") or []
    if not segs:
        return ""
    focus = (result.get("divergence") or {}).get("segment", 0) or 0
    seg = segs[min(focus, len(segs) - 1)]
    hyps = seg.get("hypotheses") or []
    if len(hyps) < 2:
        return ""
    rank = seg.get("reference_rank")
    if name == REFERENCE:
        where = ""
    elif rank is None:
        where = "<span class='state-err'>PyTorch's best hypothesis is not in this beam</span>"
    elif rank == 0:
        where = "<span class='state-ok'>PyTorch's best is this beam's best too</span>"
    else:
        where = f"<span class='state-err'>PyTorch's best ranks #{rank + 1} here</span>"
    seg_note = f" (segment {focus + 1})" if len(segs) > 1 else ""
    rows = "".join(
        f"<tr class='{'ref-best' if i == rank and name != REFERENCE else ''}'><td>#{i + 1}</td>"
        f"<td class='num'>{h['score']:.4f}</td><td class='hyp'>{_e(h['text'])}</td></tr>"
        for i, h in enumerate(hyps)
    )
    return (
        f"<details class='nbest'><summary>{len(hyps)}-best{seg_note} {where}</summary>"
        f"<table class='nbest'><tr><th>rank</th><th>score</th><th>hypothesis</th></tr>{rows}</table></details>"
    )


def decoding_md(decoding: dict) -> str:
    """One line naming the decoding a request ran, and whether the model's own config chose it."""
    if not decoding:
        return ""
    source = "the model's own generation config" if decoding.get("requested_num_beams") is None else "chosen"
    if decoding["num_beams"] == 1:
        what = "greedy search"
    else:
        what = (
            f"beam search, {decoding['num_beams']} beams, length penalty {decoding['length_penalty']:g}, "
            f"early stopping {decoding['early_stopping']}"
        )
    extra = []
    if decoding.get("no_repeat_ngram_size"):
        extra.append(f"no repeated {decoding['no_repeat_ngram_size']}-grams")
    if decoding.get("repetition_penalty", 1.0) != 1.0:
        extra.append(f"repetition penalty {decoding['repetition_penalty']:g}")
    return f"Decoding: {what}{'; ' + ', '.join(extra) if extra else ''} ({source})."


def _first_table(first: dict) -> str:
    ref, oth = first.get("reference"), first.get("backend")
    if not ref or not oth:
        return f"<div>lengths differ from step {first['step']}</div>"

    def row(label, key, fmt):
        return f"<tr><th>{label}</th><td>{fmt(ref.get(key))}</td><td>{fmt(oth.get(key))}</td></tr>"

    tok = lambda x: f"<code>{_e(_piece(x))}</code>"  # noqa: E731
    return (
        f"<table class='first-div'><tr><th>step {first['step']}</th><th>PyTorch</th><th>this backend</th></tr>"
        + row("chosen token", "token", tok)
        + row("its probability", "prob", prob)
        + row("runner-up", "runner_up", tok)
        + row("runner-up probability", "runner_up_prob", prob)
        + row("top-1 − top-2 margin (logit)", "margin_logprob", lambda x: "–" if x is None else f"{x:.4f}")
        + row("p(the other backend's token)", "other_token_prob", lambda x: "not in top-5" if x is None else prob(x))
        + "</table>"
    )


def divergence_html(out: dict) -> str:
    """Each backend's tokens aligned under the reference's: differing ones highlighted."""
    blocks = [
        "<div class='legend'>PyTorch tokens on top, this backend's below · "
        "<span style='background:#ffd9a8'>changed</span><span style='background:#ffc2c2'>extra</span>"
        "<span style='border:1px dashed #d62728'>missing</span>"
        "<span style='outline:2px solid #d62728'>first divergence</span></div>"
    ]
    ref = out["backends"].get(REFERENCE, {})
    if ref.get("error"):
        blocks.append(f"<div class='state-err'>PyTorch (reference): {_e(ref['error'])}</div>")
    for name, b in out["backends"].items():
        if name == REFERENCE:
            continue
        label = _e(LABELS.get(name, name))
        d = b.get("divergence")
        head = f"<div class='div-row'><div class='div-head'>{label}</div>"
        if b.get("error"):
            blocks.append(f"{head}<div class='state-err'>error: {_e(b['error'])}</div></div>")
            continue
        if not d or "error" in d:
            blocks.append(f"{head}<div class='state-wait'>{_e(d['error'] if d else 'not compared')}</div></div>")
            continue
        first_step = d["first"]["step"] if d["first"] else None
        cols = []
        for a in d["alignment"]:
            step = a["step"] if a["step"] is not None else a["ref_step"]
            cls = a["op"] + (" first" if first_step is not None and step == first_step else "")
            ref_tok, tok = _e(_piece(a["ref"])), _e(_piece(a["token"]))
            cols.append(
                f"<div class='tokcol {cls}' title='step {step}'>"
                f"<span class='ref'>{ref_tok}</span><span class='tok'>{tok}</span></div>"
            )
        tf = d.get("teacher_forced") or {}
        if "error" in tf:
            forced = f"teacher-forced: <span class='state-err'>{_e(tf['error'])}</span>"
        elif tf:
            not_top, differs = tf["steps_not_argmax"], tf.get("steps_top1_differs", [])
            ranks = f"PyTorch's token is not top-1 at steps {not_top}" if not_top else "PyTorch's token is top-1 at every step"
            top1 = f"top-1 differs from PyTorch's at steps {differs}" if differs else "the same top-1 as PyTorch at every step"
            forced = (
                f"teacher-forced on PyTorch's tokens: max |Δlogit| {tf['max_abs_dlogit_overall']:.2e}; {top1}; {ranks}"
            )
        else:
            forced = ""
        n_seg = d.get("segments", 1)
        if d["identical"] and n_seg > 1:
            summary = (
                f"<span class='state-ok'>identical</span> in all {n_seg} segments · segment 1 shown, "
                f"{d['matching']}/{d['reference_length']} tokens match"
            )
        elif d["identical"]:
            summary = f"<span class='state-ok'>identical</span> · {d['matching']}/{d['reference_length']} tokens match"
        else:
            # Several segments: the first one that differs is the one detailed below.
            where = (
                f" in segment {d['segment'] + 1} of {n_seg} ({d['segments_identical']} identical)"
                if n_seg > 1
                else ""
            )
            summary = (
                f"<span class='state-err'>diverges{where} at step {first_step}</span> · {d['matching']} of "
                f"{len(d['alignment'])} aligned tokens match ({d['agreement']:.0%})"
            )
        first = _first_table(d["first"]) if d["first"] else ""
        blocks.append(
            f"<div class='div-row'><div class='div-head'>{label}: {summary}</div>"
            f"<div class='panel-info'>{forced}</div><div class='tokgrid'>{''.join(cols)}</div>{first}</div>"
        )
    return "".join(blocks)


def _segment_text(seg: dict) -> str:
    if seg["non_finite_steps"]:
        return f"<span class='state-err'>non-finite logits (NaN/Inf) at step {seg['non_finite_steps'][0]}</span>"
    return _e(seg["text"] or "–")


SEGMENTS_OPEN = 12  # a longer split starts folded: the panels above already hold the joined text


def segments_html(out: dict) -> str:
    """How the input was split, and each segment's output: PyTorch's, and any backend that differs."""
    segs = out.get("segments") or []
    if len(segs) < 2:
        return ""
    chunked = sum(s["chunked"] for s in segs)
    note = f", {chunked} of them pieces of a sentence over the model's source limit" if chunked else ""
    ref = out["backends"].get(REFERENCE) or {}
    others = [(n, b) for n, b in out["backends"].items() if n != REFERENCE and b.get("segments")]
    rows = []
    for i, seg in enumerate(segs):
        source = _e(seg["text"]) + (" <span class='chunk'>chunk</span>" if seg["chunked"] else "")
        ref_out = _segment_text(ref["segments"][i]) if ref.get("segments") else "–"
        # Not identical, or not compared (no reference): the backend's own output is listed.
        differ = [
            f"<b>{_e(LABELS.get(n, n))}</b>: {_segment_text(b['segments'][i])}"
            for n, b in others
            if not ((b["segments"][i].get("divergence") or {}).get("identical", False))
        ]
        if not others:
            verdict = "<span class='state-wait'>–</span>"
        elif differ:
            verdict = "<br>".join(differ)
        else:
            verdict = "<span class='state-ok'>identical</span>"
        rows.append(
            f"<tr><td class='num'>{i + 1}</td><td>{source}</td><td>{ref_out}</td><td>{verdict}</td></tr>"
        )
    opened = " open" if len(segs) <= SEGMENTS_OPEN else ""
    return (
        f"<details{opened}><summary><b>Input split into {len(segs)} segments</b>{note}; every backend translated "
        "them as a batch and joined the outputs in order.</summary>"
        "<table class='segments'><tr><th>#</th><th>source</th><th>PyTorch</th><th>ORT backends vs PyTorch</th></tr>"
        + "".join(rows)
        + "</table></details>"
    )
