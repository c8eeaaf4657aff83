"""From a diverging token to the module that drifted: PyTorch's activations against the same values
inside the backend's ONNX graph, module by module, at one decoding step.

The divergence view says *where in the output* two backends fork; this says *where in the model*.
For one input, teacher-forced on the reference's tokens (as the drift plot is):

1. pick the step: the first diverging step, or the step with the largest |Δlogit|, or a given one;
2. PyTorch: one forward over the source and the forced prefix, with forward hooks on the HF
   model's own modules (`encoder.layers.{i}.fc1`, `decoder.layers.{i}.encoder_attn`, `lm_head`...);
3. ONNX: the same values inside each graph the backend runs, made graph outputs (ORT returns
   any intermediate value once it is one; see "Reading" below); the KV-cache decoder gets the
   past its own production graph computed over the forced prefix;
4. per module in execution order (encoder layers, decoder layers, output projection): max |Δ|,
   relative error (||Δ|| / ||reference||, 2-norm), the ONNX op types computed since the previous
   boundary, and the first module over the tolerance.

Mapping values to modules. The dynamo exporter records on every node the module call it came
from (`pkg.torch.onnx.name_scopes`, `namespace`, `pkg.torch.onnx.class_hierarchy`); our KV-cache
wrappers (`export/wrappers.py`) call the HF model's own submodules, so their scopes
(`layers.1.fc1` in `DecoderStepWithCache`, `cross_attn.0.k_proj` in `EncoderWithCrossKV`) map to HF
paths by a small table; any other scope is searched for `encoder|decoder.layers.N...`, so a graph
exported straight from `MarianMTModel` maps as well, and so do the node names of the TorchScript
exporter (`/model/decoder/layers.0/fc1/MatMul`). Nodes without metadata (casts added by the fp16
converter) take the module of their readers when those all agree. A module's boundary value is
the last value produced inside its scope that is read outside it (or is a graph output): the
comparison happens where modules hand over, so constant folding and ORT's fusions inside a
module do not matter. What survives which rewrite: the fp16 conversion keeps every node's
metadata (its added Casts sit at graph inputs and outputs); the tied-embedding rewrite and
ORT's int8 quantizer add nodes that `export/rewrite.py` now gives the metadata of the nodes they
replace (exports made before that change lose `lm_head` in int8, reported as unmapped).

Reading. Adding graph outputs to the exported graph changes what ORT does with it: an output
blocks fusions around it, and in fp16 it forces a rounding ORT's CPU kernels skip (they compute
most fp16 ops in fp32 and drop the casts between them), so such a copy's fp16 logits were off by
half the backend's own drift. So the values are read from ORT's own optimized graph (saved by a
session made as the backend's), with the outputs added and no further optimization: the
backend's very numbers (its logits match to 0). A value ORT computes in fp32 is found under its
`InsertedPrecisionFreeCast_` name. A module output ORT fused into a larger kernel (an output
projection's or fc2's bias with the residual into SkipLayerNormalization) exists only in a copy
of the exported graph: read from there, marked `"read_from": "exported"`, and that copy's
logits difference is reported too (`reading_max_abs_dlogit`). Each row lists the op types of
the exported graph since the previous module, and of ORT's graph (`ort_op_types`: FusedMatMul,
QuickGelu, SkipLayerNormalization, the Casts it inserted) where it was read there.

Tolerance. fp32: a module is over when its max |Δ| exceeds 1e-4 (the export's own logits
criterion). fp16 / int8: every module is off by the precision's rounding, so "over 1e-4" says
nothing; a module is over when its relative error jumps above JUMP_FACTOR times the largest
relative error of the modules before it (at least the precision's floor): where the drift comes
from, not where it shows.

Names are the HF model's own module paths below `MarianMTModel.model` (`decoder.layers.4.fc1`),
plus `lm_head`. Only this module imports torch in the request layer, lazily: it hooks the
PyTorch model. The ORT backends are untouched; the sessions here are built with their settings.
"""

from __future__ import annotations

import ast
import math
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backends import REFERENCE, Backend, InputError, ManifestError, SessionConfig, load_backends
from backends.divergence import first_divergence, forced_drift

TOLERANCE = 1e-4  # fp32: max |Δ| per module, as the export's logits check
JUMP_FACTOR = 4.0  # fp16 / int8: relative error over this many times the worst before it
# The least relative error a reduced-precision module shows anyway: fp16's unit roundoff; int8's
# step for a per-channel symmetric weight scale (max |w| / 127).
PRECISION_FLOOR = {"fp16": 2.0**-11, "int8": 1.0 / 127}

# The graphs each ORT backend runs, encoder first (manifest graph names).
GRAPHS = {
    "ort_fp32_single_step": ("full",),
    "ort_fp32_kv_cache": ("encoder", "decoder"),
    "ort_fp16": ("encoder_fp16", "decoder_fp16"),
    "ort_int8": ("encoder_int8", "decoder_int8"),
}

ENCODER_PARTS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn", "self_attn_layer_norm",
    "fc1", "activation_fn", "fc2", "final_layer_norm",
)
DECODER_PARTS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn", "self_attn_layer_norm",
    "encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj", "encoder_attn", "encoder_attn_layer_norm",
    "fc1", "activation_fn", "fc2", "final_layer_norm",
)
# Decoder modules computed over the source (cross-attention keys and values): compared at every
# source position; every other decoder module at the chosen step's position only.
_OVER_SOURCE = re.compile(r"^decoder\.layers\.\d+\.encoder_attn\.[kv]_proj$")

# Scopes of our own wrappers (export/wrappers.py) -> HF paths below MarianMTModel.model.
_WRAPPER_SCOPES = {
    "export.wrappers.EncoderWithCrossKV": (
        (r"^layers\.", "encoder.layers."),
        (r"^cross_attn\.(\d+)(?=\.|$)", r"decoder.layers.\1.encoder_attn"),
        (r"^embed_tokens$", "encoder.embed_tokens"),
    ),
    "export.wrappers.DecoderStepWithCache": (
        (r"^layers\.", "decoder.layers."),
        (r"^embed_tokens$", "decoder.embed_tokens"),
        (r"^lm_head$", "lm_head"),
    ),
}
# Anything else (HF's own forward, other exporters' wrappers): the HF path inside the scope.
_HF_PATH = re.compile(r"(?:^|\.)((?:encoder|decoder)\.(?:layers\.\d+(?:\.\w+)*|embed_tokens)|lm_head)$")

_FLOATS = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}
_PLUMBING = {7, 9}  # int64, bool: shape arithmetic and masks, not the numbers we compare


class LocateError(ValueError):
    """The input, the backend or the graph does not allow a per-module comparison; says why."""


def module_order(encoder_layers: int, decoder_layers: int) -> list[str]:
    """Every module the report compares, in execution order."""
    enc = [f"encoder.layers.{i}.{p}" for i in range(encoder_layers) for p in ENCODER_PARTS]
    dec = [f"decoder.layers.{i}.{p}" for i in range(decoder_layers) for p in DECODER_PARTS]
    return ["encoder.embed_tokens", *enc, "decoder.embed_tokens", *dec, "lm_head"]


# --- graph side: which value is which module's output ---------------------------------------------


def _node_scope(node) -> tuple[str | None, str | None]:
    """(root class, deepest module scope) recorded for one node; (None, None) when nothing is."""
    meta = {p.key: p.value for p in node.metadata_props}
    scopes = meta.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            names = ast.literal_eval(scopes)
            classes = ast.literal_eval(meta.get("pkg.torch.onnx.class_hierarchy", "[]"))
        except (ValueError, SyntaxError):
            names, classes = None, []
        if isinstance(names, list) and names:
            modules = [n for n in names[:-1] if n]  # the last entry is the operator, "" the root
            return (classes[0] if classes else None), (modules[-1] if modules else "")
    namespace = meta.get("namespace")
    if namespace:  # ": root.Class/scope: module.Class/.../op: aten.op"
        parts = [p.split(": ", 1) for p in namespace.split("/")]
        root = parts[0][1] if len(parts[0]) == 2 else None
        modules = [p[0] for p in parts[1:-1] if p[0]]
        return root, (modules[-1] if modules else "")
    if node.name.startswith("/") and node.name.count("/") >= 2:  # TorchScript: /model/decoder/layers.0/fc1/MatMul
        return "torchscript", ".".join(node.name.split("/")[1:-1])
    return None, None


def hf_module(root: str | None, scope: str | None) -> str | None:
    """A recorded scope as an HF module path; "" for code outside every reported module, None
    when the node carries no scope at all."""
    if scope is None:
        return None
    for pattern, replacement in _WRAPPER_SCOPES.get(root or "", ()):
        if re.match(pattern, scope):
            return re.sub(pattern, replacement, scope, count=1)
    match = _HF_PATH.search(scope)
    return match.group(1) if match else ""


def _within(module: str | None, parent: str) -> bool:
    return module is not None and (module == parent or module.startswith(parent + "."))


@dataclass
class GraphMap:
    """Where each module's output lives in one graph, and what was computed to get there."""

    file: str
    values: dict[str, str] = field(default_factory=dict)  # module -> value name
    op_types: dict[str, list[str]] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)  # value name -> ONNX elem type


def _value_types(model) -> dict[str, int]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    types = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in inferred.graph.initializer:
        types[init.name] = init.data_type
    return types


def map_graph(model, modules: list[str], file: str = "") -> GraphMap:
    """Find each of `modules`' output value in an ONNX graph (an `onnx.ModelProto`).

    Raises LocateError when the graph records no module scopes at all."""
    graph = model.graph
    nodes = list(graph.node)
    mods = [hf_module(*_node_scope(n)) for n in nodes]
    if all(m is None for m in mods):
        raise LocateError(
            f"cannot map {file or 'this graph'} to the model's modules: none of its {len(nodes)} nodes records the "
            "module it came from (no `namespace` / `pkg.torch.onnx.name_scopes` metadata from torch.onnx.export("
            "dynamo=True), no scoped TorchScript node names); re-export it with `python -m export` to locate drift"
        )
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for name in n.input:
            readers.setdefault(name, []).append(i)
    outputs = {o.name for o in graph.output}
    # Nodes without metadata (the fp16 converter's casts) belong to their readers' module if
    # those agree; walk readers-first.
    for i in reversed(range(len(nodes))):
        if mods[i] is None and not any(o in outputs for o in nodes[i].output):
            users = {mods[r] for o in nodes[i].output for r in readers.get(o, [])}
            if len(users) == 1 and None not in users:
                mods[i] = users.pop()

    types = _value_types(model)
    result = GraphMap(file=file, types=types)
    for module in modules:
        candidates = []
        for i, n in enumerate(nodes):
            if not _within(mods[i], module):
                continue
            for name in n.output:
                if not name or types.get(name) not in _FLOATS:
                    continue
                if name in outputs or any(not _within(mods[r], module) for r in readers.get(name, [])):
                    candidates.append((i, name))
        if candidates:
            value = max(candidates)[1]  # the last one produced: the module's output
            # Only a reported part of it here (the encoder graph computes the decoder's
            # cross-attention keys and values, not the attention): not this module's output.
            if not any(result.values.get(m) == value for m in modules if m.startswith(module + ".")):
                result.values[module] = value

    result.op_types = op_types_since(nodes, result.values, modules, types)
    return result


def op_types_since(nodes, values: dict[str, str], modules: list[str], types: dict[str, int]) -> dict[str, list[str]]:
    """Per module, the op types computed since the modules before it: the nodes its output
    depends on that no earlier module's output depends on (shape arithmetic left out)."""
    producer = {name: i for i, n in enumerate(nodes) for name in n.output}

    def ancestors(value: str) -> set[int]:
        seen, stack = set(), [value]
        while stack:
            i = producer.get(stack.pop())
            if i is not None and i not in seen:
                seen.add(i)
                stack.extend(nodes[i].input)
        return seen

    counted: set[int] = set()
    result = {}
    for module in modules:
        if module not in values:
            continue
        mine = ancestors(values[module])
        fresh = sorted(mine - counted)
        counted |= mine
        ops = []
        for i in fresh:
            n = nodes[i]
            plumbing = n.op_type in ("Constant", "Shape") or all(types.get(o) in _PLUMBING for o in n.output)
            if not plumbing and n.op_type not in ops:
                ops.append(n.op_type)
        result[module] = ops
    return result


def with_outputs(model, outputs: dict[str, int], folder: Path, name: str) -> Path:
    """Save a copy of `model` with `outputs` (value name -> ONNX elem type) added as graph outputs:
    ORT returns any intermediate value once it is a graph output."""
    import onnx
    from onnx import helper

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    existing = {o.name for o in copy.graph.output}
    for value, elem_type in outputs.items():
        if value not in existing:
            copy.graph.output.append(helper.make_tensor_value_info(value, elem_type, None))
    path = folder / name
    big = copy.ByteSize() > 1_800_000_000  # protobuf's 2 GB limit
    onnx.save(copy, str(path), save_as_external_data=big, location=f"{name}.data" if big else None)
    return path


# ONNX Runtime renames a value it now computes in fp32 where the graph said fp16 (its CPU kernels
# mostly have no fp16 version): InsertCastTransformer's prefix.
_ORT_FP32_PREFIX = "InsertedPrecisionFreeCast_"


# --- PyTorch side ------------------------------------------------------------------------------------


def torch_activations(hf_model, input_ids: np.ndarray, attention_mask: np.ndarray, decoder_ids: np.ndarray,
                      modules: list[str]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Outputs of `modules` (HF paths below `hf_model.model`, and `lm_head`) in one teacher-forced
    forward without cache, and the logits (b, t, V). Forward hooks on the model's own modules."""
    import torch

    captured: dict[str, np.ndarray] = {}
    by_module: dict[int, list[str]] = {}
    handles = []
    for name in modules:
        module = hf_model.lm_head if name == "lm_head" else hf_model.model.get_submodule(name)
        by_module.setdefault(id(module), []).append(name)
        if len(by_module[id(module)]) > 1:
            continue  # one module under several names (tied embeddings): its calls, in order

        def hook(mod, args, output):
            out = output[0] if isinstance(output, tuple) else output
            names = by_module[id(mod)]
            calls = sum(n in captured for n in names)
            if calls < len(names):
                captured[names[calls]] = out.detach().float().numpy().copy()

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            out = hf_model(
                input_ids=torch.from_numpy(input_ids),
                attention_mask=torch.from_numpy(attention_mask),
                decoder_input_ids=torch.from_numpy(decoder_ids),
                use_cache=False,
                return_dict=True,
            )
    finally:
        for h in handles:
            h.remove()
    return captured, out.logits.float().numpy()


# --- the comparison ----------------------------------------------------------------------------------


def _at_step(module: str, reference: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both sides at the compared positions: decoder modules at the last (the chosen step's)
    position, encoder modules and cross-attention keys/values at every source position."""
    full_shape = reference.shape  # (b, t, ...) from PyTorch
    if (module.startswith("decoder.") or module == "lm_head") and not _OVER_SOURCE.match(module):
        reference = reference[:, -1]
        value = value.reshape(full_shape)[:, -1] if value.size == np.prod(full_shape) else value
    if value.size != reference.size:
        raise LocateError(
            f"{module}: the graph's value has shape {list(value.shape)}, PyTorch's {list(reference.shape)}"
        )
    return reference.astype(np.float64), value.reshape(reference.shape).astype(np.float64)


def compare_values(reference: np.ndarray, value: np.ndarray) -> tuple[float, float]:
    """(max |Δ|, relative error ||Δ|| / ||reference|| in the 2-norm); inf when the graph's value
    is not finite. The norm-wise relative error is scale-free and not led by one outlier entry."""
    if not np.isfinite(value).all():
        return math.inf, math.inf
    if not reference.size:
        return 0.0, 0.0
    delta = reference - value
    diff = float(np.abs(delta).max())
    norm, scale = float(np.linalg.norm(delta)), float(np.linalg.norm(reference))
    return diff, (norm / scale if scale > 0 else (0.0 if norm == 0 else math.inf))


def apply_tolerance(layers: list[dict], precision: str) -> tuple[dict, dict | None]:
    """Set each row's `threshold` and `over`; return the rule used and, for reduced precision,
    the largest jump (the module whose relative error grew most over the worst before it)."""
    if precision not in PRECISION_FLOOR:
        for row in layers:
            row["threshold"] = TOLERANCE
            row["over"] = row["max_abs_diff"] > TOLERANCE
        return {"rule": "absolute", "metric": "max_abs_diff", "value": TOLERANCE}, None
    floor = PRECISION_FLOOR[precision]
    worst, largest = floor, None
    for row in layers:
        row["threshold"] = JUMP_FACTOR * worst
        row["over"] = row["rel_error"] > row["threshold"]
        ratio = row["rel_error"] / worst
        if largest is None or ratio > largest["ratio"]:
            largest = {"module": row["module"], "ratio": ratio, "rel_error": row["rel_error"], "before": worst}
        worst = max(worst, row["rel_error"])
    return {"rule": "jump", "metric": "rel_error", "factor": JUMP_FACTOR, "floor": floor}, largest


# --- running it --------------------------------------------------------------------------------------


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

    options = ort.SessionOptions()
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    options.intra_op_num_threads = config.resolved_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.enable_cpu_mem_arena = False
    options.log_severity_level = 3  # saving an ENABLE_ALL graph warns that it is for this machine only
    if save_optimized is not None:
        options.optimized_model_filepath = str(save_optimized)
    return ort.InferenceSession(str(path), sess_options=options, providers=config.providers())


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
    fused into a larger kernel (an output projection's bias and the residual into
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


def _run_onnx(graphs: list[_Graph], input_ids, attention_mask, decoder_ids, config: SessionConfig, facts: dict):
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
        head_dim = facts["d_model"] // heads
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


def _hf_model(backends: dict[str, Backend]):
    reference = backends.get(REFERENCE)
    if reference is not None and hasattr(reference.model, "model"):
        return reference.model.model  # the loaded reference's MarianMTModel
    from transformers import MarianMTModel

    from backends.pytorch import source_model_of

    backend = next(iter(backends.values()))
    return MarianMTModel.from_pretrained(str(source_model_of(backend.manifest))).eval()


def _load_graphs(backend: Backend, modules: list[str]) -> list[_Graph]:
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


def choose_step(reference_ids: list[int], backend_ids: list[int] | None, step: int | str | None,
                drift: list[float] | None = None) -> tuple[int, str]:
    """(step, why). `step`: an index, "max" (largest teacher-forced |Δlogit|, from `drift`), or
    None: the first diverging step, else the largest |Δlogit|."""
    last = len(reference_ids) - 1
    if isinstance(step, (int, np.integer)) and not isinstance(step, bool):
        if not 0 <= step <= last:
            raise LocateError(f"step must be in 0..{last} (the reference has {last + 1} tokens), got {step}")
        return int(step), "given"
    if step not in (None, "max"):
        raise LocateError(f"step must be an integer, 'max' or None, got {step!r}")
    if step is None and backend_ids is not None:
        fork = first_divergence(reference_ids, backend_ids)
        if fork is not None:
            return min(fork, last), "first diverging step"
    if drift is None:
        raise LocateError("choosing the step with the largest |Δlogit| needs the teacher-forced drift")
    return int(np.argmax(drift)), "largest teacher-forced |Δlogit|"


def locate(backends_or_export: dict[str, Backend] | str | Path, backend_name: str, text: str,
           step: int | str | None = None, *, reference_ids: list[int] | None = None,
           backend_ids: list[int] | None = None, threads: int | None = None,
           max_new_tokens: int | None = None) -> dict[str, Any]:
    """The per-module report for `backend_name` on `text` (one segment), as JSON-ready dict.

    `backends_or_export`: loaded backends (the reference among them, or its weights are loaded
    from the export's source) or an export folder. `reference_ids`: the reference's tokens for
    this text (None: translate it); `backend_ids`: the backend's own (None: translate it when the
    first diverging step is wanted); `max_new_tokens` caps those translations (None: the model's
    decoding defaults). Raises LocateError with the reason when it cannot compare.
    """
    start = time.perf_counter()
    if isinstance(backends_or_export, (str, Path)):
        backends = load_backends(backends_or_export, (REFERENCE, backend_name), SessionConfig(threads=threads))
    else:
        backends = backends_or_export
    if backend_name not in backends:
        raise LocateError(f"backend {backend_name!r} is not loaded; loaded: {', '.join(backends)}")
    backend = backends[backend_name]
    if backend_name not in GRAPHS:
        raise LocateError(f"{backend_name!r} runs no ONNX graph to locate drift in; expected one of: {', '.join(GRAPHS)}")
    if not text or not text.strip():
        raise LocateError("the text is empty")

    manifest = backend.manifest
    facts = manifest.data["model"]
    modules = module_order(facts["encoder_layers"], facts["decoder_layers"])
    graphs = _load_graphs(backend, modules)  # fails early, before any model runs, if unmappable

    if reference_ids is None:
        if REFERENCE not in backends:
            raise LocateError(f"the reference tokens are needed: load {REFERENCE!r} or pass reference_ids")
        reference_ids = backends[REFERENCE].translate([text], max_new_tokens=max_new_tokens)[0].token_ids
    if not reference_ids:
        raise LocateError("the reference produced no tokens to force")
    if step is None and backend_ids is None:
        backend_ids = backend.translate([text], max_new_tokens=max_new_tokens)[0].token_ids
    drift = None
    if step == "max" or (step is None and first_divergence(reference_ids, backend_ids or reference_ids) is None):
        if REFERENCE not in backends:
            raise LocateError(f"the largest |Δlogit| step needs {REFERENCE!r} loaded; pass step=N instead")
        drift = forced_drift(backends[REFERENCE].score(text, reference_ids), backend.score(text, reference_ids))[
            "max_abs_dlogit"
        ]
    chosen, why = choose_step(reference_ids, backend_ids, step, drift)

    batch = backend.tokenizer.encode([text], manifest.max_source_tokens)
    special = manifest.special
    decoder_ids = np.array([[special.decoder_start, *reference_ids[:chosen]]], dtype=np.int64)  # (1, step + 1)
    mapped = [m for m in modules if any(m in g.map.values for g in graphs)]
    reference, torch_logits = torch_activations(_hf_model(backends), batch.input_ids, batch.attention_mask,
                                                decoder_ids, mapped)
    config = SessionConfig(threads=threads or backend.info.get("threads"))
    values, backend_logits, reading_logits = _run_onnx(graphs, batch.input_ids, batch.attention_mask, decoder_ids,
                                                       config, facts)

    layers = []
    for module in mapped:
        graph = next(g for g in graphs if module in g.map.values)
        value, source = values[module]
        ref, val = _at_step(module, reference[module], value)
        max_abs, rel = compare_values(ref, val)
        layers.append({
            "module": module,
            "max_abs_diff": max_abs,
            "rel_error": rel,
            "op_types": graph.map.op_types[module],
            "ort_op_types": graph.ort_op_types.get(module) if source == "onnxruntime" else None,
            "read_from": source,
            "graph": graph.path.name,
            "value": graph.map.values[module],
            "dtype": _FLOATS[graph.map.types[graph.map.values[module]]],
        })
    precision = manifest.graph(GRAPHS[backend_name][-1])["precision"]
    tolerance, largest_jump = apply_tolerance(layers, precision)
    first = next((row for row in layers if row["over"]), None)
    pieces = backend.tokenizer.pieces
    ref_logits = torch_logits[0, -1].astype(np.float64)
    prod = backend_logits[0].astype(np.float64)
    report = {
        "backend": backend_name,
        "text": text,
        "step": chosen,
        "step_rule": why,
        "precision": precision,
        "reference_token": {"id": int(reference_ids[chosen]), "piece": pieces([reference_ids[chosen]])[0]},
        "backend_argmax": {"id": int(np.argmax(prod)), "piece": pieces([int(np.argmax(prod))])[0]},
        "max_abs_dlogit": float(np.abs(prod - ref_logits).max()),
        "graphs": [g.path.name for g in graphs],
        "tolerance": tolerance,
        "layers": layers,
        "first_over_tolerance": first,
        "largest_jump": largest_jump,
        "unmapped": [m for m in modules if m not in mapped],
        # Reading module outputs must not change the numbers: each reading's logits against the
        # backend's own. "onnxruntime" reads ORT's optimized graph (0 expected); "exported" a copy
        # of the exported graph, which ORT optimizes around the outputs read (a little off in fp16).
        "reading_max_abs_dlogit": {
            source: float(np.abs(value[0].astype(np.float64) - prod).max()) for source, value in reading_logits.items()
        },
        "seconds": round(time.perf_counter() - start, 2),
    }
    report["summary"] = summary(report)
    return report


def summary(report: dict[str, Any]) -> str:
    """One sentence: where the drift comes from."""
    step = f"step {report['step']} ({report['step_rule']})"
    first = report["first_over_tolerance"]
    tol = report["tolerance"]
    if first is None:
        if tol["rule"] == "absolute":
            return f"{report['backend']} at {step}: no module over max |Δ| {tol['value']:g}"
        jump = report["largest_jump"]
        return (f"{report['backend']} at {step}: no module's relative error jumps over {tol['factor']:g}x the modules "
                f"before it (largest increase: {jump['module']}, {jump['ratio']:.2g}x); the drift is spread over the model")
    ops = ", ".join(first["op_types"]) or "no new ops"
    if tol["rule"] == "absolute":
        what = f"max |Δ| {first['max_abs_diff']:.3g} > {tol['value']:g}"
    else:
        what = f"relative error {first['rel_error']:.3g} > {first['threshold']:.3g} ({tol['factor']:g}x the worst before it)"
    return f"{report['backend']} at {step}: first over tolerance is {first['module']} ({ops}): {what}"


def locate_for_ui(loaded_backends: dict[str, Backend], name: str, text: str, reference_ids: list[int],
                  backend_ids: list[int] | None = None, step: int | str | None = None) -> dict[str, Any]:
    """For the app's "locate" button: `locate` on one segment's text with the tokens the compare
    run already has (no decode is repeated when `backend_ids` are given). Returns the report,
    or {"backend", "text", "error": why} when it cannot be located (unmappable graph, no
    reference loaded, ...): the message is for the user, as is."""
    try:
        return locate(loaded_backends, name, text, step, reference_ids=reference_ids, backend_ids=backend_ids)
    except (LocateError, ManifestError, InputError) as e:  # shown to the user, as the compare errors are
        return {"backend": name, "text": text, "error": str(e)}
