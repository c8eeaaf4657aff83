"""torch -> ONNX for the three fp32 graphs, with the dynamo exporter (torch >= 2.9's default).

Each graph's inputs, outputs and dynamic axes are described once here (`GraphSpec`) and both the
exporter and the sidecar read that description.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from families import shape_of
from .wrappers import FullSeq2Seq

DEFAULT_OPSET = 18  # the dynamo exporter's native opset; LayerNormalization is one op from 17


@dataclass(frozen=True)
class GraphSpec:
    name: str
    file: str
    inputs: list[tuple[str, str, list]]  # (name, dtype, shape with axis names for dynamic axes)
    outputs: list[tuple[str, str, list]]

    def describe(self) -> dict:
        def io(items):
            return [{"name": n, "dtype": d, "shape": s} for n, d, s in items]

        return {"file": self.file, "inputs": io(self.inputs), "outputs": io(self.outputs)}


def _kv_names(prefix: str, layers: int) -> list[str]:
    return [f"{prefix}.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def graph_specs(config) -> dict[str, GraphSpec]:
    shape = shape_of(config)
    layers, heads = shape["decoder_layers"], shape["decoder_attention_heads"]
    head_dim, vocab = shape["head_dim"], shape["vocab_size"]
    cross = [(n, "float32", ["batch", heads, "src_len", head_dim]) for n in _kv_names("cross", layers)]
    past = [(n, "float32", ["batch", heads, "past_len", head_dim]) for n in _kv_names("past", layers)]
    present = [(n, "float32", ["batch", heads, "past_len + 1", head_dim]) for n in _kv_names("present", layers)]
    src = [("input_ids", "int64", ["batch", "src_len"]), ("attention_mask", "int64", ["batch", "src_len"])]
    return {
        "full": GraphSpec(
            "full",
            "full.onnx",
            [*src, ("decoder_input_ids", "int64", ["batch", "tgt_len"])],
            [("logits", "float32", ["batch", "tgt_len", vocab])],
        ),
        "encoder": GraphSpec(
            "encoder",
            "encoder.onnx",
            src,
            [("encoder_hidden_states", "float32", ["batch", "src_len", shape["d_model"]]), *cross],
        ),
        "decoder": GraphSpec(
            "decoder",
            "decoder.onnx",
            [("input_ids", "int64", ["batch", 1]), ("encoder_attention_mask", "int64", ["batch", "src_len"]), *cross, *past],
            [("logits", "float32", ["batch", 1, vocab]), *present],
        ),
    }


def _example_inputs(config, batch: int, src_len: int, tgt_len: int, past_len: int):
    shape = shape_of(config)
    layers, heads, head_dim = shape["decoder_layers"], shape["decoder_attention_heads"], shape["head_dim"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, min(shape["vocab_size"] - 1, 1000), (batch, src_len), generator=gen)
    mask = torch.ones(batch, src_len, dtype=torch.long)
    if batch > 1:
        mask[-1, src_len // 2 :] = 0  # a padded row, so the mask path is traced
    dec = torch.full((batch, tgt_len), config.decoder_start_token_id, dtype=torch.long)
    cross = [torch.randn(batch, heads, src_len, head_dim, generator=gen) for _ in range(2 * layers)]
    past = [torch.randn(batch, heads, past_len, head_dim, generator=gen) for _ in range(2 * layers)]
    return ids, mask, dec, cross, past


def _modules_and_args(model, family, spec_name: str, config, batch=2, src_len=7, tgt_len=3, past_len=3):
    ids, mask, dec, cross, past = _example_inputs(config, batch, src_len, tgt_len, past_len)
    if spec_name == "full":  # HF's own forward: any family
        return FullSeq2Seq(model), (ids, mask, dec)
    wrappers = family.layout.wrapper_module()  # the KV-cache pair, as the family's layout writes it
    if spec_name == "encoder":
        return wrappers.EncoderWithCrossKV(model, family), (ids, mask)
    if spec_name == "decoder":
        return wrappers.DecoderStepWithCache(model, family), (dec[:, :1], mask, *cross, *past)
    raise ValueError(spec_name)


def _dynamic_shapes(spec: GraphSpec, max_positions: int):
    dims = {
        "batch": torch.export.Dim("batch", min=1, max=4096),
        "src_len": torch.export.Dim("src_len", min=1, max=max_positions),
        "tgt_len": torch.export.Dim("tgt_len", min=1, max=max_positions),
        # An empty past is the first step, so 0 must be a valid length.
        "past_len": torch.export.Dim("past_len", min=0, max=max_positions - 1),
    }

    def axes(shape):
        return {i: dims[a] for i, a in enumerate(shape) if isinstance(a, str) and a in dims}

    inputs = [axes(shape) for _, _, shape in spec.inputs]
    if spec.name == "decoder":
        # DecoderStepWithCache.forward(input_ids, encoder_attention_mask, *cache)
        return {"input_ids": inputs[0], "encoder_attention_mask": inputs[1], "cache": tuple(inputs[2:])}
    if spec.name == "full":
        return {"input_ids": inputs[0], "attention_mask": inputs[1], "decoder_input_ids": inputs[2]}
    return {"input_ids": inputs[0], "attention_mask": inputs[1]}


class ExportError(RuntimeError):
    pass


def _versions() -> str:
    import onnx
    import onnxscript
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, onnx {onnx.__version__}, onnxscript {onnxscript.__version__}"


def _describe_failure(spec_name: str, error: Exception) -> str:
    text = str(error)
    # The exporter's messages name the aten operator or module; keep the lines that do.
    hints = [line.strip() for line in text.splitlines() if "aten::" in line or "Module" in line or "op" in line.lower()]
    detail = "; ".join(hints[:3]) or text.splitlines()[0] if text else type(error).__name__
    return f"exporting the {spec_name} graph failed: {type(error).__name__}: {detail} ({_versions()})"


def probe(model, family, config, opset: int, names=("full", "encoder", "decoder")) -> dict[str, float]:
    """Trace each wrapper on a tiny input; fail early with the operator and versions in the message."""
    times = {}
    for name in names:
        start = time.perf_counter()
        module, args = _modules_and_args(model, family, name, config, batch=1, src_len=3, tgt_len=2, past_len=1)
        try:
            with torch.no_grad():
                exported = torch.export.export(module.eval(), args, strict=False)
                exported.run_decompositions()
        except Exception as e:
            raise ExportError(_describe_failure(name, e)) from e
        times[name] = time.perf_counter() - start
    return times


# ONNX files are protobufs, which cannot exceed 2 GB: past this many bytes of weights a graph keeps
# them in an external data file next to it (`<graph>.onnx.data`), checksummed in the sidecar.
EXTERNAL_DATA_BYTES = 1_500_000_000


def needs_external_data(model) -> bool:
    """Whether the fp32 graphs of `model` need external data (a margin below 2 GB for the graph itself)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for b in model.buffers())
    return total > EXTERNAL_DATA_BYTES


def export_graph(model, family, config, spec: GraphSpec, out_dir: Path, opset: int, external_data: bool = False) -> Path:
    """Export one fp32 graph into `out_dir/spec.file`; `external_data`: weights in `<file>.data`."""
    from .onnx_io import data_file, external_files, load_structure, save

    module, args = _modules_and_args(model, family, spec.name, config)
    path = out_dir / spec.file
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                module.eval(),
                args,
                str(path),
                dynamo=True,
                input_names=[n for n, _, _ in spec.inputs],
                output_names=[n for n, _, _ in spec.outputs],
                dynamic_shapes=_dynamic_shapes(spec, shape_of(config)["max_position_embeddings"]),
                opset_version=opset,
                optimize=True,  # constant folding and dead-code elimination
                external_data=external_data,
                verbose=False,
            )
    except Exception as e:
        raise ExportError(_describe_failure(spec.name, e)) from e
    # The program's graph stays reachable after the call and its initializers are the model's own
    # tensors (and arrays sharing their memory): let go of them, or the weights outlive the model.
    for value in program.model.graph.initializers.values():
        value.const_value = None
    program.model.graph.initializers.clear()
    del program
    if external_data and external_files(path) != [data_file(path).name]:
        # One data file with our name, whatever the exporter called its own.
        save(load_structure(path), path, external_data=True, source=out_dir)
    return path
