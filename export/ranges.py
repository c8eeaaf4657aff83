"""Every value an exported graph computes, on real text: how large it gets, and whether it stays finite.

The encoder runs on batches of calibration sentences and the decoder decodes them greedily with its
cache, finished rows dropped as the backends drop them, so each value is seen as decoding meets it.
Each float value's largest |value| and whether it holds a NaN are computed inside the graph, by
reduction nodes placed right after the node that makes it, so ONNX Runtime frees every value as it
would in a plain run: exposing the values themselves as outputs would keep all of them alive until
the run ends (NLLB-600M's encoder on an 800-token source: 2 GB of values beside its weights).
Which values hold floats is learnt from ONNX Runtime on one short run with every value exposed.
numpy and onnxruntime only: the fp16 guard reads the fp32 graphs' ranges, verification reads the
low-precision graphs' first non-finite value.
"""

from __future__ import annotations

import ast
import gc
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Calibration:
    """The text and the decoding a measurement runs: batches of (input_ids, attention_mask) and the
    ids the decoder starts from, forces first and stops at."""

    batches: list[tuple[np.ndarray, np.ndarray]]
    decoder_start: int
    eos: int
    forced_bos: int | None = None
    max_new_tokens: int = 64
    sentences: int = 0


@dataclass
class Ranges:
    """Per value name: its largest |value| (inf or nan where it was not finite), the node that
    computes it, and the first non-finite value met (graph order, so the node where it starts)."""

    graph: str
    max_abs: dict[str, float] = field(default_factory=dict)
    producer: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)  # value -> (node, op, module)
    first_nonfinite: dict | None = None

    def node_of(self, value: str) -> dict:
        node, op, module = self.producer.get(value, ("", "graph input", None))
        return {"node": node, "op": op, "module": module, "value": value}


def module_of(node) -> str | None:
    """The PyTorch module a node came from, as torch.onnx's dynamo exporter records it."""
    meta = {p.key: p.value for p in node.metadata_props}
    try:
        scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
    except (ValueError, SyntaxError):
        return None
    modules = [s for s in scopes[:-1] if s] if isinstance(scopes, list) else []
    return modules[-1] if modules else None


def _instrumented_session(path: Path, threads: int | None):
    """A session on `path` whose outputs are every node's output in graph order (its own among them);
    unoptimized, so each value is the one its node computes. Weights in external data stay where they
    are: the instrumented graph is written next to the original and removed once loaded."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(path), load_external_data=False)
    own = {o.name: o for o in model.graph.output}
    producer, ordered = {}, []
    for node in model.graph.node:
        for name in node.output:
            if name and name not in producer:
                producer[name] = (node.name, node.op_type, module_of(node))
                ordered.append(own.get(name) or onnx.ValueInfoProto(name=name))
    ordered += [o for name, o in own.items() if name not in producer]
    del model.graph.output[:]
    model.graph.output.extend(ordered)
    return _session(model, path, threads), producer


def _session(model, path: Path, threads: int | None):
    """An unoptimized session on `model`, a rewritten `path` whose external weights stay where they
    are (the graph is written next to the original and removed once loaded). Weights are not
    pre-packed: the kernels then read them from the mapped data file instead of from a second copy.
    Nodes run in the graph's order, so each value's reduction runs right after it and the value is
    freed then; ONNX Runtime's default order puts those side branches late and keeps every value."""
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    # ONNX Runtime's CPU kernels compute most fp16 ops in fp32, widening each fp16 weight with a Cast
    # of its own. Unfolded, those Casts depend on nothing, run first, and every widened weight lives
    # through the whole run (twice the fp32 weights at NLLB-600M's shape). Only the full optimization
    # level folds them, once at load, as in an fp16 engine of the app; its fusions cannot merge away
    # a value that a reduction also reads.
    widened = any(init.data_type == onnx.TensorProto.FLOAT16 for init in model.graph.initializer)
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if widened
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    options.add_session_config_entry("session.disable_prepacking", "1")
    if threads:
        options.intra_op_num_threads = threads
    probe = path.with_name(f".ranges-{path.name}")
    try:
        onnx.save(model, str(probe))
        return ort.InferenceSession(str(probe), options, providers=["CPUExecutionProvider"])
    finally:
        probe.unlink(missing_ok=True)


def _float_values(path: Path, threads: int | None, feeds: dict[str, np.ndarray]) -> dict[str, np.dtype]:
    """The values of `path` that hold floats, and their types, as ONNX Runtime computes them on
    `feeds` (one short row: every value is exposed, so the run must be small)."""
    session, _ = _instrumented_session(path, threads)
    names = [o.name for o in session.get_outputs()]
    arrays = session.run(None, feeds)
    return {n: a.dtype for n, a in zip(names, arrays) if isinstance(a, np.ndarray) and a.dtype.kind == "f"}


def _reducing_session(path: Path, threads: int | None, floats: dict[str, np.dtype]):
    """A session on `path` that also outputs, for every value in `floats`, its largest |value| and
    1.0 if it holds a NaN (scalars), from nodes placed right after the value's producer.
    Returns (session, producer, [(value, max output, nan output)] in graph order)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    flat, zero = "ranges.flat_shape", "ranges.zero"
    model.graph.initializer.extend([numpy_helper.from_array(np.array([-1], np.int64), flat),
                                    numpy_helper.from_array(np.zeros(1, np.float32), zero)])
    producer, reduced, nodes = {}, [], []
    for node in model.graph.node:
        nodes.append(node)
        for name in node.output:
            if not name or name in producer:
                continue
            producer[name] = (node.name, node.op_type, module_of(node))
            if name not in floats:
                continue
            p = f"ranges.{len(reduced)}"
            # Reshape first, in the value's own type: a low-precision value is then made in that type, as
            # the graph says, even where ONNX Runtime's CPU kernels compute its producer in fp32 (a Cast
            # reading it directly would be merged with the one ORT adds, and the overflow never seen).
            nodes.append(helper.make_node("Reshape", [name, flat], [f"{p}.flat"], name=f"{p}.flat"))
            value = f"{p}.flat"
            if floats[name] != np.float32:
                nodes.append(helper.make_node("Cast", [value], [f"{p}.f32"], name=f"{p}.f32", to=onnx.TensorProto.FLOAT))
                value = f"{p}.f32"
            nodes += [  # the 0 appended keeps an empty value reducible
                helper.make_node("Concat", [value, zero], [f"{p}.padded"], name=f"{p}.padded", axis=0),
                helper.make_node("Abs", [f"{p}.padded"], [f"{p}.abs"], name=f"{p}.abs"),
                helper.make_node("ReduceMax", [f"{p}.abs"], [f"{p}.max"], name=f"{p}.max", keepdims=0),
                helper.make_node("IsNaN", [f"{p}.padded"], [f"{p}.isnan"], name=f"{p}.isnan"),
                helper.make_node("Cast", [f"{p}.isnan"], [f"{p}.nanf"], name=f"{p}.nanf", to=onnx.TensorProto.FLOAT),
                helper.make_node("ReduceMax", [f"{p}.nanf"], [f"{p}.nan"], name=f"{p}.nan", keepdims=0),
            ]
            reduced.append((name, f"{p}.max", f"{p}.nan"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.output.extend(helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, [])
                              for _, m, n in reduced for o in (m, n))
    return _session(model, Path(path), threads), producer, reduced


class _Tracker:
    def __init__(self, graph: str, producer: dict):
        self.ranges = Ranges(graph, producer=producer)

    def _record(self, name: str, top: float, where: dict) -> None:
        """`top`: the value's largest |value| in this run, nan if it held a NaN."""
        if not math.isfinite(top) and self.ranges.first_nonfinite is None:
            self.ranges.first_nonfinite = {**self.ranges.node_of(name), "what": "NaN" if top != top else "Inf", **where}
        old = self.ranges.max_abs.get(name, 0.0)
        self.ranges.max_abs[name] = top if (top != top or top > old) else old

    def see(self, names: Iterable[str], arrays: Iterable[np.ndarray], where: dict) -> None:
        for name, array in zip(names, arrays):
            if not isinstance(array, np.ndarray) or array.dtype.kind != "f" or array.size == 0:
                continue
            if np.isfinite(array).all():
                self._record(name, float(np.abs(array).max()), where)
            else:
                self._record(name, float("nan") if np.isnan(array).any() else float("inf"), where)

    def see_reduced(self, reduced: list[tuple[str, str, str]], out: dict[str, np.ndarray], where: dict) -> None:
        for name, top, nan in reduced:
            self._record(name, float("nan") if out[nan] > 0 else float(out[top]), where)


def graph_ranges(path: Path, feeds: dict[str, np.ndarray], threads: int | None = None) -> Ranges:
    """One run of one graph with every value exposed: its ranges and its first non-finite value."""
    session, producer = _instrumented_session(Path(path), threads)
    tracker = _Tracker(Path(path).name, producer)
    tracker.see(feeds.keys(), feeds.values(), {"batch": 0, "step": None})
    tracker.see([o.name for o in session.get_outputs()], session.run(None, feeds), {"batch": 0, "step": None})
    return tracker.ranges


def measure(encoder: Path, decoder: Path, calibration: Calibration, threads: int | None = None) -> dict[str, Ranges]:
    """Ranges of every value of the encoder and the decoder (graph inputs included) over the
    calibration text, decoded greedily up to `max_new_tokens`.

    One session at a time: the encoder runs over every batch first and only its cross-attention
    keys and values are kept for the decoder, so the two graphs' weights are never loaded together."""
    first_ids, first_mask = calibration.batches[0]
    floats = _float_values(Path(encoder), threads, {"input_ids": first_ids[:1], "attention_mask": first_mask[:1]})
    gc.collect()
    enc_session, enc_producer, enc_reduced = _reducing_session(Path(encoder), threads, floats)
    enc = _Tracker("encoder", enc_producer)
    enc_names = [o.name for o in enc_session.get_outputs()]
    crosses = []
    for b, (input_ids, mask) in enumerate(calibration.batches):
        enc_out = dict(zip(enc_names, enc_session.run(None, {"input_ids": input_ids, "attention_mask": mask})))
        enc.see_reduced(enc_reduced, enc_out, {"batch": b, "step": None})
        crosses.append({n: v for n, v in enc_out.items() if n.startswith("cross.")})
        del enc_out
    del enc_session
    gc.collect()

    def first_feeds(b: int, rows, past_names) -> dict[str, np.ndarray]:
        cross = crosses[b]
        any_cross = next(iter(cross.values()))
        heads, head_dim = any_cross.shape[1], any_cross.shape[3]
        return {"input_ids": np.full((len(rows), 1), calibration.decoder_start, dtype=np.int64),
                "encoder_attention_mask": calibration.batches[b][1][rows],
                **{n: v[rows] for n, v in cross.items()},
                **{n: np.zeros((len(rows), heads, 0, head_dim), dtype=np.float32) for n in past_names}}

    import onnx

    past_names = [i.name for i in onnx.load(str(decoder), load_external_data=False).graph.input
                  if i.name.startswith("past.")]
    floats = _float_values(Path(decoder), threads, first_feeds(0, np.arange(1), past_names))
    gc.collect()
    dec_session, dec_producer, dec_reduced = _reducing_session(Path(decoder), threads, floats)
    dec = _Tracker("decoder", dec_producer)
    dec_names = [o.name for o in dec_session.get_outputs()]
    for b, (input_ids, mask) in enumerate(calibration.batches):
        rows = input_ids.shape[0]
        active = np.arange(rows)
        feeds = first_feeds(b, active, past_names)
        cross = {n: v for n, v in feeds.items() if n.startswith("cross.")}
        crosses[b] = None  # each batch's keys and values go once it is decoded
        past = {n: feeds[n] for n in past_names}
        tokens = feeds["input_ids"]
        for step in range(calibration.max_new_tokens):
            feeds = {"input_ids": tokens, "encoder_attention_mask": mask[active],
                     **{n: v[active] for n, v in cross.items()}, **past}
            dec.see(feeds.keys(), feeds.values(), {"batch": b, "step": step})
            out = dict(zip(dec_names, dec_session.run(None, feeds)))
            dec.see_reduced(dec_reduced, out, {"batch": b, "step": step})
            logits = out["logits"][:, -1]
            chosen = np.nan_to_num(logits, nan=-np.inf).argmax(-1)
            if step == 0 and calibration.forced_bos is not None:
                chosen[:] = calibration.forced_bos
            going = chosen != calibration.eos
            active = active[going]
            if not len(active):
                break
            past = {p: out["present." + p[len("past."):]][going] for p in past_names}
            tokens = chosen[going][:, None].astype(np.int64)
    return {"encoder": enc.ranges, "decoder": dec.ranges}


def calibration(tokenizer, sentences: list[str], *, decoder_start: int, eos: int, forced_bos: int | None,
                max_source_tokens: int, max_new_tokens: int = 64, batch_size: int = 8) -> Calibration:
    """`sentences` tokenized (cut at `max_source_tokens`) into batches of sources of one length: no
    padding, so the attention masks add nothing and every value seen is one a real position computes
    (a padded position's additive mask bias is large by design, not an overflow)."""
    encoded = [tokenizer(s, truncation=True, max_length=max_source_tokens).input_ids for s in sentences]
    by_length: dict[int, list[list[int]]] = {}
    for ids in encoded:
        by_length.setdefault(len(ids), []).append(ids)
    batches = []
    for length in sorted(by_length):
        rows = by_length[length]
        for start in range(0, len(rows), batch_size):
            ids = np.array(rows[start:start + batch_size], dtype=np.int64)
            batches.append((ids, np.ones_like(ids)))
    return Calibration(batches, decoder_start, eos, forced_bos, max_new_tokens, len(sentences))
