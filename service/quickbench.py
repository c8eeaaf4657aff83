"""The app's quick benchmark: the backends it has loaded, timed in its own process, saved as a report.

The same protocol (`protocol.measure`) and results.json layout (`speedrun`) as `python -m bench
speed`, over at most 20 sentences; load time, memory and the length sweep are left out, and the
report says so. `check_count` and `quick_sentences` are the request's checks and its sentences,
`quick_run` the measuring, `save_quick` a new folder in the results directory.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path
from typing import Any

from backends import REFERENCE
from corpus import DEV_TSV, Pair, default_sample
from runtime.protocol import BackendRuntime, measure

from .environment import environment
from .reports import write
from .speedrun import GREEDY, SpeedOptions, add_comparisons, make_spec, model_info, sentence_info

QUICK_RUN_LIMIT = 20  # sentences in the app's quick run: a few seconds per backend on a small CPU
FULL_COMMAND = "python -m bench speed"  # the full benchmark, named wherever the quick run falls short of it

QUICK_WHAT_IS_TIMED = (
    "Wall-clock time of one translate call per batch (time.perf_counter): tokenization, encoder, every "
    "decoder step, the runtime's search loop and detokenization. Excluded: model loading (the app loaded "
    "the backends when it started) and the warm-up calls (one single sentence and one batch). Greedy search (num_beams 1), whatever the model's own generation config; token ids and text only (top_k=1, output_scores=False). "
    "Quick run: all backends share the app's process, one after the other, while no translation runs; load "
    "time, peak memory, size on disk and the output-length sweep are not measured (`python -m bench speed` "
    "measures them, each runtime alone in its own process)."
)


def check_count(count: Any) -> int:
    """The number of sentences a quick run was asked for: a whole number from 1 to QUICK_RUN_LIMIT."""
    if isinstance(count, float) and count.is_integer():
        count = int(count)  # number widgets send floats
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= QUICK_RUN_LIMIT:
        raise ValueError(f"the number of sentences must be a whole number from 1 to {QUICK_RUN_LIMIT}, got {count!r}")
    return count


def quick_sentences(count: int, examples: list[str]) -> tuple[list[str], list[str] | None, str]:
    """(sentences, references, where they came from): the full benchmark's own sample, its first
    `count` sentences with their references, so a quick run times the very sentences a full run
    starts with; the app's `examples` when the dev set is absent."""
    if DEV_TSV.is_file():
        pairs = default_sample()[:count]
        return [p.en for p in pairs], [p.zh for p in pairs], (
            f"the start of `{FULL_COMMAND}`'s 200-sentence sample of {DEV_TSV.name}")
    if len(examples) < count:
        raise ValueError(f"{DEV_TSV} is absent and the app has {len(examples)} examples; "
                         f"choose at most {len(examples)} sentences")
    return examples[:count], None, f"the app's first {count} examples"


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
    with why. Returns the same layout as results.json; `save_quick` (or `reports.write`) writes it.
    """
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
    info = sentence_info([Pair(s) for s in sentences], lengths, spec)
    info["source"] = source
    info["has_references"] = bool(references) and all(references)
    results = {
        "kind": "speed",
        "quick": True,
        "model": model_info(first.manifest.root, first.manifest),
        "environment": env,
        "options": {**options.__dict__, "batch_sizes": list(options.batch_sizes), "sweep_lengths": []},
        "sentences": info,
        "what_is_timed": QUICK_WHAT_IS_TIMED,
        "decoding": GREEDY,  # BackendRuntime's default, whatever the model's own config says
        "reference": REFERENCE,
        "runtimes": runtimes,
        "failed": {},
        "not_run": dict(not_run or {}),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    add_comparisons(results, references or [None] * len(sentences))
    return results


def save_quick(results: dict, results_dir: str | Path, export: Path | None) -> Path:
    """Write a quick run into a new folder of `results_dir`, quick-<export name>-<UTC time>, where
    the Benchmark tab finds it as the newest report; returns its results.json."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    folder = Path(results_dir) / f"quick-{export.name if export else 'model'}-{stamp}"
    k = 1
    while folder.exists():  # two runs in one second: keep both
        k += 1
        folder = folder.with_name(f"{folder.name.rsplit('~', 1)[0]}~{k}")
    return write(results, folder)["json"]
