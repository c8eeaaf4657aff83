"""python -m bench quality: does each ORT backend translate exactly as PyTorch does, and how well?

Per backend, over a TSV of `en` (and `zh` references): the share of sentences whose token ids are
identical to the reference backend's (PyTorch), where the others first diverge, BLEU
(sacrebleu, tokenize="zh") and chrF against the references and against PyTorch's output, and
every differing sentence with both outputs. All backends share one process here; speed is
`python -m bench speed`'s job. The comparison is the app's spot-check's (`service.spotcheck`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from backends import REFERENCE
from corpus import Pair
from service.environment import environment
from service.spotcheck import compare_outputs

from .data import default_backends


def translate_all(backend, sentences: list[str], batch_size: int, max_new_tokens: int | None) -> tuple[list, float]:
    """Translations in input order, run in length-sorted batches; (translations, seconds)."""
    order = sorted(range(len(sentences)), key=lambda i: (backend.tokenizer.count_tokens(sentences[i]), i))
    out = [None] * len(sentences)
    start = time.perf_counter()
    for k in range(0, len(order), batch_size):
        idx = order[k : k + batch_size]
        for i, t in zip(idx, backend.translate([sentences[i] for i in idx], max_new_tokens=max_new_tokens, top_k=1)):
            out[i] = t
    return out, time.perf_counter() - start


def run(export_dir: Path, pairs: list[Pair], names: list[str] | None = None, threads: int = 2,
        batch_size: int = 16, max_new_tokens: int = 256, log=print) -> dict:
    from backends import SessionConfig, load_backends, load_manifest

    skipped = {}
    if names is None:
        names, skipped = default_backends(load_manifest(export_dir))
    if REFERENCE not in names:
        names = [REFERENCE, *names]
    backends = load_backends(export_dir, names=tuple(names), session=SessionConfig(threads=threads))
    sentences, references = [p.en for p in pairs], [p.zh for p in pairs]
    outputs, seconds = {}, {}
    for name, backend in backends.items():
        log(f"{name}: translating {len(sentences)} sentences ...")
        outputs[name], seconds[name] = translate_all(backend, sentences, batch_size, max_new_tokens)
        backend.close()
    per_backend = compare_outputs(outputs, sentences, references, REFERENCE)
    for name, entry in per_backend.items():
        entry["seconds"] = seconds[name]
        entry["info"] = backends[name].info
        entry["hit_max_new_tokens"] = sum(t.stop_reason == "max_new_tokens" for t in outputs[name])
    env = environment(threads)
    env["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    return {
        "kind": "quality",
        "model": {"export": str(export_dir), "source": backends[REFERENCE].manifest.data["source_model"]},
        "environment": env,
        "sentences": len(sentences),
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "reference": REFERENCE,
        "backends": per_backend,
        "not_run": skipped,
        "outputs": {name: [t.text for t in outs] for name, outs in outputs.items()},
    }
