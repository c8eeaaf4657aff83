"""The results folders of the speed runs: results.json, report.md and PNG plots, written and read back.

`python -m bench speed` and the app's quick run write them (`write`); the app's Benchmark tab
lists them newest first (`find_reports`) and shows one (`load_report`). `save` writes any kind's
results.json and report.md (`python -m bench quality` renders its own); `env_lines` is the
machine's block every report.md starts with.
"""

from __future__ import annotations

import json
from pathlib import Path

from .fmt import num, ratio
from .speed_verdicts import CACHE_PAIR
from .speedrun import GREEDY, decoding_sentence, not_measured


def _decoding_line(results: dict) -> str:
    d = results.get("decoding") or GREEDY
    ct2 = any(n.startswith("ct2") for n in [*results["runtimes"], *results.get("failed", {})])
    line = f"Decoding: {d['label']}. {decoding_sentence(d, ct2)}"
    if results.get("sweep_skipped"):
        line += f" No output-length sweep: {results['sweep_skipped']}."
    return line


def failure_line(error: str) -> str:
    """A runtime's error in one line: a worker's is "exit N; last lines of its log:" and a traceback,
    whose last line is the reason (an external export of another model: what differs)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else error
    return f"{lines[0]} … {lines[-1]}"


def provenance(info: dict) -> str | None:
    """Where an external export (`--external NAME=DIR`, backends/ort_external.py) came from, in one
    line for a report; None for the built-in backends, whose files are the export's own."""
    source = info.get("source")
    if not isinstance(source, dict) or not source.get("files"):
        return None
    graphs = "; ".join(f"{f['file']} sha256 {(f.get('sha256') or '')[:12]}…, opset {f.get('opset')}, "
                       f"{f.get('producer') or 'producer unknown'}, {f.get('precision')}" for f in source["files"])
    return (f"external export, {info.get('precision', '?')}, checked to be this model's and run through this "
            f"project's decoding loop: {source.get('layout')} from `{source.get('folder')}` ({graphs})")


def env_lines(results: dict) -> list[str]:
    e = results["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in e["versions"].items())
    lines = [
        f"- Date: {e['date_utc']}; git {e.get('git') or 'unknown'}",
        f"- CPU: {e['cpu']}, {e['logical_cores']} logical / {e.get('physical_cores')} physical cores; "
        f"{e['threads']} threads per runtime; load average {e.get('load_average_1m_at_start')} at start, "
        f"{e.get('load_average_1m_at_end', '–')} at end",
        f"- Python {e['python']}; {versions}",
    ]
    if e.get("scoring"):
        lines.append(f"- Our decoding loop's scoring passes: {e['scoring']}")
    if e.get("peer_environment"):
        v = e["peer_environment"]["versions"]
        lines.append("- Peer environment (Optimum, CTranslate2): " + ", ".join(f"{k} {x}" for k, x in v.items()))
    return lines


_DISPATCH_SHOWN = ("Selected ISA", "SGEMM backend", "GEMM_S8 backend", "Selected compute type")
_GEMM_NAMES = {"mkl": "Intel MKL", "dnnl": "oneDNN", "auto": "its own choice"}


def _setting(setting: dict) -> str:
    return f"{_GEMM_NAMES.get(setting['gemm'], setting['gemm'])} with {setting['threads']} thread(s)"


def _others_shape(floor: dict) -> str:
    """"; batch 1, a cache of P, a source of S" as the rest of the step was measured (bench/floor.py)."""
    for v in floor["graphs"].values():
        if v.get("others_alone"):
            return f"; batch 1, a cache of {v['others_alone']['past']}, a source of {v['others_alone']['source']}"
    return ""


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
        f"Reference for ratios and agreement: `{ref}`.",
        _decoding_line(results),
    ]
    if o.get("rounds", 1) > 1:
        out.append(
            f"Rounds: {o['rounds']}, round-robin (every runtime once, then again); timings are the medians over "
            "the rounds, peak RSS the maximum; the output-length sweep is from round 1. Per-round figures below."
        )
    out += [""]
    out += env_lines(results) + [""]
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
        row = [f"`{name}`", r["info"].get("precision", "?"), num(r.get("load_s"), 2),
               num(lat["p50"]), num(lat["p90"]), num(lat["p99"]), num(lat["mean"]), num(lat["ms_per_token_p50"], 2),
               ratio(cmp.get("latency_p50_ratio"))]
        row += [num(r["throughput"].get(str(b), {}).get("sentences_per_s"), 2) for b in bs]
        last = r["throughput"].get(str(bs[-1]), {})
        row += [num(last.get("tokens_per_s"), 0), ratio(cmp.get(f"throughput_b{bs[-1]}_ratio")),
                num(r["size_bytes"] / 1e6 if r.get("size_bytes") else None, 1 if r.get("size_bytes", 0) < 1e8 else 0), num(r.get("peak_rss_mb"), 0),
                f"{cmp['identical_to_reference']:.0%}" if "identical_to_reference" in cmp else "–"]
        if has_quality:
            q = cmp.get("quality_vs_references", {})
            row += [num(q.get("bleu"), 1), num(q.get("chrf"), 1)]
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    for name, err in results.get("failed", {}).items():
        out.append(f"- `{name}` did not run: {failure_line(err)}")
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
        line = f"- `{name}`: {i.get('runtime')}, {i.get('provider', 'CPU')}, files {', '.join(i.get('files', []))}"
        if origin := provenance(i):
            line += f"; {origin}; its load time includes that check and hashing its graphs"
        if st := i.get("ct2_setting"):
            line += f"; {_setting(st)}"
        if d := i.get("dispatch"):
            line += " (its own log: " + ", ".join(f"{k} {d[k]}" for k in _DISPATCH_SHOWN if k in d) + ")"
        out.append(line)
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
                "once, so per token no runtime can beat weight bytes / bandwidth (bench/floor.py). ORT's weight "
                "products alone: the graph's MatMuls (int8: DynamicQuantizeMatMul) on their own weights, chained, "
                "nothing else of the step. The rest of the step's kernels alone: ORT's optimized graph with those "
                f"products fed in as inputs (attention, layer norms, adds, ORT's per-node work{_others_shape(fl)}). "
                "Together they are the step without a loop: no ORT backend of this graph comes closer to the "
                "floor.", "",
                "| decoder graph | weights read per step MB | floor ms/token | ORT's weight products alone ms "
                "| x floor | the rest of the step's kernels alone ms | together x floor |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for g, v in fl["graphs"].items():
            # absent in runs made before they were measured
            alone, others = v.get("matmuls_alone"), v.get("others_alone")
            cells = f"{alone['ms']:.2f} | {alone['x_floor']:.2f}" if alone else "– | –"
            cells += f" | {others['ms']:.2f} | {v['kernels_x_floor']:.2f}" if others else " | – | –"
            out.append(f"| `{g}` | {v['weight_mb']:,} | {v['floor_ms_per_token']:.2f} | {cells} |")
    if results.get("targets"):
        out += ["", "## Speed targets, measured in this run", "", "| target | measured | held? |",
                "|---|---|---|"]
        for t in results["targets"]:
            out.append(f"| {t['target']} | {t['measured']} | {({True: 'yes', False: 'no', None: '–'})[t['held']]} |")
    if results.get("paired"):
        out += ["", "## Paired target checks", "",
                "Each pair: the two runtimes' processes back to back over the same work (load and warm-up untimed), "
                "which one goes first alternating; the ratio is ours / peer within the pair. A target between two "
                "runtimes is decided by its median pair: round-robin slots put minutes of other runtimes between "
                "the two sides of a ratio.", "",
                "| ours / peer | figure | each pair's ratio (who went first) | median | ours ahead |", "|---|---|---|---:|---:|"]
        for key, p in results["paired"].items():
            each = ", ".join(f"{q['ratio']:.2f} ({'ours' if q['first'] == p['ours'] else 'peer'})"
                             for q in p.get("pairs", []) if "ratio" in q)
            if "error" in p:
                out.append(f"| `{key}` | – | {each or '–'} | failed: {failure_line(p['error'])} | – |")
            else:
                out.append(f"| `{key}` | {p['figure']} | {each} | {p['median_ratio']:.2f}x | "
                           f"{p['ours_ahead']} of {p['n']} |")
    if results.get("ct2_settings"):
        out += ["", "## CTranslate2 settings, probed on this machine", ""]
        for name, p in results["ct2_settings"].items():
            if "error" in p:
                out.append(f"- `{name}`: {failure_line(p['error'])}")
                continue
            out += [f"`{name}`: " + p["rule"] + ".", "",
                    f"| GEMM, threads | best batch-1 p50 ms | best batch-{bs[-1]} sentences/s | runs | used |",
                    "|---|---:|---:|---:|---|"]
            for row in p["settings"]:
                st = row["setting"]
                out.append(f"| {_GEMM_NAMES.get(st['gemm'], st['gemm'])}, {st['threads']} | {row['latency_p50_ms']:,.1f} | "
                           f"{row['sentences_per_s']:,.2f} | {row['runs']} | {'**yes**' if st == p['chosen'] else ''} |")
            out += [f"- setting {e['setting']} failed: {failure_line(e['error'])}" for e in p.get("errors", [])]
            if p["fastest_latency"] != p["chosen"] or p["fastest_throughput"] != p["chosen"]:
                out.append("- the used setting was not the fastest on both figures: batch 1 "
                           f"{_setting(p['fastest_latency'])}, batch {bs[-1]} {_setting(p['fastest_throughput'])}")
            out.append("")
    sweep = {n: r["sweep"] for n, r in runtimes.items() if r.get("sweep")}
    if sweep:
        lengths = sorted({int(k) for sw in sweep.values() for k in sw})
        names = list(sweep)
        out += ["", "## Output length sweep (batch 1, forced lengths; median ms per sentence / per token)", ""]
        head = ["tokens"] + [f"`{n}`" for n in names]
        kv, ss = CACHE_PAIR
        if kv in sweep and ss in sweep:
            head.append("single-step / KV cache")
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for n in lengths:
            row = [str(n)]
            for name in names:
                c = sweep[name].get(str(n))
                row.append(f"{c['ms_per_sentence']:,.0f} / {c['ms_per_token']:.2f}" if c else "–")
            if kv in sweep and ss in sweep and str(n) in sweep[kv] and str(n) in sweep[ss]:
                row.append(ratio(sweep[ss][str(n)]["ms_per_sentence"] / sweep[kv][str(n)]["ms_per_sentence"]))
            out.append("| " + " | ".join(row) + " |")
    out += ["", "## What is timed", "", results["what_is_timed"], "", f"Not measured: {not_measured(results)}.", ""]
    if forced:
        out += ["With forced lengths every runtime runs the same number of decoder steps; the outputs of a "
                "random-weight model mean nothing, so BLEU is not reported and agreement only shows whether "
                "the numbers stay identical.", ""]
    out += [f"Total wall time of this benchmark: {results.get('wall_s', '–')} s.", ""]
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


def save(results: dict, out_dir: Path, markdown: str) -> dict[str, Path]:
    """results.json and report.md into `out_dir` (made if missing); returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(results, ensure_ascii=False, indent=1), encoding="utf-8")
    paths["markdown"].write_text(markdown, encoding="utf-8")
    return paths


def write(results: dict, out_dir: Path) -> dict[str, Path]:
    """A speed run's folder: its PNG plots, report.md (linking them) and results.json."""
    if results["kind"] != "speed":
        raise ValueError(f"write() takes a speed run's results, got kind {results['kind']!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results["plots"] = [p.name for p in plots(results, out_dir)]
    md = render_speed(results)
    if results["plots"]:
        md += "\n" + "\n".join(f"![{p}]({p})" for p in results["plots"]) + "\n"
    return save(results, out_dir, md)


def find_reports(root: str | Path, kind: str | None = "speed") -> list[dict]:
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


def load_latest(root: str | Path, kind: str | None = "speed") -> dict | None:
    """The newest results.json under `root` (of `kind`, None = any) as `load_report` gives it;
    None when there is none."""
    found = find_reports(root, kind)
    return load_report(found[0]["path"], found[0]["results"]) if found else None
