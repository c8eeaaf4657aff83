"""fp32 -> int8 KV-cache graphs with ONNX Runtime's dynamic quantization.

Weights of every MatMul are stored as int8 (per output channel), activations are quantized per
call; the result keeps fp32 inputs and outputs, so it plugs into the same KV-cache backend. The
quality cost is measured, not assumed: verification reports its |Δlogit| and token agreement.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from . import rewrite

# ORT quantizes the MatMuls (the tied output layer too, once export/rewrite.py made its weight an
# initializer); its Gather quantization is per tensor and would re-quantize the shared table, so
# embeddings are switched to the MatMul's per-channel int8 numbers by rewrite.quantize_gathers.
OPS_TO_QUANTIZE = ["MatMul"]


def quantize_int8(src: Path, dst: Path) -> dict:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from .onnx_io import check, external_files, save

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
        extra_options={"MatMulConstBOnly": True},  # activations x activations (attention) stay fp32
        use_external_data_format=external,
    )
    model = onnx.load(str(dst))
    # The quantizer's nodes get the metadata of the MatMuls they replace (service/locate.py reads it).
    rewrite.copy_scope_metadata(onnx.load(str(src), load_external_data=False), model)
    gathers = rewrite.quantize_gathers(model)
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
    }
