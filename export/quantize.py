"""fp32 -> int8 KV-cache graphs with ONNX Runtime's dynamic quantization.

Weights of every MatMul are stored as int8 (per output channel), activations are quantized per
call; the result keeps fp32 inputs and outputs, so it plugs into the same KV-cache backend. The
quality cost is measured, not assumed: verification reports its |Δlogit| and token agreement.

`keep` names weight-reading nodes (MatMuls, embedding Gathers) that stay in fp32: the ones
`int8_sensitivity.py` measured as costing the most agreement. `quantizable` lists the candidates.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import onnx

from . import rewrite

# ORT quantizes the MatMuls (the tied output layer too, once export/rewrite.py made its weight an
# initializer); its Gather quantization is per tensor and would re-quantize the shared table, so
# embeddings are switched to the MatMul's per-channel int8 numbers by rewrite.quantize_gathers.
OPS_TO_QUANTIZE = ["MatMul"]


@dataclass(frozen=True)
class Item:
    """One node whose weight int8 would store: a MatMul with a constant weight or an embedding Gather."""

    graph: str  # "encoder" or "decoder"
    node: str  # the node's name in the fp32 graph
    op: str  # "MatMul" or "Gather"
    module: str  # the model module it computes ("layers.0.fc1", "lm_head", ...)
    weight: str
    parameters: int

    @property
    def key(self) -> str:
        return f"{self.graph}:{self.node}"


def _module(node: onnx.NodeProto, order: dict[str, int]) -> str:
    """The module path the exporter recorded for `node`; a fused attention projection (whose
    metadata names the softmax it feeds) is labelled by its position among the graph's fused ones."""
    props = {p.key: p.value for p in node.metadata_props}
    scopes = props.get("pkg.torch.onnx.name_scopes", "")
    parts = [s.strip(" '") for s in scopes.strip("[]").split(",") if s.strip(" '")]
    if node.op_type == "MatMul" and node.name.endswith("MultiHeadAttention.qkv.MatMul"):
        return f"self-attention qkv #{order[node.name]}"
    return parts[0] if parts else node.name


def quantizable(graph: str, model: onnx.ModelProto) -> list[Item]:
    """Every node of `model` (graph `graph`) whose weight int8 quantizes, in graph order."""
    inits = {i.name: i for i in model.graph.initializer}
    fused = [n.name for n in model.graph.node if n.name.endswith("MultiHeadAttention.qkv.MatMul")]
    order = {name: i for i, name in enumerate(fused)}
    items = []
    for node in model.graph.node:
        index = {"MatMul": 1, "Gather": 0}.get(node.op_type)
        if index is None or node.input[index] not in inits or len(inits[node.input[index]].dims) != 2:
            continue
        dims = inits[node.input[index]].dims
        items.append(Item(graph, node.name, node.op_type, _module(node, order), node.input[index],
                          int(dims[0]) * int(dims[1])))
    return items


def _quantize_dynamic(src: Path, keep_matmuls: Collection[str], structure: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """`quantize_dynamic`'s steps and settings on `src`'s structure, each weight read from its data
    file only when ORT quantizes it. `quantize_dynamic` itself loads the whole graph with its weights
    for shape inference, saves and reloads it (weights again) to infer shapes once more, and keeps
    each weight it reads; here one fp32 weight is in memory at a time, and the weights it leaves
    alone stay on disk until `onnx_io.save` copies them. `structure`: `src` already loaded without
    its weights (left unchanged)."""
    from unittest import mock

    from onnxruntime.quantization import QuantType, base_quantizer, onnx_quantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode, add_infer_metadata, update_opset_version

    from .onnx_io import load_structure, read_array

    folder = src.parent
    original = base_quantizer.tensor_proto_to_array

    def read(tensor: onnx.TensorProto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.data_type in (
                onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            return read_array(tensor, folder)
        return original(tensor)

    def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
        # ORT saves the graph with its weights to a temporary folder and loads it back for this; the
        # structure alone gives the same shapes, and its external weights stay where they are.
        inferred = onnx.shape_inference.infer_shapes(model)
        add_infer_metadata(inferred)
        return inferred

    model = update_opset_version(infer_shapes(structure or load_structure(src)), QuantType.QInt8)
    # ORT reads every weight it quantizes through tensor_proto_to_array, and infers shapes once more
    # when it makes the quantizer.
    patches = (mock.patch.object(base_quantizer, "tensor_proto_to_array", read),
               mock.patch.object(onnx_quantizer, "tensor_proto_to_array", read),
               mock.patch.object(onnx_quantizer, "save_and_reload_model_with_shape_infer", infer_shapes))
    with patches[0], patches[1], patches[2]:
        quantizer = onnx_quantizer.ONNXQuantizer(
            model,
            True,  # per channel
            # Weights in -64..63: ONNX Runtime's u8 x s8 kernels on x86 CPUs without VNNI add pairs of
            # products in int16, which full-range weights overflow (silently wrong layers, not NaN).
            True,  # reduce_range
            QuantizationMode.IntegerOps,
            False,  # static
            QuantType.QInt8,
            QuantType.QUInt8,  # dynamic activations are uint8
            None,
            [],
            list(keep_matmuls),
            OPS_TO_QUANTIZE,
            {"MatMulConstBOnly": True},  # activations x activations (attention) stay fp32
        )
        quantizer.quantize_model()
    quantizer.model.topological_sort()  # as ORT orders the nodes when it saves
    return quantizer.model.model


def quantize_int8(src: Path, dst: Path, keep: Collection[str] = (), rescore: int = 0) -> dict:
    """`keep`: names of `src`'s MatMul and Gather nodes left in fp32 (an unknown name raises).
    `rescore`: K > 0 recomputes the int8 output layer's K best logits in fp32 (export/int8_rescore.py);
    only for a graph with a `logits` output. Weights are read one at a time from `src`'s files, and
    those left in fp32 are copied file to file: the graph's weights are never in memory whole."""
    from .onnx_io import check, external_files, load_structure, save, scratch_name

    src, dst = Path(src), Path(dst)
    source = load_structure(src)
    names = {n.name for n in source.graph.node}
    unknown = sorted(set(keep) - names)
    if unknown:
        raise ValueError(f"{src.name} has no node(s) {', '.join(unknown)} to keep in fp32")
    ops = {n.name: n.op_type for n in source.graph.node}
    external = bool(external_files(src))
    model = _quantize_dynamic(src, [k for k in keep if ops[k] == "MatMul"], source)
    # The quantizer's nodes get the metadata of the MatMuls they replace (service/locate.py reads it).
    rewrite.copy_scope_metadata(source, model)
    gathers = rewrite.quantize_gathers(model, keep={k for k in keep if ops[k] == "Gather"}, folder=src.parent)
    rescored = None
    if rescore:
        from .int8_rescore import rescore_top

        rescored = rescore_top(model, source, rescore, folder=src.parent)
    try:
        save(model, dst, external_data=external, source=src.parent)
    finally:
        if rescored and rescored.get("rescored"):
            (src.parent / scratch_name(rescored["table"])).unlink(missing_ok=True)
    check(dst)
    return {
        "quantizer": "onnxruntime.quantization: quantize_dynamic's quantizer and settings, one weight read at a time",
        "weight_type": "int8 in a 7-bit range (-64..63), per output channel",
        "activations": "uint8, quantized dynamically per call",
        "ops_quantized": OPS_TO_QUANTIZE,
        "embeddings": "int8, one scale per token; tied with the output layer's int8 weight where it has one",
        "gathers": gathers["gathers"],
        "kept_fp32": "attention (MultiHeadAttention: its products are of two activations), LayerNorm",
        **({"output_layer_rescored": rescored} if rescored else {}),
    }
