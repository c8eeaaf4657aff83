"""The ONNX half of `locate`: a backend's graphs mapped to modules, and their module outputs read.

Adding graph outputs to the exported graph changes what ORT does with it: an output
blocks fusions around it, and in fp16 it forces a rounding ORT's CPU kernels skip (they compute
most fp16 ops in fp32 and drop the casts between them), so such a copy's fp16 logits were off by
half the backend's own drift. So the values are read from ORT's own optimized graph (saved by a
session made as the backend's), with the outputs added and no further optimization: the
backend's very numbers (its logits match to 0). A value ORT computes in fp32 is found under its
`InsertedPrecisionFreeCast_` name. A module output ORT fused into a larger kernel (with CUDA, an
output projection's or fc2's bias with the residual into SkipLayerNormalization; our CPU sessions
leave that fusion off, backends/ort_session.py) exists only in a copy of the exported graph: read
from there, marked `"read_from": "exported"`, and that copy's logits difference is reported too
(`reading_max_abs_dlogit`). Each row lists the op types of the exported graph since the previous
module, and of ORT's graph (`ort_op_types`: FusedMatMul, QuickGelu, SkipLayerNormalization with
CUDA, the Casts it inserted) where it was read there.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backends import GRAPHS, Backend, SessionConfig

from .locate_graph import _ORT_FP32_PREFIX, GraphMap, LocateError, map_graph, op_types_since, with_outputs


@dataclass
class _Graph:
    name: str  # manifest graph name
    role: str  # full, encoder or decoder
    path: Path
    model: Any
    map: GraphMap
    ort_op_types: dict[str, list[str]] = field(default_factory=dict)  # in ORT's optimized graph


def _role(graph_name: str) -> str:
    return graph_name.split("_")[0]


def _feeds_types(session) -> dict[str, Any]:
    kinds = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
    return {i.name: kinds.get(i.type) for i in session.get_inputs()}


def _session(path: Path, config: SessionConfig, *, optimize: bool = True, save_optimized: Path | None = None):
    """A session as `backends.ort_session.create_session` makes the backends' (same optimization
    level and providers: the same numbers), optionally saving the graph ORT optimized; or, with
    `optimize=False`, one that runs a graph exactly as given (ORT's own saved graph)."""
    import onnxruntime as ort

    from backends.ort_session import open_session, session_options

    options = session_options(config, memory_arena=False)
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3  # saving an ENABLE_ALL graph warns that it is for this machine only
    if save_optimized is not None:
        options.optimized_model_filepath = str(save_optimized)
    return open_session(str(path), options, config)


@dataclass
class _Reading:
    """Where one graph's module outputs are read."""

    session: Any
    outputs: dict[str, str]  # module -> output name
    source: str  # "onnxruntime" (ORT's optimized graph) or "exported" (a copy of the exported graph)


def _readings(g: _Graph, config: SessionConfig, tmp: Path) -> tuple[Any, list[_Reading]]:
    """The production session of one graph, and where its module outputs are read.

    First ORT's own optimized graph (saved by the production session), with the outputs added
    and no further optimization: exactly the numbers the backend computes. A module output ORT
    fused into a larger kernel (with CUDA, an output projection's bias and the residual into
    SkipLayerNormalization) no longer exists there; those are read from a copy of the exported
    graph with them added as outputs, which ORT then optimizes around them."""
    import onnx

    optimized = tmp / f"{g.role}.ort.onnx"
    production = _session(g.path, config, save_optimized=optimized)
    ort_model = onnx.load(str(optimized))
    present = {o for n in ort_model.graph.node for o in n.output} | {i.name for i in ort_model.graph.input}
    found, types = {}, {}
    for module, value in g.map.values.items():
        for name, elem_type in ((_ORT_FP32_PREFIX + value, 1), (value, g.map.types[value])):
            if name in present:
                found[module], types[name] = name, elem_type
                break
    readings = []
    if found:
        path = with_outputs(ort_model, types, tmp, f"{g.role}.ort.debug.onnx")
        readings.append(_Reading(_session(path, config, optimize=False), found, "onnxruntime"))
        g.ort_op_types = op_types_since(
            list(ort_model.graph.node), found, list(g.map.values),
            {**{v: g.map.types[v] for v in g.map.types}, **types},
        )
    missing = {m: v for m, v in g.map.values.items() if m not in found}
    if missing:
        path = with_outputs(g.model, {v: g.map.types[v] for v in missing.values()}, tmp, f"{g.role}.debug.onnx")
        readings.append(_Reading(_session(path, config), missing, "exported"))
    return production, readings


def run_onnx(graphs: list[_Graph], input_ids, attention_mask, decoder_ids, config: SessionConfig, facts: dict):
    """Module outputs {module: (array, source)}, the backend's own logits at the last position of
    `decoder_ids` (b, t), and each reading's logits there (how much reading changed them)."""
    with tempfile.TemporaryDirectory(prefix="locate-") as folder:
        prepared = {g.role: _readings(g, config, Path(folder)) for g in graphs}  # sessions keep what they need

    feeds: dict[str, dict] = {}
    if "full" in prepared:
        feeds["full"] = {"input_ids": input_ids, "attention_mask": attention_mask, "decoder_input_ids": decoder_ids}
    else:
        feeds["encoder"] = {"input_ids": input_ids, "attention_mask": attention_mask}
        encoder = prepared["encoder"][0]
        names = [o.name for o in encoder.get_outputs()]
        cross = dict(zip(names, encoder.run(names, feeds["encoder"])))
        dec = prepared["decoder"][0]
        types = _feeds_types(dec)
        past_names = [i.name for i in dec.get_inputs() if i.name.startswith("past.")]
        present_names = [o.name for o in dec.get_outputs() if o.name.startswith("present.")]
        heads = facts["decoder_attention_heads"]
        head_dim = facts.get("head_dim") or facts["d_model"] // heads
        rows = input_ids.shape[0]
        past = {n: np.zeros((rows, heads, 0, head_dim), dtype=types[n]) for n in past_names}  # (b, h, 0, d)
        fixed = {"encoder_attention_mask": attention_mask}
        fixed.update((n, cross[n].astype(types[n])) for n in types if n.startswith("cross."))
        # The forced prefix through the production graph: the past the backend itself would hold.
        for t in range(decoder_ids.shape[1] - 1):
            present = dec.run(present_names, {**fixed, **past, "input_ids": decoder_ids[:, t : t + 1]})
            past = {p: v.astype(types[p]) for p, v in zip(past_names, present)}
        feeds["decoder"] = {**fixed, **past, "input_ids": decoder_ids[:, -1:]}
    last = "full" if "full" in prepared else "decoder"
    (logits,) = prepared[last][0].run(["logits"], feeds[last])

    values: dict[str, tuple[np.ndarray, str]] = {}
    reading_logits: dict[str, np.ndarray] = {}
    for role, (_, readings) in prepared.items():
        for reading in readings:
            names = sorted(set(reading.outputs.values()) | ({"logits"} if role == last else set()))
            results = dict(zip(names, reading.session.run(names, feeds[role])))
            for module, name in reading.outputs.items():
                values[module] = (results[name], reading.source)
            if role == last:
                reading_logits[reading.source] = results["logits"][:, -1]
    return values, logits[:, -1], reading_logits


def load_graphs(backend: Backend, modules: list[str]) -> list[_Graph]:
    import onnx

    if backend.name not in GRAPHS:
        raise LocateError(
            f"locate compares an ONNX backend's graphs with PyTorch; {backend.name!r} has none. "
            f"Expected one of: {', '.join(GRAPHS)}"
        )
    graphs = []
    for name in GRAPHS[backend.name]:
        path = backend.manifest.verify_graph(name)  # the same checksum check as the backend's
        model = onnx.load(str(path))
        graphs.append(_Graph(name, _role(name), path, model, map_graph(model, modules, path.name)))
    taken: set[str] = set()
    for g in graphs:  # a module found in two graphs is compared in the first (encoder first)
        for module in [m for m in g.map.values if m in taken]:
            del g.map.values[module]
        taken |= set(g.map.values)
    return graphs
