"""The app's Batch spot-check: each sentence through every loaded backend, compared with the reference.

`spot_check` checks the whole input first (count, empty sentences, references, each sentence's
length against the model's source limit), then runs every backend at batch 1 in this process:
per backend, agreement with PyTorch's token ids and where the others first diverge, BLEU/chrF
against the references and against PyTorch's output, latency percentiles, the translations.
`compare_outputs` is that comparison alone; `python -m bench quality` uses it too.
"""

from __future__ import annotations

import os
import time

from backends import REFERENCE
from runtime.protocol import percentiles

from . import metrics
from .environment import environment

SPOT_CHECK_LIMIT = 200  # sentences; every backend at batch 1 takes about a minute for 200 on 2 cores
SPOT_CHECK_TIMED = (
    "Wall-clock time of one translate call per sentence at batch 1 (time.perf_counter): tokenization, "
    "encoder, every decoder step and detokenization, with the per-step top-1 score the app keeps. One "
    "untimed warm-up call per backend first. All backends share one process (the app's), one after the other."
)


def compare_outputs(outputs: dict[str, list], sentences: list[str], references: list[str | None], reference: str) -> dict:
    """Per backend: agreement with `reference`, BLEU/chrF vs references and vs the reference's texts,
    and the differing sentences. `outputs`: name -> list of Translation (or anything with token_ids, text)."""
    ref = outputs[reference]
    ref_texts = [t.text for t in ref]
    have_refs = bool(references) and all(references)
    per_backend = {}
    for name, outs in outputs.items():
        a = metrics.agreement([t.token_ids for t in outs], [t.token_ids for t in ref])
        texts = [t.text for t in outs]
        entry = {
            "agreement": a,
            "identical_text": sum(x == y for x, y in zip(texts, ref_texts)),
            "vs_references": metrics.bleu_chrf(texts, references) if have_refs else None,
            "vs_reference_backend": metrics.bleu_chrf(texts, ref_texts) if name != reference else None,
            "differing": [
                {"index": i, "en": sentences[i], "first_divergence": step, "output": texts[i],
                 "reference_output": ref_texts[i], "reference": references[i] if have_refs else None}
                for i, step in enumerate(a["first_divergence_steps"]) if step is not None
            ],
        }
        per_backend[name] = entry
    if have_refs:  # the number a user needs before shipping an approximate backend
        base = per_backend[reference]["vs_references"]
        for entry in per_backend.values():
            q = entry["vs_references"]
            q["bleu_delta"] = round(q["bleu"] - base["bleu"], 2)
            q["chrf_delta"] = round(q["chrf"] - base["chrf"], 2)
    return per_backend


def spot_check(backends: dict, sentences: list[str], references: list[str] | None = None,
               max_new_tokens: int | None = 256, progress=None, not_run: dict[str, str] | None = None) -> dict:
    """For the app's Batch spot-check tab: each sentence through each loaded backend at batch 1.

    Returns, per backend: agreement with PyTorch (or the first backend when PyTorch is not loaded),
    BLEU/chrF against `references` when given (one per sentence), batch-1 latency percentiles (wall
    time of each translate call, no warm-up beyond one call per backend) and the translations.
    Every input is checked before any sentence is translated: the count, empty sentences, and each
    sentence's length against the model's source limit (all too-long ones named at once).
    `max_new_tokens` None: the model's own limit. `not_run` names backends that could not take part.
    """
    sentences = [s.strip() for s in sentences]
    if not sentences or not all(sentences):
        raise ValueError("give at least one sentence, and no empty lines")
    if len(sentences) > SPOT_CHECK_LIMIT:
        raise ValueError(f"at most {SPOT_CHECK_LIMIT} sentences per spot-check, got {len(sentences)}")
    if references is not None and len(references) != len(sentences):
        raise ValueError(f"{len(references)} references for {len(sentences)} sentences")
    if references is not None and not all(r and r.strip() for r in references):
        missing = [i + 1 for i, r in enumerate(references) if not (r and r.strip())]
        raise ValueError(f"sentence(s) {_numbers(missing)} have no reference; give one for every sentence, or none")
    if not backends:
        raise ValueError("no backend loaded")
    first = next(iter(backends.values()))
    limit = first.manifest.max_source_tokens
    too_long = [(i + 1, n) for i, s in enumerate(sentences) if (n := first.tokenizer.count_tokens(s)) > limit]
    if too_long:
        listed = ", ".join(f"{i} ({n} tokens)" for i, n in too_long[:10])
        more = f" and {len(too_long) - 10} more" if len(too_long) > 10 else ""
        raise ValueError(f"the model reads at most {limit} source tokens; too long: sentence {listed}{more}. "
                         "Split them into shorter sentences")
    reference = REFERENCE if REFERENCE in backends else next(iter(backends))
    outputs, latency = {}, {}
    total = len(backends) * len(sentences)
    done = 0
    env = environment(first.info.get("threads") or 1)  # load average at the start
    for name, backend in backends.items():
        if progress is not None:
            progress(done / total, f"{name}: warm-up")
        backend.translate([sentences[0]], max_new_tokens=max_new_tokens, top_k=1)  # warm-up
        outs, times = [], []
        for s in sentences:
            start = time.perf_counter()
            [t] = backend.translate([s], max_new_tokens=max_new_tokens, top_k=1)
            times.append((time.perf_counter() - start) * 1e3)
            outs.append(t)
            done += 1
            if progress is not None:
                progress(done / total, f"{name}: {len(outs)}/{len(sentences)}")
        outputs[name], latency[name] = outs, percentiles(times)
    env["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    per_backend = compare_outputs(outputs, sentences, references or [None] * len(sentences), reference)
    for name, entry in per_backend.items():
        entry["latency_ms"] = latency[name]
        entry["translations"] = [t.text for t in outputs[name]]
        entry["hit_max_new_tokens"] = sum(t.stop_reason == "max_new_tokens" for t in outputs[name])
        entry["info"] = dict(backends[name].info)
    return {"kind": "spot_check", "reference": reference, "sentences": sentences, "references": references,
            "model": {"export": str(first.manifest.root), "source": first.manifest.data["source_model"]},
            "max_new_tokens": max_new_tokens or first.manifest.max_new_tokens,
            "what_is_timed": SPOT_CHECK_TIMED, "environment": env, "backends": per_backend,
            "not_run": dict(not_run or {})}


def _numbers(items: list[int], shown: int = 10) -> str:
    return ", ".join(map(str, items[:shown])) + (f" and {len(items) - shown} more" if len(items) > shown else "")
