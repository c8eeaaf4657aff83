"""Locate's numbers: PyTorch's activations per module (forward hooks) and how far a backend's are.

torch is imported lazily, inside `torch_activations`: importing the request layer loads no torch.
"""

from __future__ import annotations

import math

import numpy as np

from .locate_graph import _OVER_SOURCE, LocateError

TOLERANCE = 1e-4  # fp32: max |Δ| per module, as the export's logits check
JUMP_FACTOR = 4.0  # fp16 / int8: relative error over this many times the worst before it
PRECISION_FLOOR = {"fp16": 2.0**-11, "int8": 1.0 / 127}

def torch_activations(hf_model, input_ids: np.ndarray, attention_mask: np.ndarray, decoder_ids: np.ndarray,
                      modules: list[str]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Outputs of `modules` (HF paths below `hf_model.model`, or the model itself for T5, and `lm_head`) in one teacher-forced
    forward without cache, and the logits (b, t, V). Forward hooks on the model's own modules."""
    import torch

    captured: dict[str, np.ndarray] = {}
    by_module: dict[int, list[str]] = {}
    handles = []
    # BART-style models keep their stacks under `.model`; T5 keeps them on the model itself.
    stacks = getattr(hf_model, "model", hf_model)
    for name in modules:
        module = hf_model.lm_head if name == "lm_head" else stacks.get_submodule(name)
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
