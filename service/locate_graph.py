"""Locate's map from an ONNX graph to the HF model's modules, and the debug copy that exposes them.

The exporter records on every node the module call it came from (`pkg.torch.onnx.name_scopes`,
`namespace`); `map_graph` turns that into, per module, the value where the module hands over to
the next (the last value produced inside its scope and read outside it), so the comparison is
robust to constant folding and fusions inside a module. `service/locate.py` runs the comparison.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from families import DEFAULT_FAMILY, FAMILIES, family_named, layouts

# Each family's module naming (families/): its layout's scopes, paths and order.
_LAYOUTS = layouts()
# Scopes of the graph wrappers -> HF paths below the HF model's `.model`.
_WRAPPER_SCOPES = {root: scopes for layout in _LAYOUTS for root, scopes in layout.naming.wrapper_scopes.items()}
# Decoder modules computed over the source (cross-attention keys and values): compared at every
# source position; every other decoder module at the chosen step's position only.
_OVER_SOURCE = re.compile("|".join(f"(?:{layout.naming.over_source.pattern})" for layout in _LAYOUTS))

_FLOATS = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}
_PLUMBING = {7, 9}  # int64, bool: shape arithmetic and masks, not the numbers we compare


class LocateError(ValueError):
    """The input, the backend or the graph does not allow a per-module comparison; says why."""


def module_order(encoder_layers: int, decoder_layers: int, family: dict | None = None) -> list[str]:
    """Every module the report compares, in execution order, as the family's layout names them.
    `family`: the sidecar's "family" section (its name and norm flags); None: the default family."""
    section = family if family is not None else vars(FAMILIES[DEFAULT_FAMILY])
    entry = family_named(section.get("name", DEFAULT_FAMILY))
    if entry is None:
        raise LocateError(f"unknown model family {section.get('name')!r}; expected one of: {', '.join(FAMILIES)}")
    return entry.layout.naming.order(section, encoder_layers, decoder_layers)


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
    for layout in _LAYOUTS:
        match = layout.naming.hf_path.search(scope)
        if match:
            return match.group(1)
    return ""


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
