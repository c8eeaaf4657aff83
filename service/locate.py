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
ORT's int8 quantizer add nodes that `export/rewrite.py` gives the metadata of the nodes they
replace.

Reading: see `locate_onnx`, which reads the values from ORT's own optimized graph, so they are the
backend's very numbers.

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

import time
from pathlib import Path
from typing import Any

import numpy as np

from backends import GRAPHS, REFERENCE, Backend, InputError, ManifestError, SessionConfig, load_backends
from backends.divergence import first_divergence, forced_drift

from .locate_graph import (  # noqa: F401  (LocateError, map_graph ... are this module's API too)
    _FLOATS,
    GraphMap,
    LocateError,
    _node_scope,
    hf_module,
    map_graph,
    module_order,
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
from .locate_onnx import load_graphs, run_onnx


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
    modules = module_order(facts["encoder_layers"], facts["decoder_layers"], manifest.data["family"])
    graphs = load_graphs(backend, modules)  # fails early, before any model runs, if unmappable

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
    values, backend_logits, reading_logits = run_onnx(graphs, batch.input_ids, batch.attention_mask, decoder_ids,
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
