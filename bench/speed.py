"""python -m bench speed: load time, latency, throughput, memory and size of every backend (and peer).

Each backend runs alone in its own subprocess (`bench.worker`; peers: `bench.peers worker` in the
peer environment) over the very same work, written once as `spec.json`: the same sentences, batch
sizes, threads and forced lengths. See bench/README.md for what is timed and what is left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import floor as floor_mod, metrics, peers as peers_mod
from .data import REPO, Pair, default_backends, environment
from .protocol import Spec, measure

REFERENCE = "pytorch"
SWEEP_LENGTHS = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class SpeedOptions:
    threads: int = 2
    forced_tokens: int | None = None  # min_new_tokens = max_new_tokens = this, for random weights
    max_new_tokens: int = 256  # cap when not forced, for every runtime alike
    latency_sentences: int | None = None  # None: every sentence
    throughput_sentences: int | None = None  # None: every sentence
    batch_sizes: tuple[int, ...] = (8, 32)
    sweep_lengths: tuple[int, ...] = SWEEP_LENGTHS
    sweep_sentences: int = 5
    sweep_peers: bool = False  # the sweep is about our backends; peers only when asked
    warmup: int = 3
    timeout_s: int = 3600  # per runtime subprocess
    floor: bool = True  # measure read bandwidth after the runs: the batch-1 per-token floor
    # Every runtime is run this many times, round-robin (all runtimes, then all again), and the
    # medians are reported. This machine's speed drifts by up to 2x over minutes (a shared host
    # with a 300 MiB L3), so one slot per runtime can put a whole ratio on a slow minute.
    rounds: int = 1

    def __post_init__(self):
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds!r}")
        if self.forced_tokens is not None and not 1 <= self.forced_tokens <= 511:
            raise ValueError(f"forced_tokens must be in 1..511, got {self.forced_tokens}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")


QUICK_RUN_LIMIT = 20  # sentences in the app's quick run: a few seconds per backend on a small CPU

# What no speed run here measures; the report and the app's Benchmark tab say so next to the numbers.
NOT_MEASURED = (
    "cold start (the first run after boot, page cache empty), beam search, more than one request at a time, "
    "GPUs, and the accuracy of a random-weight fixture (meaningless)"
)

# `--quick`: small, stated samples so the opus-sized run with peers fits in about 15 minutes.
QUICK = dict(latency_sentences=40, throughput_sentences=64, sweep_sentences=3)

WHAT_IS_TIMED = (
    "Wall-clock time of one translate call per batch (time.perf_counter): tokenization, encoder, every "
    "decoder step, the runtime's search loop and detokenization. Excluded: process start, imports and "
    "model loading (reported separately as load time, which for our backends includes the sha256 check "
    "of the graph files), and the warm-up calls (the first few single sentences and one batch per batch "
    "size). Greedy search for every runtime. Each runtime runs alone in its own process; peak RSS is that "
    "process's maximum resident memory over the whole run (load, warm-up, batch 1 and the largest batch), "
    "so it includes the Python interpreter and the runtime library."
)

QUICK_WHAT_IS_TIMED = (
    "Wall-clock time of one translate call per batch (time.perf_counter): tokenization, encoder, every "
    "decoder step, the runtime's search loop and detokenization. Excluded: model loading (the app loaded "
    "the backends when it started) and the warm-up calls (one single sentence and one batch). Greedy search. "
    "Quick run: all backends share the app's process, one after the other, while no translation runs; load "
    "time, peak memory, size on disk and the output-length sweep are not measured (`python -m bench speed` "
    "measures them, each runtime alone in its own process)."
)


def source_ids(export_dir: Path, sentences: list[str]) -> list[list[int]]:
    from backends.tokenizer import MarianTokenizerWrapper

    tok = MarianTokenizerWrapper(export_dir)
    return [tok.encode([s], 10**6).input_ids[0].tolist() for s in sentences]


def make_spec(sentences: list[str], lengths: list[int], options: SpeedOptions, sweep: bool,
              ids: list[list[int]] | None = None) -> Spec:
    n = len(sentences)
    lat = list(range(min(options.latency_sentences or n, n)))
    thr = sorted(range(min(options.throughput_sentences or n, n)), key=lambda i: (lengths[i], i))
    return Spec(
        sentences=sentences,
        latency_idx=lat,
        throughput_idx=thr,
        batch_sizes=list(options.batch_sizes),
        max_new_tokens=options.max_new_tokens,
        forced_tokens=options.forced_tokens,
        sweep_lengths=list(options.sweep_lengths) if sweep else [],
        sweep_idx=list(range(min(options.sweep_sentences, n))) if sweep else [],
        warmup=min(options.warmup, len(lat)),
        threads=options.threads,
        source_ids=ids,
    )


def _run_subprocess(cmd: list[str], out_json: Path, log_path: Path, threads: int, timeout: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    with log_path.open("w") as logf:
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s (log: {log_path})"}
    if proc.returncode != 0 or not out_json.is_file():
        tail = log_path.read_text(errors="replace")[-1500:]
        return {"error": f"exit {proc.returncode}; last lines of {log_path.name}:\n{tail}"}
    return json.loads(out_json.read_text(encoding="utf-8"))


def run(
    export_dir: Path,
    pairs: list[Pair],
    options: SpeedOptions,
    out_dir: Path,
    backend_names: list[str] | None = None,
    peer_names: list[str] | None = None,
    peer_python: Path = peers_mod.DEFAULT_PEER_PYTHON,
    peer_cache: Path = peers_mod.PEER_CACHE,
    log=print,
) -> dict:
    """Run every backend (and peer) in its own subprocess; write results.json, report.md, plots."""
    from backends import BACKEND_NAMES, load_manifest

    from . import report

    manifest = load_manifest(export_dir)
    skipped = {}
    if backend_names is None:
        backend_names, skipped = default_backends(manifest)
    unknown = [n for n in backend_names if n not in BACKEND_NAMES]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; expected any of: {', '.join(BACKEND_NAMES)}")
    peer_names = peer_names or []
    bad = [p for p in peer_names if p not in peers_mod.PEER_NAMES]
    if bad:
        raise ValueError(f"unknown peer(s) {', '.join(bad)}; expected any of: {', '.join(peers_mod.PEER_NAMES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "logs").mkdir(exist_ok=True)
    env = environment(options.threads)
    sentences = [p.en for p in pairs]
    ids = source_ids(export_dir, sentences)
    lengths = [len(i) for i in ids]
    spec_path, spec_nosweep_path = out_dir / "spec.json", out_dir / "spec-nosweep.json"
    make_spec(sentences, lengths, options, sweep=True, ids=ids).save(spec_path)
    make_spec(sentences, lengths, options, sweep=False, ids=ids).save(spec_nosweep_path)
    started = time.perf_counter()

    jobs = []  # (name, command without --spec/--out, whether it times the sweep, extra result fields)
    for name in backend_names:
        cmd = [sys.executable, "-m", "bench.worker", "--backend", name, "--export", str(export_dir)]
        jobs.append((name, cmd, True, {}))
    failed = {}
    if peer_names:
        source = Path(manifest.data["source_model"].get("path") or "")
        prepared = {}
        if not source.is_dir():
            failed.update({p: f"the source model folder {source} is gone; the peers convert from it" for p in peer_names})
        else:
            runnable = list(peer_names)
            if not Path(peer_python).is_file():
                missing = [p for p in peer_names if p not in peers_mod.IN_PROJECT_ENV]
                failed.update({p: f"{peer_python} not found: create the peer environment with `make bench-venv`"
                               for p in missing})
                runnable = [p for p in peer_names if p not in missing]
            prepared = peers_mod.prepare(source, Path(peer_cache) / Path(export_dir).name, runnable,
                                         Path(peer_python), log=log)
        for name in [n for n, p in prepared.items() if "error" in p]:
            failed[name] = prepared.pop(name)["error"]
            log(f"{name}: {failed[name].splitlines()[0]}")
        for name, prep in prepared.items():
            python = sys.executable if name in peers_mod.IN_PROJECT_ENV else str(peer_python)
            cmd = [python, "-m", "bench.peers", "worker", "--peer", name, "--model-dir", prep["dir"], "--source", str(source)]
            extra = {"conversion": {k: v for k, v in prep.items() if k != "dir"}}
            jobs.append((name, cmd, options.sweep_peers, extra))

    per_round: dict[str, list[dict]] = {}
    for round_ in range(options.rounds):
        for name, cmd, sweeps, extra in jobs:
            if name in failed:
                continue  # a runtime that failed once is not retried: its error is the result
            tag = name if options.rounds == 1 else f"{name}.round{round_ + 1}"
            suffix = "" if options.rounds == 1 else f" (round {round_ + 1} of {options.rounds})"
            log(f"{name}: running in its own process{suffix} ...")
            # The output-length sweep is timed in the first round only: it is a curve, not a ratio.
            spec = spec_path if sweeps and round_ == 0 else spec_nosweep_path
            out_json = out_dir / "logs" / f"{tag}.json"
            r = _run_subprocess([*cmd, "--spec", str(spec), "--out", str(out_json)], out_json,
                                out_dir / "logs" / f"{tag}.log", options.threads, options.timeout_s)
            if "error" in r:
                failed[name] = r["error"]
                per_round.pop(name, None)
                log(f"{name}: FAILED: {r['error'].splitlines()[0]}")
                continue
            per_round.setdefault(name, []).append({**r, **extra})
            _log_result(name, r, log)
    runtimes = {name: merge_rounds(rs) for name, rs in per_round.items()}
    if options.rounds > 1:
        for name, r in runtimes.items():
            _log_result(f"{name} (median of {len(per_round[name])})", r, log)

    env["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    if options.floor:
        log("memory-bandwidth floor: measuring read bandwidth ...")
        env["floor"] = floor_mod.floors(export_dir, manifest, options.threads)
    venv_peer = next((r for n, r in runtimes.items() if r.get("kind") == "peer" and n not in peers_mod.IN_PROJECT_ENV), None)
    if venv_peer:
        env["peer_environment"] = {"python": str(peer_python), "versions": venv_peer["versions"]}
    results = {
        "kind": "speed",
        "model": _model_info(export_dir, manifest),
        "environment": env,
        "options": {**options.__dict__, "batch_sizes": list(options.batch_sizes), "sweep_lengths": list(options.sweep_lengths)},
        "sentences": _sentence_info(pairs, lengths, make_spec(sentences, lengths, options, sweep=True)),
        "what_is_timed": WHAT_IS_TIMED,
        "reference": REFERENCE,
        "runtimes": runtimes,
        "failed": failed,
        "not_run": skipped,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    add_comparisons(results, [p.zh for p in pairs])
    report.write(results, out_dir)
    return results


def _log_result(name: str, r: dict, log) -> None:
    lat = r["latency"]
    thr = " ".join(f"b{b} {t['sentences_per_s']:.2f} sent/s" for b, t in r["throughput"].items())
    log(f"{name}: load {r['load_s']:.2f} s; batch 1 p50 {lat['p50']:.1f} ms p90 {lat['p90']:.1f} p99 {lat['p99']:.1f} "
        f"({lat['ms_per_token_p50']:.2f} ms/token); {thr}; peak RSS {r['peak_rss_mb']:.0f} MB")


def merge_rounds(rounds: list[dict]) -> dict:
    """One runtime's results over several rounds -> the first round's result with every timing
    replaced by its median over the rounds, peak RSS by its maximum, and the per-round figures
    kept under `rounds` so the spread is on record."""
    if len(rounds) == 1:
        return rounds[0]
    merged = json.loads(json.dumps(rounds[0]))  # a deep copy: outputs, info and the sweep of round 1
    med = lambda values: float(np.median(values))  # noqa: E731
    merged["load_s"] = med([r["load_s"] for r in rounds])
    merged["peak_rss_mb"] = max(r["peak_rss_mb"] for r in rounds)
    for key, value in rounds[0]["latency"].items():
        if isinstance(value, (int, float)) and key not in ("n", "hit_cap", "tokens_mean"):
            merged["latency"][key] = med([r["latency"][key] for r in rounds])
    for batch, first in rounds[0]["throughput"].items():
        seconds = med([r["throughput"][batch]["seconds"] for r in rounds])
        merged["throughput"][batch]["seconds"] = seconds
        merged["throughput"][batch]["sentences_per_s"] = first["sentences"] / seconds
        merged["throughput"][batch]["tokens_per_s"] = first["generated_tokens"] / seconds
    merged["rounds"] = [
        {"b1_p50_ms": r["latency"]["p50"], **{f"b{b}_sent_per_s": t["sentences_per_s"] for b, t in r["throughput"].items()}}
        for r in rounds
    ]
    return merged


def _model_info(export_dir: Path, manifest) -> dict:
    m = manifest.data["model"]
    return {"export": str(export_dir), "source": manifest.data["source_model"], "parameters": m.get("parameters"),
            "layers": f"{m['encoder_layers']}+{m['decoder_layers']}", "d_model": m["d_model"], "vocab_size": m["vocab_size"]}


def _sentence_info(pairs: list[Pair], lengths: list[int], spec: Spec) -> dict:
    words = [len(p.en.split()) for p in pairs]
    return {
        "count": len(pairs),
        "latency_sentences": len(spec.latency_idx),
        "throughput_sentences": len(spec.throughput_idx),
        "sweep_sentences": len(spec.sweep_idx),
        "words_min_median_max": [min(words), float(np.median(words)), max(words)],
        "source_tokens_min_median_max": [min(lengths), float(np.median(lengths)), max(lengths)],
        "has_references": all(p.zh for p in pairs),
    }


def add_comparisons(results: dict, references: list[str | None]) -> None:
    """Agreement with the reference runtime, ratios to it, and BLEU/chrF when quality is meaningful."""
    runtimes = results["runtimes"]
    ref_name = results["reference"] if results["reference"] in runtimes else next(iter(runtimes), None)
    results["reference"] = ref_name
    if ref_name is None:
        return
    ref = runtimes[ref_name]
    ref_ids = [o["ids"] for o in ref["outputs"]]
    forced = results["options"].get("forced_tokens")
    n = len(ref_ids)
    refs = references[:n]
    for name, r in runtimes.items():
        cmp = {}
        ids = [o["ids"] for o in r["outputs"]]
        a = metrics.agreement(ids, ref_ids)
        cmp["identical_to_reference"] = a["identical_share"]
        cmp["first_divergence_buckets"] = a["first_divergence_buckets"]
        cmp["latency_p50_ratio"] = r["latency"]["p50"] / ref["latency"]["p50"]
        cmp["ms_per_token_ratio"] = r["latency"]["ms_per_token_p50"] / ref["latency"]["ms_per_token_p50"]
        for b, t in r["throughput"].items():
            if b in ref["throughput"]:
                cmp[f"throughput_b{b}_ratio"] = t["sentences_per_s"] / ref["throughput"][b]["sentences_per_s"]
        if not forced and refs and all(refs):
            cmp["quality_vs_references"] = metrics.bleu_chrf([o["text"] for o in r["outputs"]], refs)
        r["comparison"] = cmp
    results["claims"] = claims(results)
    results["targets"] = targets(results)


# The migration article's claims, checked on every run. A speed claim holds when the measured
# speedup reaches at least 90% of the claimed one; "identical" holds only at 100% identical tokens.
CLAIMS = (
    ("ONNX Runtime fp32 about 40% faster than PyTorch", "ort_fp32_kv_cache", "pytorch", 1.4),
    ("fp16 another 30% faster than ONNX fp32", "ort_fp16", "ort_fp32_kv_cache", 1.3),
    ("KV cache about 2x faster than single-step", "ort_fp32_kv_cache", "ort_fp32_single_step", 2.0),
)
TOLERANCE = 0.9


def claims(results: dict) -> list[dict]:
    """Each claim with the measured ratio at batch 1 (p50), at the largest batch, and a verdict."""
    rt = results["runtimes"]
    big = str(results["options"]["batch_sizes"][-1])
    out = []
    for text, fast, slow, claimed in CLAIMS:
        if fast not in rt or slow not in rt:
            out.append({"claim": text, "held": None, "measured": f"not measured ({fast} or {slow} did not run)"})
            continue
        b1 = rt[slow]["latency"]["p50"] / rt[fast]["latency"]["p50"]
        thr_fast, thr_slow = rt[fast]["throughput"].get(big), rt[slow]["throughput"].get(big)
        bb = thr_fast["sentences_per_s"] / thr_slow["sentences_per_s"] if thr_fast and thr_slow else None
        held = b1 >= claimed * TOLERANCE
        measured = f"{b1:.2f}x at batch 1 (p50)" + (f", {bb:.2f}x at batch {big}" if bb else "")
        entry = {"claim": text, "claimed_speedup": claimed, "speedup_batch1_p50": b1, f"speedup_batch{big}": bb,
                 "held": held, "measured": measured}
        if fast == "ort_fp32_kv_cache" and slow == "ort_fp32_single_step":
            sweep = {n: rt[slow]["sweep"][n]["ms_per_sentence"] / rt[fast]["sweep"][n]["ms_per_sentence"]
                     for n in rt[fast].get("sweep", {}) if n in rt[slow].get("sweep", {})}
            if sweep:
                entry["speedup_by_forced_length"] = sweep
                entry["measured"] += "; by forced length: " + ", ".join(f"{n}: {v:.2f}x" for n, v in sweep.items())
        out.append(entry)
    ref = results.get("reference")
    for name in ("ort_fp32_single_step", "ort_fp32_kv_cache", "ort_fp16", "ort_int8"):
        if name in rt and ref in rt and name != ref:
            share = rt[name]["comparison"]["identical_to_reference"]
            out.append({"claim": f"translations identical ({name} vs {ref})", "identical_share": share,
                        "held": share == 1.0, "measured": f"{share:.1%} of {len(rt[name]['outputs'])} sentences identical"})
    return out


# The speed issue's targets (fp32 KV cache and int8 against PyTorch, CTranslate2 and Optimum), checked
# on every run where the runtimes they name took part. Batch 1 compares p50 latency.
def targets(results: dict) -> list[dict]:
    rt, big = results["runtimes"], str(results["options"]["batch_sizes"][-1])
    floor = results["environment"].get("floor", {}).get("graphs", {})

    def p50(name):
        return rt[name]["latency"]["p50"] if name in rt else None

    def thr(name):
        t = rt.get(name, {}).get("throughput", {}).get(big)
        return t["sentences_per_s"] if t else None

    out = []

    def check(text, value, limit, higher_is_better, fmt):
        if value is None or limit is None:
            out.append({"target": text, "held": None, "measured": "not measured (a runtime it needs did not run)"})
            return
        held = value >= limit if higher_is_better else value <= limit
        out.append({"target": text, "value": value, "limit": limit, "held": held, "measured": fmt(value, limit)})

    kv, i8 = "ort_fp32_kv_cache", "ort_int8"
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    check("ORT fp32 KV cache, batch 1: at most 0.45x PyTorch's latency", ratio(p50(kv), p50("pytorch")), 0.45, False,
          lambda v, _: f"{v:.2f}x PyTorch's p50")
    check("ORT fp32 KV cache, batch 1: no slower than CTranslate2 float32", ratio(p50(kv), p50("ct2_float32")), 1.0,
          False, lambda v, _: f"{v:.2f}x CTranslate2 float32's p50")
    for name, graph in ((kv, "decoder"), (i8, "decoder_int8")):
        per_token = rt.get(name, {}).get("latency", {}).get("ms_per_token_p50")
        f = floor.get(graph, {}).get("floor_ms_per_token")
        check(f"{name}, batch 1: ms per token within 1.3x of the memory-bandwidth floor", ratio(per_token, f), 1.3,
              False, lambda v, _, f=f, t=per_token: f"{t:.2f} ms/token = {v:.2f}x the {f:.2f} ms floor")
    check(f"ORT fp32 KV cache, batch {big}: at least 1.5x PyTorch's throughput", ratio(thr(kv), thr("pytorch")), 1.5,
          True, lambda v, _: f"{v:.2f}x PyTorch's sentences/s")
    check(f"ORT fp32 KV cache, batch {big}: above Optimum fp32's throughput", ratio(thr(kv), thr("optimum_fp32")), 1.0,
          True, lambda v, _: f"{v:.2f}x Optimum fp32's sentences/s")
    check("KV cache at least 2x faster than single-step (batch 1, this run's output length)",
          ratio(p50("ort_fp32_single_step"), p50(kv)), 2.0, True, lambda v, _: f"{v:.2f}x")
    check("ort_int8, batch 1: no slower than CTranslate2 int8", ratio(p50(i8), p50("ct2_int8")), 1.0, False,
          lambda v, _: f"{v:.2f}x CTranslate2 int8's p50")
    check(f"ort_int8, batch {big}: at least 0.8x CTranslate2 int8's throughput", ratio(thr(i8), thr("ct2_int8")), 0.8,
          True, lambda v, _: f"{v:.2f}x CTranslate2 int8's sentences/s")
    return out


def quick_run(
    backends: dict,
    sentences: list[str],
    progress=None,
    forced_tokens: int | None = None,
    max_new_tokens: int = 256,
    references: list[str] | None = None,
    source: str | None = None,
    not_run: dict[str, str] | None = None,
) -> dict:
    """A small in-process benchmark of already loaded backends, for the app (at most 20 sentences).

    Same protocol as `python -m bench speed`, but every backend shares this process, so load time,
    peak memory and the length sweep are not measured (the full command does that). One warm-up call,
    batch-1 latency over every sentence, then one length-sorted pass at batch min(8, n).
    `progress(fraction, message)` is called between backends and between their phases, never inside
    a timed call (gradio's gr.Progress fits; it is falsy, having a len of 0, hence `is not None`).
    `source` says where the sentences came from; `not_run` names backends that could not take part,
    with why. Returns the same layout as results.json; `bench.report.write(result, folder)` saves it.
    """
    from .worker import BackendRuntime

    sentences = [s.strip() for s in sentences if s and s.strip()]
    if not 1 <= len(sentences) <= QUICK_RUN_LIMIT:
        raise ValueError(f"quick_run takes 1 to {QUICK_RUN_LIMIT} sentences, got {len(sentences)}")
    if references is not None and len(references) != len(sentences):
        raise ValueError(f"{len(references)} references for {len(sentences)} sentences")
    if not backends:
        raise ValueError("no backend to benchmark")
    first = next(iter(backends.values()))
    threads = first.info.get("threads") or 1
    env = environment(threads)  # before the run, so the load average is the one at start
    started = time.perf_counter()
    options = SpeedOptions(threads=threads, forced_tokens=forced_tokens, max_new_tokens=max_new_tokens,
                           batch_sizes=(min(8, len(sentences)),), sweep_lengths=(), warmup=1)
    lengths = [first.tokenizer.count_tokens(s) for s in sentences]
    spec = make_spec(sentences, lengths, options, sweep=False)
    phases = 3  # warm-up, batch-1 latency, throughput: the messages `measure` reports between them
    runtimes = {}
    for k, (name, backend) in enumerate(backends.items()):
        done = iter(range(phases))

        def report_phase(msg: str, k=k, name=name, done=done) -> None:
            if progress is not None:
                step = next(done, phases - 1)
                progress((k + step / phases) / len(backends), f"{name} ({k + 1}/{len(backends)}): {msg}")

        r = measure(BackendRuntime(backend), spec, report_phase)
        r.update(name=name, kind="backend", info=dict(backend.info), in_process=True)
        r.pop("peak_rss_mb", None)  # the whole app's peak, not this backend's: not reported
        r.pop("rss_after_warmup_mb", None)
        runtimes[name] = r
    if progress is not None:
        progress(1.0, "done")
    env["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    info = _sentence_info([Pair(s) for s in sentences], lengths, spec)
    info["source"] = source
    info["has_references"] = bool(references) and all(references)
    results = {
        "kind": "speed",
        "quick": True,
        "model": _model_info(first.manifest.root, first.manifest),
        "environment": env,
        "options": {**options.__dict__, "batch_sizes": list(options.batch_sizes), "sweep_lengths": []},
        "sentences": info,
        "what_is_timed": QUICK_WHAT_IS_TIMED,
        "reference": REFERENCE,
        "runtimes": runtimes,
        "failed": {},
        "not_run": dict(not_run or {}),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    add_comparisons(results, references or [None] * len(sentences))
    return results
