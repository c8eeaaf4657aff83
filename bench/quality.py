"""python -m bench quality: does each ORT backend translate exactly as PyTorch does, and how well?

Per backend, over a corpus of `en` sentences with `zh` references (TSV as corpus.py reads it,
JSONL or Parquet; a file or a folder of them): the share of sentences whose token ids are
identical to the reference backend's (PyTorch), where the others first diverge, BLEU
(sacrebleu, tokenize="zh") and chrF against the references and against PyTorch's output, and
every differing sentence with both outputs. The comparison is the app's spot-check's
(`service.spotcheck.compare_outputs`), summed shard by shard by the corpus engine (`bench.engine`):
in this process (`--engine local`) or on a Ray cluster (`--engine ray`), with the same results.
Per-sentence results are in `--out/shards/*.parquet`. Speed is `python -m bench speed`'s job.
"""

from __future__ import annotations

import os
from pathlib import Path

from backends import REFERENCE
from service.environment import environment

from .data import default_backends
from .engine import EngineOptions, run_corpus


def run(export_dir: Path, input_path, out: Path, names: list[str] | None = None,
        options: EngineOptions = EngineOptions(), limit: int | None = None, max_new_tokens: int = 256,
        decode: dict | None = None, log=print, on_shard=None, external: dict | None = None) -> dict:
    """Every backend over the corpus; the quality results (results.json's layout).

    `decode`: further `Backend.translate` keyword arguments (num_beams, ...), passed through.
    `external`: {NAME: DIR} of Optimum-layout exports of the same model (backends/ort_external.py),
    run as backends NAME after the built-in ones."""
    from backends import check_external, load_manifest
    from backends.ort_external import find_layout

    external = {n: os.path.abspath(p) for n, p in check_external(external).items()}
    for path in external.values():
        find_layout(path)  # a folder that holds no export fails before the corpus is read

    manifest = load_manifest(export_dir)
    skipped = {}
    if names is None:
        names, skipped = default_backends(manifest)
    if REFERENCE not in names:
        names = [REFERENCE, *names]
    clash = sorted({"max_new_tokens", "top_k", "output_scores"} & set(decode or {}))
    if clash:
        raise ValueError(f"decoding option(s) {', '.join(clash)} are set by the command itself (max_new_tokens: "
                         "--max-new-tokens; top_k 1 and output_scores false: the tables hold ids and texts)")
    # The corpus tables hold ids, texts and first divergences: no per-step scores to compute.
    translate = {"max_new_tokens": max_new_tokens, "top_k": 1, "output_scores": False, **(decode or {})}
    env = environment(options.threads_per_worker)
    run = run_corpus(export_dir, input_path, out, names, REFERENCE, options, translate, limit=limit, log=log,
                     on_shard=on_shard, external=external)
    env["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    agg = run["aggregate"]
    return {
        "kind": "quality",
        "model": {"export": str(export_dir), "source": manifest.data["source_model"]},
        "environment": env,
        "input": run["input"],
        "sentences": agg["sentences"],
        "batch_size": options.batch_size,
        "max_new_tokens": max_new_tokens,
        "decode": translate,
        "reference": REFERENCE,
        "engine": run["engine"],
        "per_sentence": "shards/*.parquet",
        "backends": agg["backends"],
        "not_run": skipped,
        **({"external": external} if external else {}),
        "outputs": agg["outputs"],
        "workers": agg["workers"],
    }
