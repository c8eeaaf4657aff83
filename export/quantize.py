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


def quantize_int8(src: Path, dst: Path, keep: Collection[str] = (), rescore: int = 0) -> dict:
    """`keep`: names of `src`'s MatMul and Gather nodes left in fp32 (an unknown name raises).
    `rescore`: K > 0 recomputes the int8 output layer's K best logits in fp32 (export/int8_rescore.py);
    only for a graph with a `logits` output."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from .onnx_io import check, external_files, save

    source = onnx.load(str(src), load_external_data=False)
    names = {n.name for n in source.graph.node}
    unknown = sorted(set(keep) - names)
    if unknown:
        raise ValueError(f"{src.name} has no node(s) {', '.join(unknown)} to keep in fp32")
    ops = {n.name: n.op_type for n in source.graph.node}
    external = bool(external_files(src))
    quantize_dynamic(
        model_input=str(src),
        model_output=str(dst),
        op_types_to_quantize=OPS_TO_QUANTIZE,
        per_channel=True,
        # Weights in -64..63: ONNX Runtime's u8 x s8 kernels on x86 CPUs without VNNI add pairs of
        # products in int16, which full-range weights overflow (silently wrong layers, not NaN).
        reduce_range=True,
        weight_type=QuantType.QInt8,
        nodes_to_exclude=[k for k in keep if ops[k] == "MatMul"],
        extra_options={"MatMulConstBOnly": True},  # activations x activations (attention) stay fp32
        use_external_data_format=external,
    )
    model = onnx.load(str(dst))
    # The quantizer's nodes get the metadata of the MatMuls they replace (service/locate.py reads it).
    rewrite.copy_scope_metadata(source, model)
    gathers = rewrite.quantize_gathers(model, keep={k for k in keep if ops[k] == "Gather"})
    rescored = None
    if rescore:
        from .int8_rescore import rescore_top

        rescored = rescore_top(model, onnx.load(str(src)), rescore)
    save(model, dst, external_data=external)
    check(dst)
    return {
        "quantizer": "onnxruntime.quantization.quantize_dynamic",
        "weight_type": "int8 in a 7-bit range (-64..63), per output channel",
        "activations": "uint8, quantized dynamically per call",
        "ops_quantized": OPS_TO_QUANTIZE,
        "embeddings": "int8, one scale per token; tied with the output layer's int8 weight where it has one",
        "gathers": gathers["gathers"],
        "kept_fp32": "attention (MultiHeadAttention: its products are of two activations), LayerNorm",
        **({"output_layer_rescored": rescored} if rescored else {}),
    }
