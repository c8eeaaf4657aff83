"""A speed run's options, its work, and what its numbers conclude: shared by both speed runs.

`python -m bench speed` (every runtime alone in its own process) and the app's quick run
(`quickbench.py`, every loaded backend in the app's process) ask for their work with the same
`SpeedOptions` and `make_spec`, and write the same results.json layout: `model_info`,
`sentence_info`, and `add_comparisons`, which adds each runtime's agreement with the reference,
its ratios to it, BLEU/chrF when meaningful, the migration article's `claims` and the speed
issue's `targets`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from corpus import Pair
from runtime.protocol import Spec

from . import metrics

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
    # Then each target that sets one of our runtimes against a peer is measured again as this many
    # pairs: the two runtimes' processes back to back over the same work, which one goes first
    # alternating, the ratio taken within each pair; the target's verdict is the median pair's.
    # Round-robin slots put minutes (the other runtimes) between the two sides of a ratio, and on
    # this host that drift decided batch-32 verdicts both ways (bench/README.md).
    paired_rounds: int = 0
    # Before the rounds, each CTranslate2 peer's settings (bench.peers.ct2_settings: MKL or oneDNN,
    # one thread or all) are each timed this many times over a short sample (`probe_spec`), and the
    # fastest is the one every round uses; 0: CTranslate2's own choice with all the threads. The
    # same thread count for every runtime left it 3-5x below its best on one machine.
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


KV, I8 = "ort_fp32_kv_cache", "ort_int8"
# The batch-1 latency of a beam-search pair is timed over this many sentences (the round-robin
# uses all of the run's): at opus-mt size a generate(num_beams=4) call takes about a second.
PAIRED_LATENCY_SENTENCES = 10


def _greedy(decoding: dict) -> bool:
    return int(decoding.get("num_beams", 1)) == 1


def target_pairs(decoding: dict) -> list[tuple[str, str]]:
    """(ours, peer) of each target that compares two runtimes (see `targets`), for the paired check."""
    if _greedy(decoding):
        return [(KV, "ct2_float32"), (I8, "ct2_int8")]  # throughput at the largest batch
    return [(KV, "transformers"), (KV, "ct2_float32"), (I8, "ct2_int8")]  # batch-1 p50


def paired_spec(spec: Spec, decoding: dict) -> Spec:
    """The work of one side of a pair: only the figure its target compares. Greedy: throughput at
    the largest batch size over the run's throughput sentences; beam: batch-1 latency over the first
    PAIRED_LATENCY_SENTENCES of the run's latency sentences. Same sentences, lengths and threads."""
    greedy = _greedy(decoding)
    return _part_of(spec, [] if greedy else spec.latency_idx[:PAIRED_LATENCY_SENTENCES],
                    spec.batch_sizes[-1:] if greedy else [], spec.throughput_idx)


def _part_of(spec: Spec, latency_idx: list[int], batch_sizes: list[int], throughput_idx: list[int]) -> Spec:
    """A part of a run's work (no sweep), warmed up on at most its own batch-1 sentences."""
    return dataclasses.replace(spec, latency_idx=latency_idx, batch_sizes=batch_sizes, throughput_idx=throughput_idx,
                               sweep_lengths=[], sweep_idx=[], warmup=min(spec.warmup, len(latency_idx)))


def paired_figure(result: dict, decoding: dict, big: str) -> float:
    """What a paired run's target compares: batch-`big` sentences/s (greedy) or batch-1 p50 ms (beam)."""
    if _greedy(decoding):
        return result["throughput"][big]["sentences_per_s"]
    return result["latency"]["p50"]


def summarize_pairs(ours: str, peer: str, pairs: list[dict], decoding: dict, big: str) -> dict:
    """`pairs`: [{"first": name, ours: figure, peer: figure}, ...] -> each pair's ratio (ours / peer),
    the median ratio, and in how many pairs ours was ahead."""
    greedy = _greedy(decoding)
    ratios = [p[ours] / p[peer] for p in pairs]
    ahead = sum(r >= 1.0 if greedy else r <= 1.0 for r in ratios)
    return {
        "ours": ours, "peer": peer,
        "figure": f"batch-{big} sentences/s" if greedy else "batch-1 p50 ms",
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


def floor_beside_rounds(runtime: dict) -> list[dict]:
    """Per round of a runtime, its batch-1 ms/token against the floor measured just before that
    round (bench/speed.py): [{ms_per_token, floor_ms, x_floor, engine_x_floor, alone_x_floor}], or
    [] when the run measured none."""
    rounds = runtime.get("rounds") or ([{"ms_per_token_p50": runtime["latency"].get("ms_per_token_p50"),
                                         "engine_ms_per_token_p50": runtime["latency"].get("engine_ms_per_token_p50"),
                                         "floor_beside": runtime["floor_beside"]}] if "floor_beside" in runtime else [])
    out = []
    for r in rounds:
        b, t = r.get("floor_beside"), r.get("ms_per_token_p50")
        if not b or not t:
            return []  # every round or none: a median over some rounds would hide the others
        f = b["floor_ms_per_token"]
        e = r.get("engine_ms_per_token_p50")
        others = b.get("others_alone")  # absent in runs made before it was measured
        out.append({"ms_per_token": t, "floor_ms": f, "x_floor": t / f, "engine_x_floor": e / f if e else None,
                    "alone_x_floor": b["matmuls_alone"]["x_floor"], "gb_per_s": b["gb_per_s"],
                    "others_x_floor": others["x_floor"] if others else None,
                    "kernels_x_floor": b.get("kernels_x_floor")})
    return out


def _kernels_text(products: float, others: float | None, kernels: float | None, limit: float,
                  spans: tuple[str, str] = ("", "")) -> str:
    """ORT's weight products alone, and with the rest of the step's kernels, against a floor target;
    `spans`: the rounds' ranges shown after the products' and the sum's medians."""
    text = f"ORT's weight products alone {products:.2f}x{spans[0]}"
    if others is None or kernels is None:
        return text
    text += f", the rest of the step's kernels alone {others:.2f}x: together {kernels:.2f}x{spans[1]}"
    if kernels > limit:
        text += f", above the {limit}x target: out of its reach with ORT's kernels for this graph, whatever the loop does"
    return text


def _beside_text(value: float, rounds: list[dict], limit: float) -> str:
    def span(key, fmt="{:.2f}"):
        values = [r[key] for r in rounds if r[key] is not None]
        lo, hi = min(values), max(values)
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"

    med = lambda key: float(np.median([r[key] for r in rounds]))  # noqa: E731
    text = (f"{value:.2f}x in the median of {len(rounds)} rounds, each against the floor measured just before it "
            f"(rounds {span('x_floor')}x; {span('ms_per_token')} ms/token against floors of {span('floor_ms')} ms, "
            f"{span('gb_per_s', '{:.1f}')} GB/s)")
    if all(r["engine_x_floor"] is not None for r in rounds):
        text += f"; the ORT graphs alone {med('engine_x_floor'):.2f}x"
    measured = all(r["kernels_x_floor"] is not None for r in rounds)
    return text + "; " + _kernels_text(
        med("alone_x_floor"), med("others_x_floor") if measured else None,
        med("kernels_x_floor") if measured else None, limit,
        (f" ({span('alone_x_floor')})", f" ({span('kernels_x_floor')})" if measured else ""))


# The batch-1 floor targets: runtime, the decoder graph whose weights set its floor, the limit.
FLOOR_TARGETS = ((KV, "decoder", 1.15), (I8, "decoder_int8", 1.3))


# Performance round 2's targets (issue 16), checked on every run where the runtimes they name took
# part: greedy runs check batch-`big` throughput against CTranslate2 and, with forced output
# lengths, batch-1 ms per token against the memory-bandwidth floor; beam runs check batch-1
# latency against generate(num_beams=N) and CTranslate2's beam_size=N. Each of our figures comes
# with the engine's alone (the graphs, the decoding loop's own work excluded), so a target that
# does not hold says whether a faster loop could reach it. A target between two runtimes is
# decided by the run's paired check when it has one (`results["paired"]`, SpeedOptions.paired_rounds).
def targets(results: dict) -> list[dict]:
    rt, big = results["runtimes"], str(results["options"]["batch_sizes"][-1])
    floor = results["environment"].get("floor", {}).get("graphs", {})
    decoding = results.get("decoding") or {"search": "greedy", "num_beams": 1}
    beams = int(decoding.get("num_beams", 1))

    def p50(name):
        return rt[name]["latency"]["p50"] if name in rt else None

    def thr(name):
        t = rt.get(name, {}).get("throughput", {}).get(big)
        return t["sentences_per_s"] if t else None

    def engine_thr(name):
        t = rt.get(name, {}).get("throughput", {}).get(big) or {}
        return t["sentences"] / t["engine_seconds"] if t.get("engine_seconds") else None

    out = []
    paired = results.get("paired", {})

    def check(text, value, limit, higher_is_better, fmt, pair=None):
        """pair: (ours, peer) when the target compares two runtimes: with a paired check in this run
        its median pair decides, and the round-robin ratio is shown beside it."""
        p = paired.get("/".join(pair)) if pair else None
        if p and "median_ratio" in p:
            rr = fmt(value, limit) if value is not None else "not measured"
            held = p["median_ratio"] >= limit if higher_is_better else p["median_ratio"] <= limit
            out.append({"target": text, "value": p["median_ratio"], "limit": limit, "held": held,
                        "round_robin_value": value, "decided_by": "paired",
                        "measured": f"{p['median_ratio']:.2f}x in the median of {p['n']} back-to-back pairs "
                                    f"(ours ahead in {p['ours_ahead']}); round-robin medians: {rr}"})
            return
        if value is None or limit is None:
            out.append({"target": text, "held": None, "measured": "not measured (a runtime it needs did not run)"})
            return
        held = value >= limit if higher_is_better else value <= limit
        measured = fmt(value, limit) + (f"; the paired check failed: {p['error']}" if p and "error" in p else "")
        out.append({"target": text, "value": value, "limit": limit, "held": held, "measured": measured,
                    "decided_by": "round-robin"})

    kv, i8 = KV, I8
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    if beams == 1:
        for ours, peer, label in ((kv, "ct2_float32", "CTranslate2 float32"), (i8, "ct2_int8", "CTranslate2 int8")):
            def fmt(v, _, ours=ours, peer=peer, label=label):
                text = f"{v:.2f}x {label}'s sentences/s ({thr(ours):.1f} vs {thr(peer):.1f})"
                g = engine_thr(ours)
                return text + (f"; the ORT graphs alone: {g:.1f} sentences/s = {g / thr(peer):.2f}x" if g else "")
            check(f"{ours}, batch {big}: at least {label}'s throughput", ratio(thr(ours), thr(peer)), 1.0, True, fmt,
                  (ours, peer))
        if results["options"].get("forced_tokens"):
            for name, graph, limit in FLOOR_TARGETS:
                text = f"{name}, batch 1: ms per token within {limit}x of the memory-bandwidth floor"
                beside = floor_beside_rounds(rt.get(name, {}))
                if beside:
                    check(text, float(np.median([b["x_floor"] for b in beside])), limit, False,
                          lambda v, lim, b=beside: _beside_text(v, b, lim))
                    continue
                lat = rt.get(name, {}).get("latency", {})
                per_token, engine = lat.get("ms_per_token_p50"), lat.get("engine_ms_per_token_p50")
                g = floor.get(graph, {})
                f, alone = g.get("floor_ms_per_token"), g.get("matmuls_alone")

                def fmt(v, lim, f=f, t=per_token, e=engine, alone=alone, g=g):
                    text = f"{t:.2f} ms/token = {v:.2f}x the {f:.2f} ms floor measured at the end of the run"
                    text += f"; the ORT graphs alone: {e:.2f} ms/token = {e / f:.2f}x" if e else ""
                    if alone:  # the lowest any ORT backend can go: its weight products and nothing else
                        others = g.get("others_alone")
                        text += "; " + _kernels_text(alone["x_floor"], others["x_floor"] if others else None,
                                                     g.get("kernels_x_floor"), lim)
                    return text
                check(text, ratio(per_token, f), limit, False, fmt)
    else:
        check(f"{kv}, batch 1, beam {beams}: at most 0.6x generate(num_beams={beams})'s latency",
              ratio(p50(kv), p50("transformers")), 0.6, False, lambda v, _: f"{v:.2f}x generate()'s p50",
              (kv, "transformers"))
        for ours, peer, label in ((kv, "ct2_float32", "CTranslate2 float32"), (i8, "ct2_int8", "CTranslate2 int8")):
            check(f"{ours}, batch 1, beam {beams}: no slower than {label} beam_size={beams}",
                  ratio(p50(ours), p50(peer)), 1.0, False, lambda v, _, label=label: f"{v:.2f}x {label}'s p50",
                  (ours, peer))
    return out

