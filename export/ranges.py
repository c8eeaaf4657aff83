"""Every value an exported graph computes, on real text: how large it gets, and whether it stays finite.

A graph's intermediate values are made graph outputs (untyped: ONNX Runtime types them itself), the
encoder runs on batches of calibration sentences and the decoder decodes them greedily with its
cache, finished rows dropped as the backends drop them, so each value is seen as decoding meets it.
numpy and onnxruntime only: the fp16 guard reads the fp32 graphs' ranges, verification reads the
low-precision graphs' first non-finite value.
"""

from __future__ import annotations

import ast
import gc
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
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    probe = path.with_name(f".ranges-{path.name}")
    try:
        onnx.save(model, str(probe))
        session = ort.InferenceSession(str(probe), options, providers=["CPUExecutionProvider"])
    finally:
        probe.unlink(missing_ok=True)
    return session, producer


class _Tracker:
    def __init__(self, graph: str, producer: dict):
        self.ranges = Ranges(graph, producer=producer)

    def see(self, names: Iterable[str], arrays: Iterable[np.ndarray], where: dict) -> None:
        seen = self.ranges.max_abs
        for name, array in zip(names, arrays):
            if not isinstance(array, np.ndarray) or array.dtype.kind != "f" or array.size == 0:
                continue
            finite = np.isfinite(array)
            if finite.all():
                top = float(np.abs(array).max())
            else:
                top = float("nan") if np.isnan(array).any() else float("inf")
                if self.ranges.first_nonfinite is None:
                    self.ranges.first_nonfinite = {**self.ranges.node_of(name), "what": "NaN" if top != top else "Inf",
                                                   **where}
            old = seen.get(name, 0.0)
            seen[name] = top if (top != top or top > old) else old


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
    enc_session, enc_producer = _instrumented_session(Path(encoder), threads)
    enc = _Tracker("encoder", enc_producer)
    enc_names = [o.name for o in enc_session.get_outputs()]
    crosses = []
    for b, (input_ids, mask) in enumerate(calibration.batches):
        enc_out = enc_session.run(None, {"input_ids": input_ids, "attention_mask": mask})
        enc.see(enc_names, enc_out, {"batch": b, "step": None})
        crosses.append({n: v for n, v in zip(enc_names, enc_out) if n.startswith("cross.")})
        del enc_out
    del enc_session
    gc.collect()
    dec_session, dec_producer = _instrumented_session(Path(decoder), threads)
    dec = _Tracker("decoder", dec_producer)
    dec_names = [o.name for o in dec_session.get_outputs()]
    past_names = [i.name for i in dec_session.get_inputs() if i.name.startswith("past.")]
    for b, (input_ids, mask) in enumerate(calibration.batches):
        cross = crosses[b]
        crosses[b] = None  # each batch's keys and values go once it is decoded
        rows = input_ids.shape[0]
        any_cross = next(iter(cross.values()))
        heads, head_dim = any_cross.shape[1], any_cross.shape[3]
        active = np.arange(rows)
        past = {n: np.zeros((rows, heads, 0, head_dim), dtype=np.float32) for n in past_names}
        tokens = np.full((rows, 1), calibration.decoder_start, dtype=np.int64)
        for step in range(calibration.max_new_tokens):
            feeds = {"input_ids": tokens, "encoder_attention_mask": mask[active],
                     **{n: v[active] for n, v in cross.items()}, **past}
            dec.see(feeds.keys(), feeds.values(), {"batch": b, "step": step})
            out = dict(zip(dec_names, dec_session.run(None, feeds)))
            dec.see(out.keys(), out.values(), {"batch": b, "step": step})
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
