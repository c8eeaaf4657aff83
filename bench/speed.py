"""python -m bench speed: load time, latency, throughput, memory and size of every backend (and peer).

Each backend runs alone in its own subprocess (`bench.worker`; peers: `bench.peers worker` in the
peer environment) over the very same work, written once as `spec.json`: the same sentences, batch
sizes, threads and forced lengths. See bench/README.md for what is timed and what is left out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from backends import REFERENCE
from corpus import Pair
from runtime.protocol import Spec
from service.environment import environment
from service.reports import failure_line, write
from service.speedrun import (FLOOR_TARGETS, SpeedOptions, add_comparisons, choose_setting, decoding_sentence, make_spec,
                               model_info, paired_figure_names, paired_figures, paired_key, paired_spec, probe_spec,
                               sentence_info, summarize_pairs, target_pairs)

from . import floor as floor_mod
from .data import REPO, default_backends
from .decoding import SWEEP_IS_GREEDY, decode_args, resolve_decoding
from .peers import DEFAULT_PEER_PYTHON, IN_PROJECT_ENV, PEER_CACHE, PEER_NAMES, ct2_setting_args, ct2_settings, is_ct2
from .peers.jobs import peer_jobs
from .rounds import log_result, merge_rounds

# `--quick`: small, stated samples so the opus-sized run with peers fits in about 15 minutes.
QUICK = dict(latency_sentences=40, throughput_sentences=64, sweep_sentences=3)

WHAT_IS_TIMED = (
    "Wall-clock time of one translate call per batch (time.perf_counter): tokenization, encoder, every "
    "decoder step, the runtime's search loop and detokenization. Excluded: process start, imports and "
    "model loading (reported separately as load time, which for our backends includes the sha256 check "
    "of the graph files), and the warm-up calls (the first few single sentences and one batch per batch "
    "size). {search} Our backends return token ids and text, as every peer does (top_k=1, "
    "output_scores=False: no per-step log-probs). Each runtime runs alone in its own process; peak RSS is that "
    "process's maximum resident memory over the whole run (load, warm-up, batch 1 and the largest batch), "
    "so it includes the Python interpreter and the runtime library."
)

PROBE_AGAIN = 2.0  # after the first pass, only settings within this factor of the best score run again
PROBE_RULE = (
    "each CTranslate2 setting (GEMM library: Intel MKL or oneDNN, via CT2_USE_MKL; threads: intra_threads and "
    "MKL/OpenMP threads, at most the run's) ran in its own process over {n} batch-1 sentences and one batch of the "
    "largest size, each setting that many times (after the first pass only those within {again:g}x of the best score), "
    "the order reversed every other time; the setting with the "
    "lowest best batch-1 p50 divided by its best throughput was used in every round and pair"
)

def source_ids(export_dir: Path, sentences: list[str]) -> list[list[int]]:
    """Our tokenizer's ids per sentence (the export's family and source language): peers check theirs match."""
    from backends.tokenizer import TokenizerWrapper

    tok = TokenizerWrapper(export_dir)
    return [tok.encode([s], 10**6).input_ids[0].tolist() for s in sentences]


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
    peer_python: Path = DEFAULT_PEER_PYTHON,
    peer_cache: Path = PEER_CACHE,
    log=print,
    num_beams: int | str = 1,
    length_penalty: float | None = None,
    early_stopping: bool | str | None = None,
    external: dict[str, str | Path] | None = None,
) -> dict:
    """Run every backend (and peer) in its own subprocess; write results.json, report.md, plots.

    num_beams: every runtime runs greedy search (1, the default) or beam search with that many beams;
    "model": the export's generation config. See `resolve_decoding`. The output-length sweep is a
    greedy measurement: with beam search it is not run, and results.json says so (`sweep_skipped`).
    external: {NAME: DIR} of Optimum-layout exports of the same model (backends/ort_external.py),
    each timed as backend NAME in its own worker after the built-in backends, with the same work.
    """
    from backends import BACKEND_NAMES, check_external, load_manifest
    from backends.ort_external import find_layout

    external = {n: os.path.abspath(p) for n, p in check_external(external).items()}  # the worker runs elsewhere
    taken = [n for n in external if n in PEER_NAMES]
    if taken:
        raise ValueError(f"external backend name(s) {', '.join(taken)} taken by a peer runtime; choose others than: "
                         f"{', '.join(PEER_NAMES)}")
    for path in external.values():
        find_layout(path)  # a folder that holds no export fails now, not after the other runtimes

    manifest = load_manifest(export_dir)
    decoding = resolve_decoding(manifest, num_beams, length_penalty, early_stopping)
    sweep_skipped = None
    if decoding["search"] == "beam" and options.sweep_lengths:
        sweep_skipped = SWEEP_IS_GREEDY.format(n=decoding["num_beams"])
        options = dataclasses.replace(options, sweep_lengths=())
        log(f"length sweep skipped: {sweep_skipped}")
    log(f"decoding: {decoding['label']} for every runtime")
    skipped = {}
    if backend_names is None:
        backend_names, skipped = default_backends(manifest)
    unknown = [n for n in backend_names if n not in BACKEND_NAMES]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; expected any of: {', '.join(BACKEND_NAMES)}")
    peer_names = peer_names or []
    bad = [p for p in peer_names if p not in PEER_NAMES]
    if bad:
        raise ValueError(f"unknown peer(s) {', '.join(bad)}; expected any of: {', '.join(PEER_NAMES)}")
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
        cmd = [sys.executable, "-m", "bench.worker", "--backend", name, "--export", str(export_dir),
               *decode_args(decoding)]
        jobs.append((name, cmd, True, {"command": cmd}))
    for name, path in external.items():
        cmd = [sys.executable, "-m", "bench.worker", "--backend", name, "--export", str(export_dir),
               "--external-dir", path, *decode_args(decoding)]
        jobs.append((name, cmd, True, {"command": cmd}))
    failed = {}
    if peer_names:
        peer_cmds, failed = peer_jobs(manifest, export_dir, peer_names, peer_python, peer_cache, decoding, log)
        jobs += [(name, cmd, options.sweep_peers, extra) for name, cmd, extra in peer_cmds]

    ct2_probes = {}
    if options.ct2_probe_rounds and any(is_ct2(name) for name, *_ in jobs):
        probe_path = out_dir / "spec-probe.json"
        probe_spec(Spec.load(spec_nosweep_path)).save(probe_path)
        for k, (name, cmd, sweeps, extra) in enumerate(jobs):
            if not is_ct2(name):
                continue
            probe = _probe_ct2(name, cmd, probe_path, options, out_dir, log)
            ct2_probes[name] = probe
            if "error" in probe:
                failed[name] = probe["error"]
                continue
            cmd = [*cmd, *ct2_setting_args(probe["chosen"])]
            jobs[k] = (name, cmd, sweeps, {**extra, "command": cmd})

    # The batch-1 floor targets (greedy, forced lengths) compare each round with a floor measured
    # just before it; the end-of-run floor stays for the report's table.
    floor_beside_rounds = options.floor and bool(options.forced_tokens) and decoding["search"] == "greedy"
    floor_of = {name: graph for name, graph, _ in FLOOR_TARGETS}
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
            beside = None
            if floor_beside_rounds and name in floor_of:
                # Read bandwidth drifts on a shared host: a floor taken at the end of the run can be
                # minutes and a different machine state away from the round it judges.
                graph = floor_of[name]
                measured = floor_mod.floors(export_dir, manifest, options.threads, graphs=(graph,))
                beside = {"gb_per_s": measured["bandwidth"]["gb_per_s"], **measured["graphs"][graph]}
                log(f"{name}: floor just before this round: {beside['floor_ms_per_token']:.2f} ms/token "
                    f"({beside['gb_per_s']} GB/s); ORT's weight products alone {beside['matmuls_alone']['ms']:.2f} ms, "
                    f"the rest of the step's kernels alone {beside['others_alone']['ms']:.2f} ms")
            r = _run_subprocess([*cmd, "--spec", str(spec), "--out", str(out_json)], out_json,
                                out_dir / "logs" / f"{tag}.log", options.threads, options.timeout_s)
            if "error" in r:
                failed[name] = r["error"]
                per_round.pop(name, None)
                log(f"{name}: FAILED: {failure_line(r['error'])}")
                continue
            if beside is not None:
                r["floor_beside"] = beside
            per_round.setdefault(name, []).append({**r, **extra})
            log_result(name, r, log)
    runtimes = {name: merge_rounds(rs) for name, rs in per_round.items()}
    if options.rounds > 1:
        for name, r in runtimes.items():
            log_result(f"{name} (median of {len(per_round[name])})", r, log)

    paired = {}
    if options.paired_rounds:
        paired_path = out_dir / "spec-paired.json"
        paired_spec(Spec.load(spec_nosweep_path), decoding).save(paired_path)
        commands = {name: cmd for name, cmd, _, _ in jobs}
        for ours, peer in target_pairs(decoding):
            if ours in runtimes and peer in runtimes:
                paired.update(_paired_check(ours, peer, commands, paired_path, decoding, options, out_dir, log))
        if not paired:
            log("paired check: no target had both of its runtimes in this run; nothing paired")

    env["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    if options.floor:
        log("memory-bandwidth floor: measuring read bandwidth ...")
        env["floor"] = floor_mod.floors(export_dir, manifest, options.threads)
    venv_peer = next((r for n, r in runtimes.items() if r.get("kind") == "peer" and n not in IN_PROJECT_ENV), None)
    if venv_peer:
        env["peer_environment"] = {"python": str(peer_python), "versions": venv_peer["versions"]}
    results = {
        "kind": "speed",
        "model": model_info(export_dir, manifest),
        "environment": env,
        "options": {**options.__dict__, "batch_sizes": list(options.batch_sizes), "sweep_lengths": list(options.sweep_lengths),
                    "num_beams": decoding["num_beams"], "length_penalty": length_penalty, "early_stopping": early_stopping},
        "decoding": decoding,
        "sentences": sentence_info(pairs, lengths, make_spec(sentences, lengths, options, sweep=True)),
        "what_is_timed": WHAT_IS_TIMED.format(search=decoding_sentence(decoding, _has_ct2(peer_names))),
        "reference": REFERENCE,
        "runtimes": runtimes,
        "failed": failed,
        "not_run": skipped,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if paired:
        results["paired"] = paired
    if ct2_probes:
        results["ct2_settings"] = ct2_probes
    if sweep_skipped:
        results["sweep_skipped"] = sweep_skipped
    if external:
        results["external"] = external
    add_comparisons(results, [p.zh for p in pairs])
    write(results, out_dir)
    return results


def _paired_check(ours: str, peer: str, commands: dict[str, list[str]], spec_path: Path, decoding: dict,
                  options: SpeedOptions, out_dir: Path, log) -> dict:
    """`options.paired_rounds` pairs of fresh processes, `ours` and `peer` back to back over the
    work in `spec_path`, the first of each pair alternating; see SpeedOptions.paired_rounds.
    -> {paired_key: summary} for each figure the pairs timed."""
    big = str(options.batch_sizes[-1])
    pairs: dict[str, list[dict]] = {}
    for k in range(options.paired_rounds):
        order = (ours, peer) if k % 2 == 0 else (peer, ours)
        figures: dict[str, dict] = {}
        for name in order:
            tag = f"paired.{ours}-{peer}.{k + 1}.{name}"
            out_json = out_dir / "logs" / f"{tag}.json"
            r = _run_subprocess([*commands[name], "--spec", str(spec_path), "--out", str(out_json)], out_json,
                                out_dir / "logs" / f"{tag}.log", options.threads, options.timeout_s)
            if "error" in r:
                log(f"paired check {ours}/{peer}: {name} FAILED in pair {k + 1}: {failure_line(r['error'])}")
                failed = {"ours": ours, "peer": peer, "error": f"{name} in pair {k + 1}: {r['error']}"}
                return {paired_key(ours, peer, f, decoding, big): {**failed, "pairs": pairs.get(f, [])}
                        for f in paired_figure_names(decoding, big)}
            for figure, value in paired_figures(r, decoding, big).items():
                figures.setdefault(figure, {"first": order[0]})[name] = value
        for figure, pair in figures.items():
            pairs.setdefault(figure, []).append(pair)
    out = {}
    for figure, figure_pairs in pairs.items():
        summary = summarize_pairs(ours, peer, figure_pairs, decoding, big, figure)
        log(f"paired check {ours}/{peer} ({figure}): median pair {summary['median_ratio']:.2f}x, "
            f"ours ahead in {summary['ours_ahead']} of {summary['n']} "
            f"(each pair: {', '.join(format(p['ratio'], '.2f') for p in summary['pairs'])})")
        out[paired_key(ours, peer, figure, decoding, big)] = summary
    return out


def _probe_ct2(name: str, cmd: list[str], spec_path: Path, options: SpeedOptions, out_dir: Path, log) -> dict:
    """Time each of CTranslate2's settings (peers.ct2_settings) `options.ct2_probe_rounds` times over
    the probe spec, the order reversed every other round; the fastest is chosen (choose_setting).
    A setting that fails is reported and left out; all failing fails the peer."""
    settings = ct2_settings(options.threads)
    big = str(options.batch_sizes[-1])
    trials, errors = [], []
    for k in range(options.ct2_probe_rounds):
        if k and trials:  # a setting far behind after a pass is not timed again: one pass of it can take minutes
            rows = choose_setting(trials)["settings"]
            best = min(r["score"] for r in rows)
            near = [r["setting"] for r in rows if r["score"] <= PROBE_AGAIN * best]  # a failed setting is in no row
            settings = [st for st in settings if st in near]
        for setting in settings if k % 2 == 0 else settings[::-1]:
            tag = f"probe.{name}.{setting['gemm']}-{setting['threads']}.{k + 1}"
            out_json = out_dir / "logs" / f"{tag}.json"
            r = _run_subprocess([*cmd, *ct2_setting_args(setting), "--spec", str(spec_path), "--out", str(out_json)],
                                out_json, out_dir / "logs" / f"{tag}.log", options.threads, options.timeout_s)
            if "error" in r:
                errors.append({"setting": setting, "error": r["error"]})
                log(f"{name} setting probe: {setting} FAILED: {failure_line(r['error'])}")
                continue
            trials.append({"setting": setting, "latency_p50_ms": r["latency"]["p50"],
                           "sentences_per_s": r["throughput"][big]["sentences_per_s"]})
    if not trials:
        return {"error": "every CTranslate2 setting failed in the probe: "
                         + "; ".join(f"{e['setting']}: {failure_line(e['error'])}" for e in errors), "errors": errors}
    probe = {**choose_setting(trials), "trials": trials, "errors": errors, "rounds": options.ct2_probe_rounds,
             "rule": PROBE_RULE.format(n=len(Spec.load(spec_path).latency_idx), again=PROBE_AGAIN)}
    log(f"{name} setting probe: " + ", ".join(
        f"{r['setting']['gemm']}/{r['setting']['threads']}t {r['latency_p50_ms']:.1f} ms, {r['sentences_per_s']:.1f} sent/s"
        for r in probe["settings"]) + f"; chosen {probe['chosen']['gemm']} with {probe['chosen']['threads']} thread(s)")
    return probe


def _has_ct2(names) -> bool:
    return any(is_ct2(n) for n in names or [])


