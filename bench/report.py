"""The quality report's report.md, and a speed run's compact table for the README.

A speed run's folder (results.json, report.md, plots) is written by `service.reports.write`,
which the app's quick run uses too; a quality run's by `write_quality` here.
"""

from __future__ import annotations

from pathlib import Path

from service.fmt import num, ratio, signed
from service.reports import env_lines, provenance, save

from .peers import is_ct2


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def render_quality(results: dict) -> str:
    m, ref = results["model"], results["reference"]
    out = [f"# Quality: {Path(m['export']).name}", ""]
    source = results.get("input", {}).get("path") or results.get("tsv")
    extra = {k: v for k, v in results.get("decode", {}).items() if k not in ("max_new_tokens", "top_k", "output_scores")}
    out += [f"{results['sentences']:,} sentences from `{source}`, batch size {results['batch_size']} "
            f"(length-sorted), up to eos or {results['max_new_tokens']} tokens"
            + "".join(f", {k}={v}" for k, v in extra.items()) + f"; reference backend `{ref}`.", ""]
    out += env_lines(results) + engine_lines(results) + [""]
    head = ["backend", "identical tokens", "identical text", "BLEU vs refs", "Δ BLEU", "chrF vs refs", "Δ chrF", "BLEU vs ref backend",
            "chrF vs ref backend", "first divergence (steps: count)", "backend s"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, b in results["backends"].items():
        q, qp = b.get("vs_references") or {}, b.get("vs_reference_backend") or {}
        buckets = ", ".join(f"{k}: {v}" for k, v in b["agreement"]["first_divergence_buckets"].items() if v) or "none"
        row = [f"`{name}`", f"{b['agreement']['identical']}/{b['agreement']['n']} ({b['agreement']['identical_share']:.1%})",
               f"{b['identical_text']}/{b['agreement']['n']}", num(q.get("bleu"), 2), signed(q.get("bleu_delta")),
               num(q.get("chrf"), 2), signed(q.get("chrf_delta")),
               num(qp.get("bleu"), 2), num(qp.get("chrf"), 2), buckets if name != ref else "–", num(b["seconds"], 1)]
        out.append("| " + " | ".join(row) + " |")
    for name, why in results.get("not_run", {}).items():
        out.append(f"- `{name}`: {why}")
    for name, b in results["backends"].items():
        if origin := provenance(b.get("info") or {}):  # the folder it ran from: a node's copy with --model-transfer ship
            given = (results.get("external") or {}).get(name)
            out.append(f"- `{name}`" + (f" (`--external {name}={given}`)" if given else "") + f": {origin}")
    out += ["", "Divergence steps count from 0 (the first generated token). BLEU uses sacrebleu tokenize=\"zh\". "
            "Backend s: the backend's translate time summed over every worker.", ""]
    for name, b in results["backends"].items():
        if not b["differing"]:
            continue
        total = b.get("differing_total", len(b["differing"]))
        out += [f"## `{name}`: {total:,} sentences differ from `{ref}`", ""]
        for d in b["differing"][:50]:
            out += [f"- step {d['first_divergence']}: {d['en']}", f"  - `{ref}`: {_clip(d['reference_output'])}",
                    f"  - `{name}`: {_clip(d['output'])}"]
            if d.get("reference"):
                out.append(f"  - reference: {_clip(d['reference'])}")
        if total > 50:
            listed = "results.json" if len(b["differing"]) == total else f"results.json (the first {len(b['differing']):,})"
            out.append(f"- … {total - 50:,} more in {listed} and every one in shards/*.parquet")
        out.append("")
    return "\n".join(out)


def engine_lines(results: dict) -> list[str]:
    """The corpus engine's block: which engine, nodes, actors, shards, throughput."""
    e = results.get("engine")
    if not e:
        return []
    lines = [f"- Engine: {e['name']}"
             + (f" (ray {e['ray']}, {e['address']}): {e['nodes']} node(s), {e['cluster_cpus']} CPUs, {e['actors']} "
                f"actor(s) x {e['threads_per_actor']} thread(s), model files {e['model_transfer']}"
                if e["name"] == "ray" and "nodes" in e else
                f": {e['threads_per_actor']} thread(s) per backend" if "threads_per_actor" in e else "")
             + f"; {e['shards']} shard(s) of {e['shard_size']}"
             + (f", {e['shards_resumed']} already done (resumed)" if e.get("shards_resumed") else "")
             + (f", {e['duplicate_shards_dropped']} duplicate(s) dropped" if e.get("duplicate_shards_dropped") else "")]
    if e.get("sentences_per_s"):
        lines.append(f"- This run translated {e['sentences_translated']:,} sentences through every backend in "
                     f"{e['wall_s']:,.1f} s: {e['sentences_per_s']:.2f} sentences/s (the first shard arrived after "
                     f"{e['first_shard_s']:.1f} s: start-up, model loading and that shard)")
    workers = results.get("workers") or []
    if workers:
        nodes = {w.get("node") or w.get("host") for w in workers}
        lines.append(f"- Shards written by {len(workers)} worker process(es) on {len(nodes)} node(s); "
                     f"per-sentence results: `{results.get('per_sentence', 'shards/*.parquet')}`")
    return lines


def write_quality(results: dict, out_dir: Path) -> dict[str, Path]:
    """A quality run's results.json and report.md into `out_dir`; returns their paths."""
    return save(results, out_dir, render_quality(results))


def readme_table(results: dict) -> str:
    """A compact table of a speed run for the project README: absolute numbers and ratios to PyTorch."""
    rt, o, e = results["runtimes"], results["options"], results["environment"]
    big = str(o["batch_sizes"][-1])
    quality = any("quality_vs_references" in r.get("comparison", {}) for r in rt.values())
    # Runs from before --num-beams recorded no decoding: every runtime ran greedy search then.
    d = results.get("decoding") or {"search": "greedy", "num_beams": 1}
    beam = d["search"] == "beam"
    ct2 = "; CTranslate2 scores its own way: agreement, not identity" if any(is_ct2(n) for n in rt) else ""
    search = (f"beam search with {d['num_beams']} beams (length_penalty {d['length_penalty']}, early_stopping "
              f"{d['early_stopping']}{ct2})" if beam else "greedy search")
    head = [f"runtime, beam {d['num_beams']}" if beam else "runtime", "batch-1 p50 ms", "ms/token", "vs PyTorch",
            f"batch-{big} sent/s", "vs PyTorch", "engine alone sent/s", "peak RSS MB", "size MB", "identical to PyTorch"] + (["BLEU", "chrF"] if quality else [])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, r in rt.items():
        c, t = r.get("comparison", {}), r["throughput"].get(big, {})
        row = [f"`{name}` ({r['info'].get('precision', '?')})", num(r["latency"]["p50"], 0),
               num(r["latency"]["ms_per_token_p50"], 1), ratio(c.get("latency_p50_ratio")),
               num(t.get("sentences_per_s"), 1), ratio(c.get(f"throughput_b{big}_ratio")),
               num(t["sentences"] / t["engine_seconds"] if t.get("engine_seconds") else None, 1), num(r.get("peak_rss_mb"), 0),
               num(r["size_bytes"] / 1e6 if r.get("size_bytes") else None, 0),
               f"{c['identical_to_reference']:.0%}" if "identical_to_reference" in c else "–"]
        if quality:
            q = c.get("quality_vs_references", {})
            row += [num(q.get("bleu"), 1), num(q.get("chrf"), 1)]
        lines.append("| " + " | ".join(row) + " |")
    s = results["sentences"]
    forced = f"{o['forced_tokens']} forced output tokens" if o.get("forced_tokens") else "decoding to eos"
    lines += ["", f"{e['date_utc']}, {e['cpu']}, {e['threads']} threads, load average {e.get('load_average_1m_at_start')}"
              f"→{e.get('load_average_1m_at_end', '–')}; {s['latency_sentences']} sentences at batch 1, "
              f"{s['throughput_sentences']} at batch {big}, {forced}, {search}"
              + (f", medians of {o['rounds']} rounds run round-robin" if o.get("rounds", 1) > 1 else "") + "; "
              + ", ".join(f"{k} {v}" for k, v in e["versions"].items() if k in ("onnxruntime", "torch", "transformers"))
              + (", " + ", ".join(f"{k} {v}" for k, v in e["peer_environment"]["versions"].items()
                                  if k in ("optimum-onnx", "ctranslate2")) if e.get("peer_environment") else "")
              + ". \"vs PyTorch\": latency ratio (lower is faster) and throughput ratio (higher is faster). "
              "\"engine alone\": the same batches counting only the time inside the runtime's graphs or modules "
              "(encoder, decoder steps, cache reorders), i.e. without our decoding loop's own work; peers: –."]
    external = [f"- `{name}`: {origin}." for name, r in rt.items() if (origin := provenance(r["info"]))]
    lines += ["", *external] if external else []
    return "\n".join(lines)
