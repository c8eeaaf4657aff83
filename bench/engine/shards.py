"""One shard through every backend, its per-sentence Parquet file, and the sum over all shards.

`translate_shard` is the one per-batch function: the local engine calls it in its own process,
the Ray engine in each actor, so the two cannot drift. Within a shard, every backend translates
the same length-sorted batches, so a sentence's outputs depend on its shard alone, never on which
engine, node or actor ran it.

A shard's file `shards/<id>.parquet` holds one row per sentence: `file`, `row`, `en`, `zh`, and per
backend `<name>_ids` (generated token ids), `<name>_text`, `<name>_first_divergence` (the first step
whose token differs from the reference backend's; null when identical) and `<name>_stop_reason`.
Its schema metadata (`corpus_engine`) holds the shard's sums: agreement counts and histograms from
`service.metrics.agreement`, sacrebleu's BLEU and chrF sufficient statistics (corpus BLEU and chrF
are functions of summed per-sentence counts, so shards add up exactly), backend seconds, and who
ran it. `aggregate` adds those up into `service.spotcheck.compare_outputs`' layout without holding
the corpus in memory; tests pin it equal to `compare_outputs` itself.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from service import metrics

from .corpus_io import expected_shards

META_KEY = b"corpus_engine"
INLINE_SENTENCES = 20_000  # up to this many sentences results.json lists every output; beyond, the Parquet files do
DIFFERING_KEPT = 2_000  # differing sentences listed per backend in results.json beyond INLINE_SENTENCES


def _scorers():
    from sacrebleu.metrics import BLEU, CHRF

    return BLEU(tokenize="zh"), CHRF()  # what metrics.bleu_chrf's corpus_bleu / corpus_chrf construct


def _stats(scorer, hypotheses: list[str], references: list[str]) -> list[int]:
    sums = None
    for s in scorer._extract_corpus_statistics(hypotheses, [references]):
        sums = list(s) if sums is None else [a + b for a, b in zip(sums, s)]
    return [int(x) for x in sums]


def _score(stats_bleu: list[int], stats_chrf: list[int], n: int) -> dict:
    """metrics.bleu_chrf's numbers, from summed sufficient statistics."""
    bleu, chrf = _scorers()
    return {"bleu": round(bleu._compute_score_from_stats(stats_bleu).score, 2),
            "chrf": round(chrf._compute_score_from_stats(stats_chrf).score, 2), "n": n}


def translate_shard(backends: dict, shard: dict, *, reference: str, batch_size: int, decode: dict[str, Any],
                    worker: dict | None = None) -> pa.Table:
    """Every backend over one shard's sentences; the shard's per-sentence table, its sums as metadata.

    `decode`: keyword arguments for `Backend.translate` (max_new_tokens, top_k, num_beams, ...),
    passed through as they are."""
    en, zh, n = list(shard["en"]), list(shard["zh"]), len(shard["en"])
    tokenizer = backends[reference].tokenizer
    order = sorted(range(n), key=lambda i: (tokenizer.count_tokens(en[i]), i))
    outputs, seconds = {}, {}
    for name, backend in backends.items():
        out = [None] * n
        start = time.perf_counter()
        for k in range(0, n, batch_size):
            idx = order[k : k + batch_size]
            for i, t in zip(idx, backend.translate([en[i] for i in idx], **decode)):
                out[i] = t
        seconds[name] = time.perf_counter() - start
        outputs[name] = out
    bleu, chrf = _scorers()
    ref_ids = [t.token_ids for t in outputs[reference]]
    ref_texts = [t.text for t in outputs[reference]]
    columns: dict[str, Any] = {
        "file": pa.array([shard["file"]] * n, pa.int32()),
        "row": pa.array(range(shard["start"], shard["start"] + n), pa.int64()),
        "en": pa.array(en, pa.string()), "zh": pa.array(zh, pa.string()),
    }
    sums = {}
    for name, outs in outputs.items():
        a = metrics.agreement([t.token_ids for t in outs], ref_ids)
        texts = [t.text for t in outs]
        columns[f"{name}_ids"] = pa.array([t.token_ids for t in outs], pa.list_(pa.int32()))
        columns[f"{name}_text"] = pa.array(texts, pa.string())
        columns[f"{name}_first_divergence"] = pa.array(a["first_divergence_steps"], pa.int32())
        columns[f"{name}_stop_reason"] = pa.array([t.stop_reason for t in outs], pa.string())
        sums[name] = {
            "identical": a["identical"], "histogram": a["first_divergence_histogram"],
            "buckets": a["first_divergence_buckets"], "identical_text": sum(x == y for x, y in zip(texts, ref_texts)),
            "hit_max_new_tokens": sum(t.stop_reason == "max_new_tokens" for t in outs), "seconds": seconds[name],
            "info": dict(backends[name].info),
            "stats": {"references": [_stats(bleu, texts, zh), _stats(chrf, texts, zh)],
                      "reference_backend": [_stats(bleu, texts, ref_texts), _stats(chrf, texts, ref_texts)]},
        }
    summary = {"shard": shard["shard"], "file": shard["file"], "start": shard["start"], "n": n,
               "backends": sums, "worker": worker or {"pid": os.getpid()}}
    return pa.table(columns).replace_schema_metadata({META_KEY: json.dumps(summary).encode()})


def summary_of(table: pa.Table) -> dict:
    return json.loads(table.schema.metadata[META_KEY])


class ShardStore:
    """`--out/shards/`: one Parquet file per finished shard, written whole (temp file, then rename)."""

    def __init__(self, out: Path):
        self.dir = Path(out) / "shards"

    def path(self, shard: str) -> Path:
        return self.dir / f"{shard}.parquet"

    def done(self) -> set[str]:
        return {p.stem for p in self.dir.glob("*.parquet")} if self.dir.is_dir() else set()

    def write(self, table: pa.Table) -> Path:
        shard = summary_of(table)["shard"]
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{shard}.parquet.tmp-{os.getpid()}"
        pq.write_table(table, tmp)
        os.replace(tmp, self.path(shard))
        return self.path(shard)

    def summary(self, shard: str) -> dict:
        return json.loads(pq.read_schema(self.path(shard)).metadata[META_KEY])

    def read(self, shard: str, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(self.path(shard), columns=columns)


def aggregate(store: ShardStore, counts: list[int], shard_size: int, names: list[str], reference: str,
              inline_limit: int = INLINE_SENTENCES) -> dict:
    """Every shard checked (each sentence present exactly once) and summed, one shard in memory at a time.

    Returns {"backends": compare_outputs' per-backend layout plus seconds, info, hit_max_new_tokens,
    differing_total; "outputs": texts per backend (None past `inline_limit`), "sentences", "workers"}."""
    shards = expected_shards(counts, shard_size)
    missing = [s for s, *_ in shards if not store.path(s).is_file()]
    extra = sorted(store.done() - {s for s, *_ in shards})
    if missing or extra:
        raise RuntimeError(f"{store.dir}: {len(missing)} shard(s) missing ({', '.join(missing[:5])}), "
                           f"{len(extra)} unexpected ({', '.join(extra[:5])})")
    offsets = [sum(counts[:f]) for f in range(len(counts))]
    total = sum(counts)
    inline = total <= inline_limit
    acc = {name: {"identical": 0, "identical_text": 0, "hit_max_new_tokens": 0, "seconds": 0.0, "histogram": Counter(),
                  "buckets": Counter(), "stats": None, "steps": [], "texts": [], "differing": [], "differing_total": 0}
           for name in names}
    infos, workers = {}, Counter()
    for shard, f, start, n in shards:
        s = store.summary(shard)
        table = store.read(shard, ["row", "en", "zh"] + [f"{b}_{c}" for b in names for c in ("text", "first_divergence")])
        rows = table.column("row").to_pylist()
        if (s["file"], s["start"], s["n"]) != (f, start, n) or rows != list(range(start, start + n)):
            raise RuntimeError(f"{store.path(shard)} does not hold rows {start}..{start + n - 1} of file {f}")
        workers[json.dumps(s["worker"], sort_keys=True)] += 1
        en, zh = table.column("en").to_pylist(), table.column("zh").to_pylist()
        ref_texts = table.column(f"{reference}_text").to_pylist()
        for name in names:
            a, b = acc[name], s["backends"][name]
            infos.setdefault(name, b["info"])
            for key in ("identical", "identical_text", "hit_max_new_tokens", "seconds"):
                a[key] += b[key]
            a["histogram"].update({int(k): v for k, v in b["histogram"].items()})
            a["buckets"].update(b["buckets"])
            a["stats"] = b["stats"] if a["stats"] is None else {
                k: [[x + y for x, y in zip(p, q)] for p, q in zip(a["stats"][k], b["stats"][k])] for k in b["stats"]}
            steps = table.column(f"{name}_first_divergence").to_pylist()
            texts = table.column(f"{name}_text").to_pylist()
            if inline:
                a["steps"] += steps
                a["texts"] += texts
            for i, step in enumerate(steps):
                if step is None:
                    continue
                a["differing_total"] += 1
                if inline or len(a["differing"]) < DIFFERING_KEPT:
                    a["differing"].append({"index": offsets[f] + start + i, "en": en[i], "first_divergence": step,
                                           "output": texts[i], "reference_output": ref_texts[i], "reference": zh[i]})
    per_backend = {}
    for name in names:
        a = acc[name]
        refs, ref_backend = a["stats"]["references"], a["stats"]["reference_backend"]
        agreement = {"n": total, "identical": a["identical"],
                     "identical_share": a["identical"] / total if total else float("nan")}
        if inline:
            agreement["first_divergence_steps"] = a["steps"]
        agreement["first_divergence_histogram"] = dict(sorted(a["histogram"].items()))
        labels = [metrics.bucket_label(lo, hi) for lo, hi in metrics.BUCKETS]
        agreement["first_divergence_buckets"] = {k: a["buckets"].get(k, 0) for k in labels}
        per_backend[name] = {
            "agreement": agreement, "identical_text": a["identical_text"],
            "vs_references": _score(*refs, total),
            "vs_reference_backend": _score(*ref_backend, total) if name != reference else None,
            "differing": a["differing"], "differing_total": a["differing_total"],
            "seconds": a["seconds"], "info": infos[name], "hit_max_new_tokens": a["hit_max_new_tokens"],
        }
    base = per_backend[reference]["vs_references"]
    for entry in per_backend.values():  # as compare_outputs does
        q = entry["vs_references"]
        q["bleu_delta"] = round(q["bleu"] - base["bleu"], 2)
        q["chrf_delta"] = round(q["chrf"] - base["chrf"], 2)
    return {"backends": per_backend, "sentences": total,
            "outputs": {name: acc[name]["texts"] for name in names} if inline else None,
            "workers": [{**json.loads(k), "shards": v} for k, v in workers.items()]}
