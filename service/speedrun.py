"""A speed run's options and its work: shared by both speed runs.

`python -m bench speed` (every runtime alone in its own process) and the app's quick run
(`quickbench.py`, every loaded backend in the app's process) ask for their work with the same
`SpeedOptions` and `make_spec`, and write the same results.json layout: `model_info`,
`sentence_info`, and `add_comparisons` (`speed_verdicts`), which adds each runtime's agreement
with the reference, its ratios to it, BLEU/chrF when meaningful, the migration article's `claims`
and the speed `targets`. The paired check (`paired_spec`, `summarize_pairs`) and the CTranslate2
setting probe (`probe_spec`, `choose_setting`) are planned here too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from corpus import Pair
from runtime.protocol import Spec

from .speed_verdicts import (  # noqa: F401  (the verdicts are this module's API too)
    CLAIMS,
    CT2_PAIRS,
    FLOOR_TARGETS,
    I8,
    KV,
    LATENCY_FIGURE,
    TOLERANCE,
    add_comparisons,
    claims,
    floor_beside_rounds,
    targets,
    throughput_figure,
)

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
    # medians are reported: a shared machine's speed drifts over minutes, so one slot per runtime
    # can put a whole ratio on a slow minute.
    rounds: int = 1
    # Then each target that sets one of our runtimes against a peer is measured again as this many
    # pairs: the two runtimes' processes back to back over the same work, which one goes first
    # alternating, the ratio taken within each pair; the target's verdict is the median pair's.
    # Round-robin slots put minutes (the other runtimes) between the two sides of a ratio, long
    # enough for that drift to decide a verdict either way.
    paired_rounds: int = 0
    # Before the rounds, each CTranslate2 peer's settings (bench.peers.ct2_settings: MKL or oneDNN,
    # one thread or all) are each timed this many times over a short sample (`probe_spec`), and the
    # fastest is the one every round uses; 0: CTranslate2's own choice with all the threads. The
    # thread count that suits our runtimes can leave CTranslate2 well below its best.
    ct2_probe_rounds: int = 2

    def __post_init__(self):
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds!r}")
        if not isinstance(self.ct2_probe_rounds, int) or self.ct2_probe_rounds < 0:
            raise ValueError(f"ct2_probe_rounds must be 0 (no probe) or a positive integer, got {self.ct2_probe_rounds!r}")
        if not isinstance(self.paired_rounds, int) or self.paired_rounds < 0:
            raise ValueError(f"paired_rounds must be 0 (no paired check) or a positive integer, got {self.paired_rounds!r}")
        if self.forced_tokens is not None and not 1 <= self.forced_tokens <= 511:
            raise ValueError(f"forced_tokens must be in 1..511, got {self.forced_tokens}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")


# What no speed run here measures; the report and the app's Benchmark tab say so next to the numbers.
NOT_MEASURED = (
    "cold start (the first run after boot, page cache empty), beam search, more than one request at a time, "
    "GPUs, and the accuracy of a random-weight fixture (meaningless)"
)

GREEDY = {"search": "greedy", "num_beams": 1, "label": "greedy"}  # results without a "decoding" block


def not_measured(results: dict) -> str:
    """NOT_MEASURED for this run: beam search is measured when the run used it."""
    if (results.get("decoding") or GREEDY)["search"] == "beam":
        return NOT_MEASURED.replace("beam search, ", "")
    return NOT_MEASURED


def decoding_sentence(decoding: dict, ct2: bool = False) -> str:
    """One sentence stating the search every runtime ran, for what_is_timed and report.md (`ct2`: with
    CTranslate2 among them)."""
    if decoding["search"] == "greedy":
        return "Greedy search (num_beams 1) for every runtime."
    config = "the export's generation config"
    settings = "; ".join(f"{k} {decoding[k]} ({'given' if k in decoding['given'] else config})"
                         for k in ("length_penalty", "early_stopping"))
    text = (f"Beam search with {decoding['num_beams']} beams for every runtime, the best hypothesis kept "
            f"(num_beams from {decoding['num_beams_from']}; {settings}).")
    if ct2:
        text += (" CTranslate2 gets the same length_penalty (and the model's repetition_penalty and "
                 "no_repeat_ngram_size, which it cannot read from the generation config) and keeps its own stopping "
                 "rule (patience 1); it scores "
                 "and length-normalises hypotheses its own way, so its agreement with the reference is a "
                 "measurement, not expected to be 100%.")
    return text


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


def model_info(export_dir: Path, manifest) -> dict:
    m = manifest.data["model"]
    return {"export": str(export_dir), "source": manifest.data["source_model"], "parameters": m.get("parameters"),
            "layers": f"{m['encoder_layers']}+{m['decoder_layers']}", "d_model": m["d_model"], "vocab_size": m["vocab_size"]}


def sentence_info(pairs: list[Pair], lengths: list[int], spec: Spec) -> dict:
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


# The batch-1 latency of a beam-search pair is timed over this many sentences (the round-robin
# uses all of the run's): a beam-search generate() call is slow enough that a few suffice.
PAIRED_LATENCY_SENTENCES = 10


def _greedy(decoding: dict) -> bool:
    return int(decoding.get("num_beams", 1)) == 1


def target_pairs(decoding: dict) -> list[tuple[str, str]]:
    """(ours, peer) of each target that compares two runtimes (see `targets`), for the paired check."""
    if _greedy(decoding):
        return list(CT2_PAIRS)  # throughput at the largest batch
    return [(KV, "transformers"), *CT2_PAIRS]  # batch-1 p50


def paired_spec(spec: Spec, decoding: dict) -> Spec:
    """The work of one side of a pair: only the figures its targets compare. Throughput at the
    largest batch size over the run's throughput sentences; with beam search also batch-1 latency
    over the first PAIRED_LATENCY_SENTENCES of the run's latency sentences. Same sentences, lengths
    and threads."""
    greedy = _greedy(decoding)
    return _part_of(spec, [] if greedy else spec.latency_idx[:PAIRED_LATENCY_SENTENCES],
                    spec.batch_sizes[-1:], spec.throughput_idx)


def _part_of(spec: Spec, latency_idx: list[int], batch_sizes: list[int], throughput_idx: list[int]) -> Spec:
    """A part of a run's work (no sweep), warmed up on at most its own batch-1 sentences."""
    return dataclasses.replace(spec, latency_idx=latency_idx, batch_sizes=batch_sizes, throughput_idx=throughput_idx,
                               sweep_lengths=[], sweep_idx=[], warmup=min(spec.warmup, len(latency_idx)))


def _primary_figure(decoding: dict, big: str) -> str:
    """The figure every run of the search compares: greedy, throughput; beam, batch-1 latency."""
    return throughput_figure(big) if _greedy(decoding) else LATENCY_FIGURE


def paired_key(ours: str, peer: str, figure: str, decoding: dict, big: str) -> str:
    """results["paired"]'s key for one figure of a pair: "ours/peer" for the search's primary figure,
    "ours/peer@figure" for another (beam's throughput)."""
    return f"{ours}/{peer}" if figure == _primary_figure(decoding, big) else f"{ours}/{peer}@{figure}"


def paired_figure_names(decoding: dict, big: str) -> list[str]:
    """The figures a pair times (`paired_spec`): throughput, and with beam search latency."""
    return [throughput_figure(big)] + ([] if _greedy(decoding) else [LATENCY_FIGURE])


def paired_figures(result: dict, decoding: dict, big: str) -> dict[str, float]:
    """What a paired run's targets compare: batch-`big` sentences/s, and with beam search batch-1 p50 ms."""
    out = {throughput_figure(big): result["throughput"][big]["sentences_per_s"]}
    if not _greedy(decoding):
        out[LATENCY_FIGURE] = result["latency"]["p50"]
    return out


def summarize_pairs(ours: str, peer: str, pairs: list[dict], decoding: dict, big: str, figure: str | None = None) -> dict:
    """`pairs`: [{"first": name, ours: figure, peer: figure}, ...] -> each pair's ratio (ours / peer),
    the median ratio, and in how many pairs ours was ahead. `figure`: which one the pairs hold
    (default: the search's primary one, see `paired_key`)."""
    figure = figure or _primary_figure(decoding, big)
    higher_is_better = figure != LATENCY_FIGURE
    ratios = [p[ours] / p[peer] for p in pairs]
    ahead = sum(r >= 1.0 if higher_is_better else r <= 1.0 for r in ratios)
    return {
        "ours": ours, "peer": peer,
        "figure": figure,
        "pairs": [{**p, "ratio": r} for p, r in zip(pairs, ratios)],
        "median_ratio": float(np.median(ratios)),
        "ours_ahead": ahead,
        "n": len(ratios),
    }


# A setting probe times batch-1 latency over this many of the run's latency sentences and one
# batch of the largest size: both figures a target can rest on, in a few seconds of work.
PROBE_LATENCY_SENTENCES = 5


def probe_spec(spec: Spec) -> Spec:
    """The work of one probe run: PROBE_LATENCY_SENTENCES batch-1 calls and one batch of the largest
    size, from the run's own sentences, lengths and threads."""
    big = spec.batch_sizes[-1:]
    return _part_of(spec, spec.latency_idx[:PROBE_LATENCY_SENTENCES], big, spec.throughput_idx[: big[0]] if big else [])


def choose_setting(trials: list[dict]) -> dict:
    """`trials`: [{"setting": {...}, "latency_p50_ms": x, "sentences_per_s": y}, ...], a setting
    possibly several times -> each setting's best latency and best throughput over its trials, its
    score (latency / throughput: both figures count alike, whatever their scale), and the setting
    with the lowest score. Best-of, not median: noise only ever slows a run down."""
    by_key: dict[tuple, dict] = {}
    for t in trials:
        row = by_key.setdefault(tuple(sorted(t["setting"].items())), {"setting": t["setting"], "latency_p50_ms": np.inf, "sentences_per_s": 0.0, "runs": 0})
        row["latency_p50_ms"] = min(row["latency_p50_ms"], t["latency_p50_ms"])
        row["sentences_per_s"] = max(row["sentences_per_s"], t["sentences_per_s"])
        row["runs"] += 1
    rows = list(by_key.values())
    if not rows:
        raise ValueError("no probe trial to choose from")
    for row in rows:
        row["score"] = row["latency_p50_ms"] / row["sentences_per_s"]
    best = min(rows, key=lambda r: r["score"])
    return {"chosen": best["setting"], "settings": rows,
            "fastest_latency": min(rows, key=lambda r: r["latency_p50_ms"])["setting"],
            "fastest_throughput": max(rows, key=lambda r: r["sentences_per_s"])["setting"]}
