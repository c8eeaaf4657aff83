"""fp32 -> int8 KV-cache graphs with ONNX Runtime's dynamic quantization.

Weights of every MatMul are stored as int8 (per output channel), activations are quantized per
call; the result keeps fp32 inputs and outputs, so it plugs into the same KV-cache backend. The
quality cost is measured, not assumed: verification reports its |Δlogit| and token agreement.
"""

from __future__ import annotations

from pathlib import Path

# MatMul only: embeddings (Gather) stay fp32 so the tied output layer and the token embedding are
# not quantized twice with different scales; the output layer MatMul itself is quantized.
OPS_TO_QUANTIZE = ["MatMul"]


def quantize_int8(src: Path, dst: Path) -> dict:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        model_input=str(src),
        model_output=str(dst),
        op_types_to_quantize=OPS_TO_QUANTIZE,
        per_channel=True,
        reduce_range=False,
        weight_type=QuantType.QInt8,
        extra_options={"MatMulConstBOnly": True},  # activations x activations (attention) stay fp32
    )
    return {
        "quantizer": "onnxruntime.quantization.quantize_dynamic",
        "weight_type": "int8, per output channel",
        "activations": "uint8, quantized dynamically per call",
        "ops_quantized": OPS_TO_QUANTIZE,
        "kept_fp32": "attention score/value MatMuls (both inputs are activations), embeddings, LayerNorm, Softmax",
    }
