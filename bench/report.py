"""results.json -> report.md and PNG plots; and `load_latest` for the app's Benchmark tab."""

from __future__ import annotations

import json
from pathlib import Path

from .data import RESULTS


def _f(x, digits=1, suffix="") -> str:
    return "–" if x is None else f"{x:,.{digits}f}{suffix}"


def _sd(x) -> str:
    return "–" if x is None else f"{x:+.2f}"


def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def _env_lines(results: dict) -> list[str]:
    e = results["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in e["versions"].items())
    lines = [
        f"- Date: {e['date_utc']}; git {e.get('git') or 'unknown'}",
        f"- CPU: {e['cpu']}, {e['logical_cores']} logical / {e.get('physical_cores')} physical cores; "
        f"{e['threads']} threads per runtime; load average {e.get('load_average_1m_at_start')} at start, "
        f"{e.get('load_average_1m_at_end', '–')} at end",
        f"- Python {e['python']}; {versions}",
    ]
    if e.get("peer_environment"):
        v = e["peer_environment"]["versions"]
        lines.append("- Peer environment (Optimum, CTranslate2): " + ", ".join(f"{k} {x}" for k, x in v.items()))
    return lines


def render_speed(results: dict) -> str:
    m, s, o = results["model"], results["sentences"], results["options"]
    runtimes, ref = results["runtimes"], results.get("reference")
    forced = o.get("forced_tokens")
    quick = " (quick run in the app: every backend in the app's process)" if results.get("quick") else ""
    out = [f"# Speed: {Path(m['export']).name}{quick}", ""]
    out += [
        f"Model: {m.get('parameters') or '?':,} parameters, {m['layers']} layers, d_model {m['d_model']}, "
        f"vocab {m['vocab_size']} (export `{m['export']}`).",
        f"Sentences: {s['count']}{' from ' + s['source'] if s.get('source') else ''} "
        f"({s['words_min_median_max'][0]}–{s['words_min_median_max'][2]} words, "
        f"{s['source_tokens_min_median_max'][0]}–{s['source_tokens_min_median_max'][2]} source tokens, median "
        f"{s['source_tokens_min_median_max'][1]:.0f}); batch-1 latency over {s['latency_sentences']}, throughput "
        f"over {s['throughput_sentences']} length-sorted, length sweep over {s['sweep_sentences']}.",
        ("Output length: forced to " f"{forced} tokens for every runtime (min_new_tokens = max_new_tokens)."
         if forced else f"Output length: up to eos, capped at {o['max_new_tokens']} tokens."),
        f"Reference for ratios and agreement: `{ref}`. Greedy search everywhere.",
    ]
    if o.get("rounds", 1) > 1:
        out.append(
            f"Rounds: {o['rounds']}, round-robin (every runtime once, then again); timings are the medians over "
            "the rounds, peak RSS the maximum; the output-length sweep is from round 1. Per-round figures below."
        )
    out += [""]
    out += _env_lines(results) + [""]
    bs = o["batch_sizes"]
    head = ["runtime", "precision", "load s", "b1 p50 ms", "p90", "p99", "mean", "ms/token", "p50 vs ref"]
    head += [f"b{b} sent/s" for b in bs] + [f"b{bs[-1]} tok/s", f"b{bs[-1]} vs ref", "size MB", "peak RSS MB",
                                          "identical to ref"]
    has_quality = any("quality_vs_references" in r.get("comparison", {}) for r in runtimes.values())
    if has_quality:
        head += ["BLEU", "chrF"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in runtimes.items():
        lat, cmp = r["latency"], r.get("comparison", {})
        row = [f"`{name}`", r["info"].get("precision", "?"), _f(r.get("load_s"), 2),
               _f(lat["p50"]), _f(lat["p90"]), _f(lat["p99"]), _f(lat["mean"]), _f(lat["ms_per_token_p50"], 2),
               _ratio(cmp.get("latency_p50_ratio"))]
        row += [_f(r["throughput"].get(str(b), {}).get("sentences_per_s"), 2) for b in bs]
        last = r["throughput"].get(str(bs[-1]), {})
        row += [_f(last.get("tokens_per_s"), 0), _ratio(cmp.get(f"throughput_b{bs[-1]}_ratio")),
                _f(r["size_bytes"] / 1e6 if r.get("size_bytes") else None, 1 if r.get("size_bytes", 0) < 1e8 else 0), _f(r.get("peak_rss_mb"), 0),
                f"{cmp['identical_to_reference']:.0%}" if "identical_to_reference" in cmp else "–"]
        if has_quality:
            q = cmp.get("quality_vs_references", {})
            row += [_f(q.get("bleu"), 1), _f(q.get("chrf"), 1)]
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    for name, err in results.get("failed", {}).items():
        out.append(f"- `{name}` did not run: {err.splitlines()[0]}")
    for name, why in results.get("not_run", {}).items():
        out.append(f"- `{name}`: {why}")
    for name, r in runtimes.items():
        if r["latency"].get("hit_cap"):
            out.append(f"- `{name}`: {r['latency']['hit_cap']} of {r['latency']['n']} batch-1 outputs ran into the "
                       f"{o['max_new_tokens']}-token cap instead of ending with eos")
        if r.get("tokenization_mismatches"):
            out.append(f"- `{name}` tokenized {len(r['tokenization_mismatches'])} sentences differently from the "
                       "project's tokenizer: its timings are for slightly different inputs")
    if any(r.get("rounds") for r in runtimes.values()):
        out += ["", "Per round (batch-1 p50 ms / batch-" f"{bs[-1]} sentences/s), in the order they ran:", ""]
        for name, r in runtimes.items():
            if r.get("rounds"):
                per = ", ".join(f"{x['b1_p50_ms']:,.1f} / {x.get(f'b{bs[-1]}_sent_per_s', float('nan')):.2f}" for x in r["rounds"])
                out.append(f"- `{name}`: {per}")
    out += ["", "What the runtimes are:", ""]
    for name, r in runtimes.items():
        i = r["info"]
        out.append(f"- `{name}`: {i.get('runtime')}, {i.get('provider', 'CPU')}, files {', '.join(i.get('files', []))}")
    if results.get("claims"):
        out += ["", "## The article's claims, measured in this run", "",
                "| claim | measured | held? |", "|---|---|---|"]
        for c in results["claims"]:
            verdict = {True: "yes", False: "no", None: "–"}[c["held"]]
            out.append(f"| {c['claim']} | {c['measured']} | {verdict} |")
        out += ["", "A speed claim holds when the measured speedup reaches 90% of the claimed one; "
                "\"identical\" only at 100% identical token ids (batch-1 outputs of this run)."]
    fl = results["environment"].get("floor")
    if fl:
        probes = ", ".join(f"{k} {v['gb_per_s']} GB/s" for k, v in fl["bandwidth"]["probes"].items())
        out += ["", "## Memory-bandwidth floor (batch 1)", "",
                f"Read bandwidth, {fl['bandwidth']['threads']} threads, {fl['bandwidth']['probe_mb']} MB, median of "
                f"{fl['bandwidth']['passes']}" + (f", measured again at {fl['measured_at']}" if fl.get("measured_at") else "")
                + f": {probes}; the fastest sets the floor. A decoder step reads every weight "
                "once, so per token no runtime can beat weight bytes / bandwidth (bench/floor.py).", "",
                "| decoder graph | weights read per step MB | floor ms/token |", "|---|---:|---:|"]
        out += [f"| `{g}` | {v['weight_mb']:,} | {v['floor_ms_per_token']:.2f} |" for g, v in fl["graphs"].items()]
    if results.get("targets"):
        out += ["", "## Speed targets (issue #6), measured in this run", "", "| target | measured | held? |",
                "|---|---|---|"]
        for t in results["targets"]:
            out.append(f"| {t['target']} | {t['measured']} | {({True: 'yes', False: 'no', None: '–'})[t['held']]} |")
    sweep = {n: r["sweep"] for n, r in runtimes.items() if r.get("sweep")}
    if sweep:
        lengths = sorted({int(k) for sw in sweep.values() for k in sw})
        names = list(sweep)
        out += ["", "## Output length sweep (batch 1, forced lengths; median ms per sentence / per token)", ""]
        head = ["tokens"] + [f"`{n}`" for n in names]
        kv, ss = "ort_fp32_kv_cache", "ort_fp32_single_step"
        if kv in sweep and ss in sweep:
            head.append("single-step / KV cache")
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for n in lengths:
            row = [str(n)]
            for name in names:
                c = sweep[name].get(str(n))
                row.append(f"{c['ms_per_sentence']:,.0f} / {c['ms_per_token']:.2f}" if c else "–")
            if kv in sweep and ss in sweep and str(n) in sweep[kv] and str(n) in sweep[ss]:
                row.append(_ratio(sweep[ss][str(n)]["ms_per_sentence"] / sweep[kv][str(n)]["ms_per_sentence"]))
            out.append("| " + " | ".join(row) + " |")
    from .speed import NOT_MEASURED

    out += ["", "## What is timed", "", results["what_is_timed"], "", f"Not measured: {NOT_MEASURED}.", ""]
    if forced:
        out += ["With forced lengths every runtime runs the same number of decoder steps; the outputs of a "
                "random-weight model mean nothing, so BLEU is not reported and agreement only shows whether "
                "the numbers stay identical.", ""]
    out += [f"Total wall time of this benchmark: {results.get('wall_s', '–')} s.", ""]
    return "\n".join(out)


def render_quality(results: dict) -> str:
    m, ref = results["model"], results["reference"]
    out = [f"# Quality: {Path(m['export']).name}", ""]
    out += [f"{results['sentences']} sentences from `{results['tsv']}`, batch size {results['batch_size']} "
            f"(length-sorted), up to eos or {results['max_new_tokens']} tokens; reference backend `{ref}`.", ""]
    out += _env_lines(results) + [""]
    head = ["backend", "identical tokens", "identical text", "BLEU vs refs", "Δ BLEU", "chrF vs refs", "Δ chrF", "BLEU vs ref backend",
            "chrF vs ref backend", "first divergence (steps: count)", "seconds"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, b in results["backends"].items():
        q, qp = b.get("vs_references") or {}, b.get("vs_reference_backend") or {}
        buckets = ", ".join(f"{k}: {v}" for k, v in b["agreement"]["first_divergence_buckets"].items() if v) or "none"
        row = [f"`{name}`", f"{b['agreement']['identical']}/{b['agreement']['n']} ({b['agreement']['identical_share']:.1%})",
               f"{b['identical_text']}/{b['agreement']['n']}", _f(q.get("bleu"), 2), _sd(q.get("bleu_delta")),
               _f(q.get("chrf"), 2), _sd(q.get("chrf_delta")),
               _f(qp.get("bleu"), 2), _f(qp.get("chrf"), 2), buckets if name != ref else "–", _f(b["seconds"], 1)]
        out.append("| " + " | ".join(row) + " |")
    for name, why in results.get("not_run", {}).items():
        out.append(f"- `{name}`: {why}")
    out += ["", "Divergence steps count from 0 (the first generated token). BLEU uses sacrebleu tokenize=\"zh\".", ""]
    for name, b in results["backends"].items():
        if not b["differing"]:
            continue
        out += [f"## `{name}`: {len(b['differing'])} sentences differ from `{ref}`", ""]
        for d in b["differing"][:50]:
            out += [f"- step {d['first_divergence']}: {d['en']}", f"  - `{ref}`: {_clip(d['reference_output'])}",
                    f"  - `{name}`: {_clip(d['output'])}"]
            if d.get("reference"):
                out.append(f"  - reference: {_clip(d['reference'])}")
        if len(b["differing"]) > 50:
            out.append(f"- … {len(b['differing']) - 50} more in results.json")
        out.append("")
    return "\n".join(out)


def plots(results: dict, out_dir: Path) -> list[Path]:
    """PNG plots next to report.md: the length sweep, batch-1 latency and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runtimes = results["runtimes"]
    written = []
    sweep = {n: r["sweep"] for n, r in runtimes.items() if r.get("sweep")}
    if sweep:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
        for name, sw in sweep.items():
            xs = sorted(int(k) for k in sw)
            a1.plot(xs, [sw[str(x)]["ms_per_sentence"] for x in xs], marker="o", label=name)
            a2.plot(xs, [sw[str(x)]["ms_per_token"] for x in xs], marker="o", label=name)
        lengths = sorted({int(k) for sw in sweep.values() for k in sw})
        for ax, title in ((a1, "ms per sentence"), (a2, "ms per generated token")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(x) for x in lengths])
            ax.minorticks_off()
            ax.set_xlabel("forced output tokens")
            ax.set_title(title)
            ax.grid(alpha=0.3)
        a1.set_yscale("log")
        a1.legend(fontsize=8)
        fig.suptitle(f"Output length sweep, batch 1, {results['environment']['threads']} threads")
        fig.tight_layout()
        written.append(out_dir / "sweep.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    if runtimes:
        names = list(runtimes)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 0.5 * len(names) + 2.2))
        y = range(len(names))
        p50 = [runtimes[n]["latency"]["p50"] for n in names]
        p90 = [runtimes[n]["latency"]["p90"] for n in names]
        a1.barh(y, p50, color="tab:blue", label="p50")
        a1.errorbar(p50, y, xerr=[[0] * len(names), [b - a for a, b in zip(p50, p90)]], fmt="none", ecolor="k",
                    capsize=3, label="to p90")
        a1.set_yticks(list(y), names)
        a1.invert_yaxis()
        a1.set_xlabel("batch-1 latency, ms")
        a1.legend(fontsize=8)
        bs = results["options"]["batch_sizes"]
        h = 0.8 / len(bs)
        for k, b in enumerate(bs):
            vals = [runtimes[n]["throughput"].get(str(b), {}).get("sentences_per_s", 0) for n in names]
            a2.barh([i + k * h for i in y], vals, height=h, label=f"batch {b}")
        a2.set_yticks([i + h * (len(bs) - 1) / 2 for i in y], names)
        a2.invert_yaxis()
        a2.set_xlabel("sentences / s")
        a2.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / "speed.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def write(results: dict, out_dir: Path) -> dict[str, Path]:
    """results.json, report.md and (speed) the PNG plots into `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "report.md"}
    if results["kind"] == "speed":
        results["plots"] = [p.name for p in plots(results, out_dir)]
        md = render_speed(results)
        if results["plots"]:
            md += "\n" + "\n".join(f"![{p}]({p})" for p in results["plots"]) + "\n"
    else:
        md = render_quality(results)
    paths["json"].write_text(json.dumps(results, ensure_ascii=False, indent=1), encoding="utf-8")
    paths["markdown"].write_text(md, encoding="utf-8")
    return paths


def find_reports(root: str | Path = RESULTS, kind: str | None = "speed") -> list[dict]:
    """Every results.json under `root` (of `kind`, None = any), newest first, as
    {"path", "mtime", "results"}: what a picker of past reports lists."""
    found = []
    for path in Path(root).glob("**/results.json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue  # a half-written or foreign file is not a report
        if kind is None or data.get("kind") == kind:
            found.append({"path": str(path), "mtime": path.stat().st_mtime, "results": data})
    return sorted(found, key=lambda r: r["mtime"], reverse=True)


def load_report(path: str | Path, results: dict | None = None) -> dict:
    """One report as {"path", "results", "markdown", "plots": [absolute PNG paths]}."""
    path = Path(path)
    data = results if results is not None else json.loads(path.read_text(encoding="utf-8"))
    md = path.with_name("report.md")
    return {
        "path": str(path),
        "results": data,
        "markdown": md.read_text(encoding="utf-8") if md.is_file() else "",
        "plots": [str(path.parent / p) for p in data.get("plots", []) if (path.parent / p).is_file()],
    }


def load_latest(root: str | Path = RESULTS, kind: str | None = "speed") -> dict | None:
    """The newest results.json under `root` (of `kind`, None = any) as `load_report` gives it;
    None when there is none."""
    found = find_reports(root, kind)
    return load_report(found[0]["path"], found[0]["results"]) if found else None


def readme_table(results: dict) -> str:
    """A compact table of a speed run for the project README: absolute numbers and ratios to PyTorch."""
    rt, o, e = results["runtimes"], results["options"], results["environment"]
    big = str(o["batch_sizes"][-1])
    quality = any("quality_vs_references" in r.get("comparison", {}) for r in rt.values())
    head = ["runtime", "batch-1 p50 ms", "ms/token", "vs PyTorch", f"batch-{big} sent/s", "vs PyTorch",
            "peak RSS MB", "size MB", "identical to PyTorch"] + (["BLEU", "chrF"] if quality else [])
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, r in rt.items():
        c, t = r.get("comparison", {}), r["throughput"].get(big, {})
        row = [f"`{name}` ({r['info'].get('precision', '?')})", _f(r["latency"]["p50"], 0),
               _f(r["latency"]["ms_per_token_p50"], 1), _ratio(c.get("latency_p50_ratio")),
               _f(t.get("sentences_per_s"), 1), _ratio(c.get(f"throughput_b{big}_ratio")), _f(r.get("peak_rss_mb"), 0),
               _f(r["size_bytes"] / 1e6 if r.get("size_bytes") else None, 0),
               f"{c['identical_to_reference']:.0%}" if "identical_to_reference" in c else "–"]
        if quality:
            q = c.get("quality_vs_references", {})
            row += [_f(q.get("bleu"), 1), _f(q.get("chrf"), 1)]
        lines.append("| " + " | ".join(row) + " |")
    s = results["sentences"]
    forced = f"{o['forced_tokens']} forced output tokens" if o.get("forced_tokens") else "decoding to eos"
    lines += ["", f"{e['date_utc']}, {e['cpu']}, {e['threads']} threads, load average {e.get('load_average_1m_at_start')}"
              f"→{e.get('load_average_1m_at_end', '–')}; {s['latency_sentences']} sentences at batch 1, "
              f"{s['throughput_sentences']} at batch {big}, {forced}"
              + (f", medians of {o['rounds']} rounds run round-robin" if o.get("rounds", 1) > 1 else "") + "; "
              + ", ".join(f"{k} {v}" for k, v in e["versions"].items() if k in ("onnxruntime", "torch", "transformers"))
              + (", " + ", ".join(f"{k} {v}" for k, v in e["peer_environment"]["versions"].items()
                                  if k in ("optimum-onnx", "ctranslate2")) if e.get("peer_environment") else "")
              + ". \"vs PyTorch\": latency ratio (lower is faster) and throughput ratio (higher is faster)."]
    return "\n".join(lines)
