"""What a speed run's numbers conclude: agreement and ratios to the reference, the migration
article's claims and the speed targets, each with its verdict (`add_comparisons`)."""

from __future__ import annotations

import numpy as np

from backends.registry import BACKEND_NAMES, REFERENCE
from runtime.peers import PEERS

from . import metrics

# Our runtimes the speed targets name: the fp32 KV-cache backend, and int8 for the quantized pairs.
KV, I8 = "ort_fp32_kv_cache", "ort_int8"
# The KV cache's gain (cached, single-step) grows with the output length: the length sweep shows it.
CACHE_PAIR = (KV, "ort_fp32_single_step")
# Each of our KV-cache backends against the CTranslate2 peer of the same precision.
CT2_PAIRS = ((KV, "ct2_float32"), (I8, "ct2_int8"))


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


# The migration article's claims, checked on every run: (claim, faster runtime, slower runtime,
# claimed speedup, also by forced output length). A speed claim holds when the measured speedup
# reaches at least TOLERANCE of the claimed one; "identical" holds only at 100% identical tokens.
CLAIMS = (
    ("ONNX Runtime fp32 about 40% faster than PyTorch", "ort_fp32_kv_cache", "pytorch", 1.4, False),
    ("fp16 another 30% faster than ONNX fp32", "ort_fp16", "ort_fp32_kv_cache", 1.3, False),
    ("KV cache about 2x faster than single-step", "ort_fp32_kv_cache", "ort_fp32_single_step", 2.0, True),
)
TOLERANCE = 0.9


def claims(results: dict) -> list[dict]:
    """Each claim with the measured ratio at batch 1 (p50), at the largest batch, and a verdict."""
    rt = results["runtimes"]
    big = str(results["options"]["batch_sizes"][-1])
    out = []
    for text, fast, slow, claimed, by_length in CLAIMS:
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
        if by_length:  # the cache's gain grows with the output: shown per forced length
            sweep = {n: rt[slow]["sweep"][n]["ms_per_sentence"] / rt[fast]["sweep"][n]["ms_per_sentence"]
                     for n in rt[fast].get("sweep", {}) if n in rt[slow].get("sweep", {})}
            if sweep:
                entry["speedup_by_forced_length"] = sweep
                entry["measured"] += "; by forced length: " + ", ".join(f"{n}: {v:.2f}x" for n, v in sweep.items())
        out.append(entry)
    ref = results.get("reference")
    for name in BACKEND_NAMES:
        if name != REFERENCE and name in rt and ref in rt and name != ref:
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


# The figures a paired check times (see speedrun.paired_spec).
LATENCY_FIGURE = "batch-1 p50 ms"


def throughput_figure(big: str) -> str:
    return f"batch-{big} sentences/s"


# The speed targets, checked on every run where the runtimes they name took part: greedy runs
# check batch-`big` throughput against CTranslate2 and, with forced output lengths, batch-1 ms per
# token against the memory-bandwidth floor; beam runs check batch-1 latency against
# generate(num_beams=N) and CTranslate2's beam_size=N, and batch-`big` throughput against
# CTranslate2's. Each of our figures comes with the engine's
# alone (the graphs, the decoding loop's own work excluded), so a target that does not hold says
# whether a faster loop could reach it. A target between two runtimes is decided by the run's
# paired check when it has one (`results["paired"]`, SpeedOptions.paired_rounds).
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

    def check(text, value, limit, higher_is_better, fmt, pair=None, suffix=""):
        """pair: (ours, peer) when the target compares two runtimes: with a paired check in this run
        its median pair decides, and the round-robin ratio is shown beside it. `suffix`: the pair's
        key beyond "ours/peer" for a figure other than the search's usual one (`paired_key`)."""
        p = paired.get("/".join(pair) + suffix) if pair else None
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

    def throughput_vs_ct2(search: str, suffix: str = ""):
        for ours, peer, label in ((o, p, PEERS[p].label) for o, p in CT2_PAIRS):
            def fmt(v, _, ours=ours, peer=peer, label=label):
                text = f"{v:.2f}x {label}'s sentences/s ({thr(ours):.1f} vs {thr(peer):.1f})"
                g = engine_thr(ours)
                return text + (f"; the ORT graphs alone: {g:.1f} sentences/s = {g / thr(peer):.2f}x" if g else "")
            check(f"{ours}, batch {big}{search}: at least {label}'s throughput", ratio(thr(ours), thr(peer)), 1.0, True,
                  fmt, (ours, peer), suffix)

    if beams == 1:
        throughput_vs_ct2("")
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
        for ours, peer, label in ((o, p, PEERS[p].label) for o, p in CT2_PAIRS):
            check(f"{ours}, batch 1, beam {beams}: no slower than {label} beam_size={beams}",
                  ratio(p50(ours), p50(peer)), 1.0, False, lambda v, _, label=label: f"{v:.2f}x {label}'s p50",
                  (ours, peer))
        if big != "1":
            throughput_vs_ct2(f", beam {beams}", "@" + throughput_figure(big))
    return out

