"""Someone else's ONNX export, found and described: a Hugging Face Optimum-layout folder.

    encoder_model.onnx            input_ids, attention_mask (b, s) -> last_hidden_state (b, s, d_model)
    decoder_model_merged.onnx     one graph, an If on `use_cache_branch` (Optimum's default output), or
    decoder_model.onnx            the first step: input_ids (b, t), encoder_hidden_states,
                                  encoder_attention_mask -> logits, present.{i}.decoder.key/value and
                                  present.{i}.encoder.key/value (cross-attention, made here once)
    decoder_with_past_model.onnx  later steps: the newest token, past_key_values.{i}.decoder.* (b, h, p, d)
                                  and past_key_values.{i}.encoder.* (b, h, s, d) -> logits, present.{i}.decoder.*

(`optimum-cli export onnx --task text2text-generation-with-past` writes all four; the merged graph is
used when present.) Variants with a suffix (`encoder_model_quantized.onnx`, `*_fp16.onnx`) are picked
by naming the encoder file instead of the folder. Graphs may keep their weights in external data
files. `describe_graph` reads a graph's provenance without its weights; `files_read` lists every
file the backend reads. Imports numpy and onnx (graph metadata only), never torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .manifest import Manifest, sha256_file

LAYOUT = "Hugging Face Optimum (text2text-generation-with-past)"
ENCODER, MERGED = "encoder_model", "decoder_model_merged"
DECODER, WITH_PAST = "decoder_model", "decoder_with_past_model"
# Ops only a quantized graph holds: their presence makes `describe_graph` call a graph int8.
_QUANTIZED_OPS = {
    "MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul", "QuantizeLinear", "DequantizeLinear",
    "DynamicQuantizeMatMul", "MatMulNBits", "QAttention", "QGemm", "ConvInteger", "QLinearConv",
}


class ExternalExportError(ValueError):
    """The folder is not a runnable export of the reference model; the message names what differs."""


def parse_external(values: list[str]) -> dict[str, str]:
    """Command-line `--external NAME=DIR` values (app.py, bench.parity) as {NAME: DIR}; ValueError
    naming a malformed or repeated one."""
    external: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--external: expected NAME=DIR, got {value!r}")
        if name.strip() in external:
            raise ValueError(f"--external: the name {name.strip()!r} is given twice")
        external[name.strip()] = path.strip()
    return external


# --- the folder --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Which graph files of a folder are run."""

    folder: Path  # the graphs' folder
    meta: Path  # config.json and the tokenizer files: the graphs' folder, or its parent (an onnx/ subfolder)
    encoder: Path
    merged: Path | None  # decoder_model_merged{suffix}.onnx, used when present
    decoder: Path | None  # decoder_model{suffix}.onnx (first step) when not merged
    with_past: Path | None  # decoder_with_past_model{suffix}.onnx when not merged

    @property
    def graphs(self) -> list[Path]:
        return [p for p in (self.encoder, self.merged, self.decoder, self.with_past) if p is not None]

    @property
    def kind(self) -> str:
        return "merged decoder" if self.merged else "decoder + decoder with past"


def find_layout(path: str | Path) -> Layout:
    """`path`: an Optimum export folder (or its onnx/ subfolder), or one variant's encoder file
    (`DIR/encoder_model_quantized.onnx` runs the `_quantized` graphs). Raises ExternalExportError."""
    path = Path(path)
    if path.is_file():
        m = re.fullmatch(rf"{ENCODER}(.*)\.onnx", path.name)
        if not m:
            raise ExternalExportError(f"{path}: expected a folder or an {ENCODER}*.onnx file")
        folder, suffixes = path.parent, [m[1]]
    elif path.is_dir():
        folder = path
        if not list(folder.glob(f"{ENCODER}*.onnx")) and (folder / "onnx").is_dir():
            folder = folder / "onnx"  # transformers.js-style: config and tokenizer above, graphs in onnx/
        suffixes = sorted(p.name[len(ENCODER) : -len(".onnx")] for p in folder.glob(f"{ENCODER}*.onnx"))
    else:
        raise ExternalExportError(f"{path}: no such folder or file")
    if not suffixes:
        raise ExternalExportError(
            f"{path}: no {ENCODER}.onnx: not an Optimum-layout export (expected {ENCODER}.onnx with "
            f"{MERGED}.onnx, or with {DECODER}.onnx and {WITH_PAST}.onnx, as `optimum-cli export onnx "
            "--task text2text-generation-with-past` writes)"
        )
    if len(suffixes) > 1:
        variants = ", ".join(f"{ENCODER}{s}.onnx" for s in suffixes)
        raise ExternalExportError(
            f"{path} holds several variants ({variants}); name the one to run by its encoder file, "
            f"e.g. {folder / (ENCODER + suffixes[-1] + '.onnx')}"
        )
    suffix = suffixes[0]

    def graph(stem: str) -> Path | None:
        p = folder / f"{stem}{suffix}.onnx"
        return p if p.is_file() else None

    merged, decoder, with_past = graph(MERGED), graph(DECODER), graph(WITH_PAST)
    if merged is None and (decoder is None or with_past is None):
        present = ", ".join(sorted(p.name for p in folder.glob("*.onnx"))) or "no .onnx files"
        raise ExternalExportError(
            f"{folder}: {ENCODER}{suffix}.onnx needs {MERGED}{suffix}.onnx, or both {DECODER}{suffix}.onnx "
            f"and {WITH_PAST}{suffix}.onnx (a decoder with a KV cache: --task text2text-generation-with-past); "
            f"found: {present}"
        )
    above = not (folder / "config.json").is_file() and (folder.parent / "config.json").is_file()
    meta = folder.parent if above else folder
    return Layout(folder, meta, folder / f"{ENCODER}{suffix}.onnx", merged,
                  None if merged else decoder, None if merged else with_past)


# --- provenance: what the graphs are, read without their weights -------------------------------------


def _graph_tensors(graph) -> list:
    """Every initializer of a graph and of its subgraphs (a merged decoder's If branches)."""
    from onnx import AttributeProto

    tensors = list(graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                tensors += _graph_tensors(attr.g)
            elif attr.type == AttributeProto.GRAPHS:
                for g in attr.graphs:
                    tensors += _graph_tensors(g)
    return tensors


def _op_types(graph) -> set[str]:
    from onnx import AttributeProto

    ops = set()
    for node in graph.node:
        ops.add(node.op_type)
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)
            for g in subgraphs:
                ops |= _op_types(g)
    return ops


def _shape(value_info) -> list[int | str]:
    dims = value_info.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]


def _locations(tensors) -> list[str]:
    """The external data files the tensors' weights are in, relative to the graph's folder."""
    import onnx

    return sorted({
        entry.value
        for t in tensors
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    })


def files_read(layout: Layout, manifest: Manifest) -> list[Path]:
    """Every file `load` reads from the folder: config.json, the tokenizer files the reference's
    sidecar lists (compared with its own), each graph and its external data. What a copy of the
    export elsewhere (bench/engine/model_files.py) must hold."""
    import onnx

    files = [layout.meta / "config.json", *(layout.meta / f for f in manifest.tokenizer_files)]
    for graph in layout.graphs:
        tensors = _graph_tensors(onnx.load(str(graph), load_external_data=False).graph)
        files += [graph, *(graph.parent / f for f in _locations(tensors))]
    return list(dict.fromkeys(files))


def describe_graph(path: Path) -> dict[str, Any]:
    """A graph file's provenance and the facts `check` needs: {file, bytes, sha256, opset, producer,
    ir_version, external_data: [{file, bytes, sha256}], precision, logits_shape}. Reads the graph
    without its external data (the weights stay on disk)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    tensors = _graph_tensors(model.graph)
    locations = _locations(tensors)
    elements = {onnx.TensorProto.FLOAT: 0, onnx.TensorProto.FLOAT16: 0}
    for t in tensors:
        if t.data_type in elements:
            elements[t.data_type] += int(np.prod(t.dims)) if len(t.dims) else 1
    if _op_types(model.graph) & _QUANTIZED_OPS:
        precision = "int8"
    elif elements[onnx.TensorProto.FLOAT16] > elements[onnx.TensorProto.FLOAT]:
        precision = "fp16"
    else:
        precision = "fp32"
    outputs = {o.name: o for o in model.graph.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    data = []
    for location in locations:
        file = path.parent / location
        data.append({"file": location, "bytes": file.stat().st_size if file.is_file() else None,
                     "sha256": sha256_file(file) if file.is_file() else None})
    return {
        "file": path.name,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
        "opset": opset,
        "producer": f"{model.producer_name} {model.producer_version}".strip() or None,
        "ir_version": model.ir_version,
        "external_data": data,
        "precision": precision,
        "logits_shape": _shape(outputs["logits"]) if "logits" in outputs else None,
    }
