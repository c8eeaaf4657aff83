"""Which int8 weights cost agreement: each quantized node's sensitivity, measured on calibration text.

The question an int8 user asks is "which layers should stay in float?"; the answer here is measured
on the model itself. Method (leave one out): the fp32 KV-cache pair decodes the calibration
sentences greedily (raw argmax, the decoder start and any forced language token first); that output
is then teacher-forced through the all-int8 pair and through one variant per candidate node, int8
everywhere except that node. Per variant, at every position of the fp32 output:

- flips: positions where the variant's argmax is not fp32's (what greedy agreement loses), and
- margin error: |(v[a] - v[b]) - (f[a] - f[b])|, with a and b fp32's two best ids and v, f the
  variant's and fp32's logits: how far int8 moved the decision that picks the next token.

A node's sensitivity is what keeping it in fp32 removes from the all-int8 figures. Nodes are ranked
by margin error removed, then flips removed: flips on a few dozen sentences are small counts that
tie and jump, while the margin error is continuous and moves with the flips it precedes, so it
orders the nodes with the fewest sentences.

Why this method and not a cheaper one: a per-node output error (ORT's qdq_loss_debug, or locate's
per-module Δ) costs one run but measures a node in a graph where every other node is exact, and
nodes early in the graph look harmless there while their error grows downstream; quantizing one node
at a time has the same blind spot. Leaving one out measures what keeping that node would buy in the
graph that ships. Its cost is one re-quantization of one graph plus one teacher-forced pass per node
(a few dozen batched decoder steps).

numpy and onnxruntime only (the KV-cache engine the backends run); the graphs are written by
`export.quantize`.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from . import quantize


@dataclass(frozen=True)
class Calibration:
    input_ids: np.ndarray  # (b, s) int64, padded
    attention_mask: np.ndarray  # (b, s) int64
    prefix: tuple[int, ...]  # decoder start, then a forced first token where the model has one
    eos: int
    pad: int
    max_new_tokens: int = 64


def calibration(input_ids, attention_mask, special: dict, generation: dict, max_new_tokens: int = 64) -> Calibration:
    """Calibration from a tokenized batch, the sidecar's special tokens and generation section."""
    forced = generation.get("forced_bos_token_id")
    prefix = (special["decoder_start"], *(() if forced is None else (forced,)))
    return Calibration(np.asarray(input_ids, dtype=np.int64), np.asarray(attention_mask, dtype=np.int64), prefix,
                       special["eos"], special["pad"], max_new_tokens)


class _Pair:
    """The two graph files and the model facts `KVCacheStepModel` reads from a sidecar."""

    def __init__(self, encoder: Path, decoder: Path, shape: dict):
        self.files = {"encoder": Path(encoder), "decoder": Path(decoder)}
        self.data = {"model": {k: shape[k] for k in ("decoder_layers", "decoder_attention_heads", "d_model")}}

    def verify_graph(self, name: str) -> Path:
        return self.files[name]

    def graph(self, name: str) -> dict:
        return {"precision": "int8" if "int8" in self.files[name].name else "fp32"}

    def kept_in_float(self, precision: str) -> None:
        return None  # a candidate pair has no sidecar yet


def _engine(encoder: Path, decoder: Path, shape: dict, threads: int | None):
    from backends.ort_kv_cache import KVCacheStepModel
    from backends.ort_session import SessionConfig

    return KVCacheStepModel(_Pair(encoder, decoder, shape), SessionConfig(threads=threads, provider="cpu"))


@dataclass
class Reference:
    """fp32's greedy output and, at each of its positions, its two best ids and their logits."""

    ids: np.ndarray  # (b, t) the decoder input fed at each step (prefix first)
    valid: np.ndarray  # (b, t) bool: positions scored (up to and including eos)
    top: np.ndarray  # (b, t, 2) fp32's best and second-best ids
    margin: np.ndarray  # (b, t) fp32's logit[best] - logit[second]


def _reference(engine, calib: Calibration) -> Reference:
    b = calib.input_ids.shape[0]
    state = engine.encode(calib.input_ids, calib.attention_mask)
    ids = np.tile(np.array(calib.prefix[:1], dtype=np.int64), (b, 1))
    done = np.zeros(b, dtype=bool)
    valid, tops, margins = [], [], []
    for step in range(len(calib.prefix) - 1 + calib.max_new_tokens):
        logits = engine.step(state, ids)  # (b, V)
        top = np.argsort(-logits, axis=1)[:, :2]
        valid.append(~done)
        tops.append(top)
        margins.append(np.take_along_axis(logits, top, 1) @ np.array([1.0, -1.0], dtype=np.float32))
        nxt = top[:, 0].copy() if step + 1 >= len(calib.prefix) else np.full(b, calib.prefix[step + 1])
        done |= nxt == calib.eos
        nxt[done & ~valid[-1]] = calib.pad  # rows already finished feed pad (their positions are not scored)
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
        if done.all():
            break
    return Reference(ids[:, :-1], np.stack(valid, 1), np.stack(tops, 1), np.stack(margins, 1))


def _score(engine, calib: Calibration, ref: Reference) -> dict:
    """Teacher-force fp32's output through `engine`: flips and mean margin error on the valid positions."""
    state = engine.encode(calib.input_ids, calib.attention_mask)
    flips, error = 0, 0.0
    flipped = np.zeros(ref.ids.shape[0], dtype=bool)
    for t in range(ref.ids.shape[1]):
        logits = engine.step(state, ref.ids[:, : t + 1])  # (b, V)
        ok = ref.valid[:, t]
        pair = np.take_along_axis(logits, ref.top[:, t], 1)  # (b, 2)
        best = np.take_along_axis(logits, logits.argmax(1)[:, None], 1)[:, 0]
        flip = (best > pair[:, 0]) & ok  # a strictly larger logit elsewhere: another argmax
        flips += int(flip.sum())
        flipped |= flip
        error += float(np.abs((pair[:, 0] - pair[:, 1]) - ref.margin[:, t])[ok].sum())
    # A sentence without a flip is one whose raw greedy output is fp32's, token for token.
    return {"flips": flips, "margin_error": error / max(1, int(ref.valid.sum())),
            "identical_sentences": int((~flipped).sum())}


@dataclass(frozen=True)
class Sensitivity:
    item: quantize.Item
    flips_removed: int  # all-int8 flips minus flips with this node in fp32
    margin_error_removed: float

    def record(self) -> dict:
        return {**asdict(self.item), "flips_removed": self.flips_removed,
                "margin_error_removed": round(self.margin_error_removed, 5)}


def measure(folder: Path, shape: dict, calib: Calibration, threads: int | None = 1, log=print) -> dict:
    """Rank every quantizable node of `folder`'s encoder.onnx / decoder.onnx (fp32) by sensitivity.

    Returns {"baseline": all-int8 figures, "positions", "ranking": [Sensitivity, most sensitive
    first], "seconds"}. Variants are written to a temporary folder and removed."""
    start = time.perf_counter()
    folder = Path(folder)
    src = {g: folder / f"{g}.onnx" for g in ("encoder", "decoder")}
    items = [i for g in ("encoder", "decoder")
             for i in quantize.quantizable(g, onnx.load(str(src[g]), load_external_data=False))]
    ref = _reference(_engine(src["encoder"], src["decoder"], shape, threads), calib)
    with tempfile.TemporaryDirectory(prefix="int8-sensitivity-") as tmp:
        tmp = Path(tmp)
        base = {g: tmp / f"{g}_int8.onnx" for g in src}
        for g in src:
            quantize.quantize_int8(src[g], base[g])
        engine = _engine(base["encoder"], base["decoder"], shape, threads)
        baseline = _score(engine, calib, ref)
        results = []
        for n, item in enumerate(items):
            variant = tmp / f"{item.graph}_int8.variant.onnx"
            quantize.quantize_int8(src[item.graph], variant, keep={item.node})
            pair = {**base, item.graph: variant}
            score = _score(_engine(pair["encoder"], pair["decoder"], shape, threads), calib, ref)
            results.append(Sensitivity(item, baseline["flips"] - score["flips"],
                                       baseline["margin_error"] - score["margin_error"]))
            log(f"  int8 sensitivity {n + 1}/{len(items)} {item.graph} {item.module}: flips "
                f"{score['flips']} (all int8 {baseline['flips']}), margin error {score['margin_error']:.4f} "
                f"({baseline['margin_error']:.4f})", flush=True)
    ranking = sorted(results, key=lambda s: (-s.margin_error_removed, -s.flips_removed, s.item.key))
    return {"baseline": baseline, "positions": int(ref.valid.sum()), "sentences": int(calib.input_ids.shape[0]),
            "ranking": ranking, "seconds": round(time.perf_counter() - start, 1)}


def score_kept(folder: Path, scratch: Path, shape: dict, calib: Calibration, kept: list[Sensitivity],
               threads: int | None = 1, rescore: int = 0) -> dict:
    """The calibration figures of the int8 pair with `kept` in fp32 and, with `rescore` K > 0, the
    output layer's K best logits re-scored (graphs written to `scratch`)."""
    folder = Path(folder)
    ref = _reference(_engine(folder / "encoder.onnx", folder / "decoder.onnx", shape, threads), calib)
    pair = {}
    for g in ("encoder", "decoder"):
        pair[g] = Path(scratch) / f"{g}_int8.kept.onnx"
        quantize.quantize_int8(folder / f"{g}.onnx", pair[g], keep={s.item.node for s in kept if s.item.graph == g},
                               rescore=rescore if g == "decoder" else 0)
    return _score(_engine(pair["encoder"], pair["decoder"], shape, threads), calib, ref)
