"""fp32 -> fp16 graphs with onnxconverter-common's `convert_float_to_float16`.

Two shapes in the dynamo exporter's graphs trip that converter, and both are fixed before and
after converting (recorded in the sidecar):
- a graph output that is also read inside the graph (the decoder's `present.*` feed its own
  attention): with `keep_io_types` the converter casts the output to fp32 and the internal reader
  then gets fp32 where it expects fp16. We route every such output through an Identity first.
- a `Cast(to=FLOAT)` (the attention mask turned into an additive bias) keeps `to=FLOAT` while the
  converter types its output fp16: we retarget those casts to FLOAT16.
Inputs and outputs stay fp32 (`keep_io_types=True`): the cache and logits cross the session
boundary in fp32, so the shared decoding loop and the divergence view read the same dtype from
every backend.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

def _route_outputs_through_identity(model: onnx.ModelProto) -> list[str]:
    graph = model.graph
    outputs = {o.name for o in graph.output}
    read_inside = {name for node in graph.node for name in node.input} & outputs
    for name in sorted(read_inside):
        internal = f"{name}__internal"
        for node in graph.node:
            node.output[:] = [internal if o == name else o for o in node.output]
            node.input[:] = [internal if i == name else i for i in node.input]
        graph.node.append(helper.make_node("Identity", [internal], [name], name=f"{name}__identity"))
    return sorted(read_inside)


def _retarget_float_casts(model: onnx.ModelProto) -> int:
    fp16_values = {
        v.name for v in model.graph.value_info if v.type.tensor_type.elem_type == TensorProto.FLOAT16
    }
    changed = 0
    for node in model.graph.node:
        if node.op_type != "Cast" or node.output[0] not in fp16_values:
            continue
        for attr in node.attribute:
            if attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.FLOAT16
                changed += 1
    return changed


def _unshare_initializers(model: onnx.ModelProto, keep_nodes: set[str], keep_ops: set[str]) -> int:
    """Give the fp32-kept nodes their own copy of every initializer they share with fp16 nodes (the
    exporter merges equal constants): the converter keeps a shared one fp32 for both, and the fp16
    reader would then get the wrong type. Returns how many were copied."""
    graph = model.graph
    kept = lambda node: node.name in keep_nodes or node.op_type in keep_ops  # noqa: E731
    readers: dict[str, set[bool]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(kept(node))
    shared = {init.name: init for init in graph.initializer if readers.get(init.name) == {True, False}}
    for name, init in shared.items():
        copy = onnx.TensorProto()
        copy.CopyFrom(init)
        copy.name = f"{name}__fp32"
        graph.initializer.append(copy)
    for node in graph.node:
        if kept(node):
            node.input[:] = [f"{i}__fp32" if i in shared else i for i in node.input]
    return len(shared)


def _fp16_bytes(chunk: bytes) -> bytes:
    """fp32 bytes to fp16 bytes as the converter converts an in-memory initializer (its default
    clamps), so a weight converted file to file is bit-identical to one converted in memory."""
    from onnxconverter_common.float16 import convert_np_to_float16

    return convert_np_to_float16(np.frombuffer(chunk, dtype=np.float32), 1e-7, 1e4).tobytes()


def convert_to_fp16(src: Path, dst: Path, keep_ops: list[str] = (), keep_nodes: list[str] = ()) -> dict:
    """`keep_ops` (op types) and `keep_nodes` (node names, export/fp16_guard.py's choice) stay fp32,
    beside the converter's own default block list."""
    from onnxconverter_common.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    from .onnx_io import check, external_files, load_structure, save

    external = bool(external_files(src))
    # The weights stay on disk: the converter's own shape inference (its default) serializes and
    # parses the whole model, up to four copies of the weights at once; on the weightless graph it
    # gives the same types and shapes. An external weight the converter retypes keeps its fp32 bytes
    # until `save` converts them file to file, as the converter would have in memory.
    model = load_structure(src)
    # Stale fp32 value_info would contradict the converted types; ORT re-infers shapes anyway.
    del model.graph.value_info[:]
    rerouted = _route_outputs_through_identity(model)
    block = sorted(set(DEFAULT_OP_BLOCK_LIST) | set(keep_ops))
    copied = _unshare_initializers(model, set(keep_nodes), set(block)) if keep_nodes or keep_ops else 0
    if external:
        model = onnx.shape_inference.infer_shapes(model)  # initializers' dims and types, no data
    on_disk_fp32 = {t.name for t in model.graph.initializer
                    if t.data_location == TensorProto.EXTERNAL and t.data_type == TensorProto.FLOAT}
    converted = convert_float_to_float16(model, keep_io_types=True, op_block_list=block,
                                         node_block_list=list(keep_nodes), disable_shape_infer=external)
    casts = _retarget_float_casts(converted)
    del model
    retyped = {t.name: _fp16_bytes for t in converted.graph.initializer
               if t.name in on_disk_fp32 and t.data_type == TensorProto.FLOAT16}
    save(converted, dst, external_data=external, source=Path(src).parent, convert=retyped)
    check(dst)
    return {
        "converter": "onnxconverter_common.float16.convert_float_to_float16",
        "keep_io_types": True,
        "kept_fp32_ops": sorted(keep_ops),
        "kept_fp32_nodes": len(keep_nodes),
        "initializers_copied_for_fp32_nodes": copied,
        "converter_default_block_list_applied": True,
        "outputs_routed_through_identity": len(rerouted),
        "casts_retargeted_to_fp16": casts,
    }
