"""The export's sidecar (`manifest.json`), as the pipeline writes it: every section but the
verification, which `verify.py` computes. `backends/manifest.py` reads it."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path

import onnx

from backends.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    generation_section,
    generation_source_file,
    sha256_file,
)

from . import graphs, verify
from .onnx_io import (
    external_locations,
    gathered_tables,
    initializer_bytes,
    load_structure,
    replaced_fp16_bytes,
    widened_fp16_bytes,
)

FIRST_STEP = "empty past: the decoder graph's first call takes past.* with past_len = 0"


def versions() -> dict[str, str]:
    import onnxconverter_common
    import onnxruntime
    import onnxscript
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnxconverter-common": onnxconverter_common.__version__,
        "onnxscript": onnxscript.__version__,
    }


def _no_dropout(path: Path, model: onnx.ModelProto) -> None:
    if "Dropout" in {n.op_type for n in model.graph.node}:
        raise RuntimeError(f"{path.name} contains Dropout nodes: the model was not exported in eval mode")


def _graph_entry(spec: graphs.GraphSpec, precision: str, file: str | None = None) -> dict:
    entry = spec.describe()
    entry["precision"] = precision
    if file:
        entry["file"] = file
    return entry


SINGLE_STEP_LEFT_OUT = "left out at export (--no-single-step)"


def graph_entries(specs: dict[str, graphs.GraphSpec], folder: Path, left_out: dict[str, str] | None = None) -> dict:
    """The sidecar's "graphs" section, each file checked for Dropout nodes (a model not in eval mode);
    `left_out`: {graph: why} for graphs not exported."""
    entries = {
        "full": _graph_entry(specs["full"], "fp32"),
        "encoder": _graph_entry(specs["encoder"], "fp32"),
        "decoder": _graph_entry(specs["decoder"], "fp32"),
        "encoder_fp16": _graph_entry(specs["encoder"], "fp16", "encoder_fp16.onnx"),
        "decoder_fp16": _graph_entry(specs["decoder"], "fp16", "decoder_fp16.onnx"),
        "encoder_int8": _graph_entry(specs["encoder"], "int8", "encoder_int8.onnx"),
        "decoder_int8": _graph_entry(specs["decoder"], "int8", "decoder_int8.onnx"),
    }
    entries = {name: entry for name, entry in entries.items() if name not in (left_out or {})}
    for entry in entries.values():
        model = load_structure(folder / entry["file"])
        _no_dropout(folder / entry["file"], model)
        data = external_locations(model)
        if data:
            entry["external_data"] = data
        # What a runtime holds beyond the files: fp16 weights widened for fp32 kernels, for one.
        entry["initializer_bytes"] = initializer_bytes(model)
        entry["fp16_bytes_widened_on_cpu"] = widened_fp16_bytes(model)
        entry["fp16_bytes_replaced_on_cpu"] = replaced_fp16_bytes(model)
        entry["gathered_tables"] = gathered_tables(model, folder)  # held once per backend
        # the batch dimension each input has in the file (a rewrite may batch some by sentence)
        dims = {i.name: i.type.tensor_type.shape.dim for i in model.graph.input}
        for spec in entry["inputs"]:
            if spec["name"] in dims and dims[spec["name"]] and dims[spec["name"]][0].dim_param:
                spec["shape"][0] = dims[spec["name"]][0].dim_param
    return entries


def model_facts(model, family) -> dict:
    return {
        "architecture": family.architecture,
        **family.layout.shape(model.config),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def generation(model, family, source: dict, languages: dict | None) -> dict:
    """The sidecar's "generation" section: the model's generation config as the decoding defaults.

    With language codes, the target language's code is the forced first token (as the tokenizer's
    translation pipeline passes `forced_bos_token_id` to generate()), whatever the config says."""
    c = model.config
    shape = family.layout.shape(c)
    # The file it came from: its checksum tells export.ensure when the config changed.
    file = generation_source_file(Path(source["path"])) if source.get("path") else None
    special = {"pad": c.pad_token_id, "eos": c.eos_token_id, "decoder_start": c.decoder_start_token_id}
    config = model.generation_config.to_dict()
    note = None
    if languages is not None and not languages.get("target_token"):  # a token before the source forces nothing
        forced = languages["codes"][languages["tgt_lang"]]
        if config.get("forced_bos_token_id") not in (None, forced):
            note = (f"the model's generation config forces id {config['forced_bos_token_id']} first; the target "
                    f"language {languages['tgt_lang']} (id {forced}) is forced instead")
        config["forced_bos_token_id"] = forced
    section = generation_section(
        config, special=special, limit=shape["max_position_embeddings"] - 1, vocab_size=shape["vocab_size"],
        source_file=file,
    )
    if note:
        section["notes"].append(note)
    return section


def save_tokenizer(tokenizer, source: dict, family, folder: Path) -> dict:
    """Write the tokenizer's files next to the graphs; return the sidecar's "tokenizer" section:
    its class and the files written."""
    before = {f.name for f in folder.iterdir()}
    tokenizer.save_pretrained(folder)
    for extra in family.unsaved_tokenizer_files:
        (folder / extra).unlink(missing_ok=True)
    written = sorted(f.name for f in folder.iterdir() if f.is_file() and f.name not in before)
    return {"class": source["tokenizer_class"], "files": written}


def manifest(config, facts: dict, tokenizer, source: dict, family, languages: dict | None, generation: dict, *,
             opset: int, graph_section: dict, tokenizer_record: dict, rewrites: dict, fp16: dict, int8: dict,
             left_out: dict[str, str] | None = None) -> dict:
    """Every section of the sidecar; "verification", the timings and "files" are filled in later.
    `facts`: `model_facts` of the model, taken while it was loaded."""
    limit = family.layout.shape(config)["max_position_embeddings"]
    default_bad = [[config.pad_token_id]] if family.bans_pad else []
    bad_words = [list(ids) for ids in (getattr(config, "bad_words_ids", None) or default_bad)]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "source_model": source,
        "family": {"name": family.name, "architecture": family.architecture, "pre_norm": family.pre_norm,
                   "positions": family.positions, "embedding_norm": family.embedding_norm,
                   "final_norm": family.final_norm, "logits_bias": family.logits_bias},
        "tokenizer": tokenizer_record,
        # src_lang: the tokenizer's source code; tgt_lang: forced first (generation.forced_bos_token_id).
        "languages": languages,
        "model": facts,
        "special_tokens": {
            "pad": config.pad_token_id,
            "eos": config.eos_token_id,
            "unk": tokenizer.unk_token_id,
            "decoder_start": config.decoder_start_token_id,
            "bad_words_ids": bad_words,
        },
        "limits": {
            "max_source_tokens": limit,  # eos included; sinusoidal positions stop here
            # The decoder start takes position 0, so at most limit - 1 tokens follow it.
            "max_new_tokens": limit - 1,
        },
        # The model's generation config: every backend's decoding defaults (backends/manifest.py).
        "generation": generation,
        "opset": opset,
        "exporter": "torch.onnx.export(dynamo=True, optimize=True): constant folding on; model in eval mode, no grad",
        "first_step": FIRST_STEP,
        "graphs": graph_section,
        # Graphs not exported, with why: the backends that need them are refused by name.
        "graphs_left_out": dict(left_out or {}),
        # Tied output layer stored once, pre-transposed; attention cores fused: see export/rewrite.py
        # and export/attention.py.
        "rewrites": rewrites,
        "fp16": {
            **fp16["decoder"],
            "why_fp32_io": "cache and logits cross the session boundary in fp32 so every backend "
            "feeds the shared loop the same dtype; fp16 arithmetic stays inside the graphs",
            "encoder": fp16["encoder"],
        },
        "int8": int8,
        "versions": versions(),
        "verification": None,
        "export_seconds": None,
        # Each step's own peak RSS (VmHWM, reset at the step's start) and the RSS it started with.
        "export_peak_rss_mb": None,
        "export_start_rss_mb": None,
        "files": {},
    }


def write(folder: Path, data: dict, family) -> None:
    """Checksum every file of `folder` into `data["files"]`, check the tokenizer's are there, write the sidecar."""
    data["files"] = {
        f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size}
        for f in sorted(folder.iterdir())
        if f.is_file() and f.name != MANIFEST_NAME
    }
    missing = [f for f in data["tokenizer"]["files"] if f not in data["files"]]
    missing += [f for f in family.export_tokenizer_files if f not in data["files"]]
    if missing:
        raise RuntimeError(f"tokenizer files not written: {', '.join(missing)}")
    (folder / MANIFEST_NAME).write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")


def summarize(result: dict) -> str:
    spread = result.get("pytorch_spread")
    spread = "" if spread is None else f"; PyTorch's own spread {spread:.3g}"
    lines = [f"verification: fp32 {'PASSED' if result['fp32_passed'] else 'FAILED'} "
             f"(tolerance {result['fp32_tolerance']:.3g}{spread})"]
    lines += [f"  FAILED: {f}" for f in result["failures"]]
    for case in result["logits"]:
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in case["max_abs_logit_diff"].items())
        lines.append(f"  max |Δlogit| on {case['case']}: {diffs}")
    for label, g in (("greedy", result["greedy"]), (verify.decoding_label(result.get("model_decoding")), result.get("model_decoding"))):
        for name, r in (g or {"backends": {}})["backends"].items():
            lines.append(
                f"  {label} {name}: identical ids {r['identical_ids']}/{g['sentences']}, "
                f"identical text {r['identical_text']}/{g['sentences']}, token agreement {r['token_agreement']:.1%}"
            )
    if result.get("peak_rss_mb"):
        phases = ", ".join(f"{name} {mb / 1e3:.2f}" for name, mb in result["peak_rss_mb"].items())
        lines.append(f"  peak RSS by phase, GB: {phases}")
    return "\n".join(lines)
