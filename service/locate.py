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
`InsertedPrecisionFreeCast_` name. A module output ORT fused into a larger kernel (with CUDA, an
output projection's or fc2's bias with the residual into SkipLayerNormalization; our CPU sessions
leave that fusion off, backends/ort_session.py) exists only in a copy of the exported graph: read
from there, marked `"read_from": "exported"`, and that copy's logits difference is reported too
(`reading_max_abs_dlogit`). Each row lists the op types of the exported graph since the previous
module, and of ORT's graph (`ort_op_types`: FusedMatMul, QuickGelu, SkipLayerNormalization with
CUDA, the Casts it inserted) where it was read there.

Tolerance. fp32: a module is over when its max |Δ| exceeds 1e-4 (the export's own logits
criterion). fp16 / int8: every module is off by the precision's rounding, so "over 1e-4" says
nothing; a module is over when its relative error jumps above JUMP_FACTOR times the largest
relative error of the modules before it (at least the precision's floor): where the drift comes
from, not where it shows.

Names are the HF model's own module paths below its `.model` (`decoder.layers.4.fc1`; the family's
class from the sidecar: MarianMTModel, M2M100ForConditionalGeneration, MBartForConditionalGeneration),
plus `lm_head`; pre-norm families list each LayerNorm before its sub-layer, and their final and
embedding norms (`decoder.layer_norm`, `encoder.layernorm_embedding`) as modules of their own. Only this module imports torch in the request layer, lazily: it hooks the
PyTorch model. The ORT backends are untouched; the sessions here are built with their settings.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backends import REFERENCE, Backend, InputError, ManifestError, SessionConfig, load_backends
from backends.divergence import first_divergence, forced_drift

from .locate_graph import (  # noqa: F401  (LocateError, map_graph ... are this module's API too)
    _FLOATS,
    _ORT_FP32_PREFIX,
    _OVER_SOURCE,
    GraphMap,
    LocateError,
    _node_scope,
    hf_module,
    map_graph,
    module_order,
    op_types_since,
    with_outputs,
)
from .locate_numbers import (  # noqa: F401  (the tolerances are this module's API too)
    JUMP_FACTOR,
    PRECISION_FLOOR,
    TOLERANCE,
    _at_step,
    apply_tolerance,
    compare_values,
    torch_activations,
)

# The least relative error a reduced-precision module shows anyway: fp16's unit roundoff; int8's
# step for a per-channel symmetric weight scale (max |w| / 127).

# The graphs each ORT backend runs, encoder first (manifest graph names).
GRAPHS = {
    "ort_fp32_single_step": ("full",),
    "ort_fp32_kv_cache": ("encoder", "decoder"),
    "ort_fp16": ("encoder_fp16", "decoder_fp16"),
    "ort_int8": ("encoder_int8", "decoder_int8"),
}

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
    """The loaded reference's HF model, else the export's source loaded with its own family's class
    (the sidecar's architecture: MarianMTModel, M2M100ForConditionalGeneration, ...)."""
    reference = backends.get(REFERENCE)
    if reference is not None and hasattr(reference.model, "model"):
        return reference.model.model
    import transformers

    from backends.pytorch import SUPPORTED_ARCHITECTURES, source_model_of

    manifest = next(iter(backends.values())).manifest
    if manifest.architecture not in SUPPORTED_ARCHITECTURES:
        raise LocateError(f"unsupported architecture {manifest.architecture!r}; expected one of: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    model_class = getattr(transformers, manifest.architecture)
    return model_class.from_pretrained(str(source_model_of(manifest))).eval()


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
    modules = module_order(facts["encoder_layers"], facts["decoder_layers"], manifest.data.get("family"))
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
