"""The one measurement protocol every runtime goes through, ours and the peers'.

Used by `python -m bench speed` (each runtime alone in its own process: `bench/worker.py`,
`bench/peers/worker.py`) and by the app's quick run (`service/quickbench.py`, every backend in the
app's process).

Stdlib and numpy only, in a package that imports nothing at its top: the measuring subprocesses
import it without the request layer, the backends or ONNX Runtime, so those stay out of a peer's
memory and out of our workers' timed imports. The peers run in their own environment
(`.venv-bench`, transformers 4), where `backends` is not meant to run.

A runtime is anything with `translate(texts, max_new_tokens, min_new_tokens) -> list[Output]`, one
call being one padded batch. Every timing is the wall-clock time of that call (time.perf_counter):
it includes tokenization, the encoder, every decoder step, the runtime's own search loop and
detokenization; it excludes process start, imports and model loading (timed separately), and the
warm-up calls. Generated tokens are counted per sentence, eos included when the runtime emits it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Callable, Protocol

import numpy as np

from .memory import peak_rss_mb, rss_mb

PERCENTILES = (50, 90, 99)


@dataclass
class Output:
    ids: list[int]  # generated target ids, decoder start and padding excluded, eos included if emitted
    text: str


class Runtime(Protocol):
    def translate(self, texts: list[str], max_new_tokens: int, min_new_tokens: int) -> list[Output]: ...


class BackendRuntime:
    """Adapts one of our backends (`backends.Backend`) to the protocol: token ids and text, what
    every peer returns (top_k=1, output_scores=False: no per-step log-probs, which generate() and
    CTranslate2 do not compute unless asked either). `decode`: the search options; greedy unless
    given, because a model's own generation config may ask for beams and a benchmark must know
    which search it timed."""

    def __init__(self, backend, decode: dict | None = None):
        self.backend = backend
        self.decode = {"num_return_sequences": 1, **(decode or {"num_beams": 1})}
        # ms the last call spent inside the engine (graphs or modules): what is left of a call's
        # time without the decoding loop's own work. Peers have no such figure (None).
        self.engine_ms: float | None = None

    def translate(self, texts, max_new_tokens, min_new_tokens):
        results = self.backend.translate(
            texts, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, top_k=1, output_scores=False,
            **self.decode
        )
        self.engine_ms = results[0].timings_ms.get("engine") if results else None
        return [Output(t.token_ids, t.text) for t in results]


@dataclass(frozen=True)
class Spec:
    """What to run; written once by the parent as JSON so every runtime gets the very same work."""

    sentences: list[str]
    latency_idx: list[int]  # batch-1 latency: these sentences, one call each, in this order
    throughput_idx: list[int]  # batched throughput: these sentences, sorted by source length
    batch_sizes: list[int]
    max_new_tokens: int  # cap when not forced
    forced_tokens: int | None  # min_new_tokens = max_new_tokens = this (random-weight models)
    sweep_lengths: list[int]  # forced output lengths for the length sweep (empty: no sweep)
    sweep_idx: list[int]  # sentences of the sweep, batch 1
    warmup: int  # batch-1 calls before anything is timed (plus one call per batch size)
    threads: int
    source_ids: list[list[int]] | None = None  # our tokenizer's ids per sentence: peers check theirs match

    @classmethod
    def load(cls, path) -> "Spec":
        with open(path, encoding="utf-8") as f:
            return cls(**json.load(f))

    def save(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, ensure_ascii=False, indent=1)


def percentiles(values_ms: list[float]) -> dict[str, float]:
    """n, p50/p90/p99 (numpy linear interpolation), mean, min, max of a list of milliseconds."""
    a = np.asarray(values_ms, dtype=np.float64)
    if a.size == 0:
        raise ValueError("no timings to summarise")
    out = {"n": int(a.size)}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    out.update(mean=float(a.mean()), min=float(a.min()), max=float(a.max()))
    return out


def _engine_ms(runtime: Runtime) -> float | None:
    return getattr(runtime, "engine_ms", None)


def _lengths(forced: int | None, cap: int) -> tuple[int, int]:
    return (forced, forced) if forced else (cap, 0)


def _timed(runtime: Runtime, texts: list[str], max_new: int, min_new: int) -> tuple[float, list[Output]]:
    start = time.perf_counter()
    outputs = runtime.translate(texts, max_new, min_new)
    elapsed = (time.perf_counter() - start) * 1e3
    if len(outputs) != len(texts):
        raise RuntimeError(f"runtime returned {len(outputs)} outputs for {len(texts)} inputs")
    return elapsed, outputs


def _latency(runtime: Runtime, spec: Spec, max_new: int, min_new: int, progress) -> dict:
    """Batch-1 latency: one call per sentence of `spec.latency_idx`, in order."""
    s = spec.sentences
    result: dict = {}
    progress(f"batch-1 latency over {len(spec.latency_idx)} sentences")
    times, per_token, engine_per_token, outputs = [], [], [], []
    for i in spec.latency_idx:
        ms, [out] = _timed(runtime, [s[i]], max_new, min_new)
        times.append(ms)
        per_token.append(ms / max(len(out.ids), 1))
        if (engine_ms := _engine_ms(runtime)) is not None:
            engine_per_token.append(engine_ms / max(len(out.ids), 1))
        outputs.append(asdict(out))
    lat = percentiles(times)
    lat["ms_per_token_p50"] = float(np.percentile(per_token, 50))
    if len(engine_per_token) == len(times):  # the engine alone: what a faster loop could approach
        lat["engine_ms_per_token_p50"] = float(np.percentile(engine_per_token, 50))
    lat["ms_per_token_mean"] = float(np.mean(per_token))
    lat["tokens_mean"] = float(np.mean([len(o["ids"]) for o in outputs]))
    # Not forced: sentences that ran into the cap instead of ending with eos (a degenerate model).
    lat["hit_cap"] = 0 if spec.forced_tokens else sum(len(o["ids"]) >= max_new for o in outputs)
    result["latency"] = lat
    result["outputs"] = outputs  # batch-1 outputs of latency_idx, for agreement and BLEU
    return result


def measure(runtime: Runtime, spec: Spec, progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Warm up, then batch-1 latency, batched throughput and the length sweep; returns plain data.

    A spec without latency sentences (or batch sizes) skips that part: the paired target checks
    (`speedrun.paired_spec`) time only the figure their target compares."""
    s = spec.sentences
    max_new, min_new = _lengths(spec.forced_tokens, spec.max_new_tokens)
    result: dict = {}

    progress(f"warm-up: {spec.warmup} single sentences and one batch per batch size")
    for i in spec.latency_idx[: spec.warmup]:
        _timed(runtime, [s[i]], max_new, min_new)
    for b in spec.batch_sizes:
        _timed(runtime, [s[i] for i in spec.throughput_idx[:b]], max_new, min_new)
    result["rss_after_warmup_mb"] = rss_mb()

    if spec.latency_idx:
        result.update(_latency(runtime, spec, max_new, min_new, progress))

    result["throughput"] = {}
    for b in spec.batch_sizes:
        progress(f"throughput at batch {b} over {len(spec.throughput_idx)} length-sorted sentences")
        idx = spec.throughput_idx
        total_ms, tokens, batch_ms, engine = 0.0, 0, [], []
        for k in range(0, len(idx), b):
            ms, outs = _timed(runtime, [s[i] for i in idx[k : k + b]], max_new, min_new)
            total_ms += ms
            batch_ms.append(ms)
            engine.append(_engine_ms(runtime))
            tokens += sum(len(o.ids) for o in outs)
        result["throughput"][str(b)] = {
            "sentences": len(idx),
            "batches": len(batch_ms),
            "seconds": total_ms / 1e3,
            "sentences_per_s": len(idx) / (total_ms / 1e3),
            "tokens_per_s": tokens / (total_ms / 1e3),
            "generated_tokens": tokens,
        }
        if None not in engine:  # seconds inside the engine over the same calls
            result["throughput"][str(b)]["engine_seconds"] = sum(engine) / 1e3

    result["sweep"] = {}
    for n in spec.sweep_lengths:
        progress(f"length sweep: {n} forced tokens, {len(spec.sweep_idx)} sentences at batch 1")
        ms_list = [_timed(runtime, [s[i]], n, n)[0] for i in spec.sweep_idx]
        result["sweep"][str(n)] = {
            "n": len(ms_list),
            "ms_per_sentence": float(np.median(ms_list)),
            "ms_per_token": float(np.median(ms_list)) / n,
            "ms_all": ms_list,
        }
    result["peak_rss_mb"] = peak_rss_mb()
    return result
