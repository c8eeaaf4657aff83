"""The export, step by step: load, probe, three fp32 graphs, fp16, verify, sidecar, rename.

Everything is written into a temporary sibling folder and renamed into place only after the
sidecar is written, so a half-written export is never mistaken for a finished one.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import onnx

from backends.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    TOKENIZER_FILES,
    generation_section,
    generation_source_file,
    sha256_file,
)

from runtime.memory import reset_peak_rss

from . import fp16, graphs, quantize, rewrite, verify
from .onnx_io import external_files
from .source import load_source

FIRST_STEP = "empty past: the decoder graph's first call takes past.* with past_len = 0"


@dataclass(frozen=True)
class ExportOptions:
    out: Path
    force: bool = False
    opset: int = graphs.DEFAULT_OPSET
    verify: bool = True
    sentences: Path | None = None  # verification sentences (TSV or text); None: data/dev.tsv
    # Verification cost stays small on purpose: 16 sentences x 48 tokens through four backends.
    verify_sentences: int = 16
    verify_max_new_tokens: int = 48
    threads: int | None = None
    # Language codes (families that have them): the tokenizer's source language and the target
    # forced as the first token; None: the family's defaults, English -> Chinese.
    src_lang: str | None = None
    tgt_lang: str | None = None
    # Weights in external data files: None decides by size (graphs.EXTERNAL_DATA_BYTES); True forces it.
    external_data: bool | None = None

    def __post_init__(self):
        if self.opset < 17:
            raise ValueError(f"opset must be >= 17 (LayerNormalization is a single op from 17), got {self.opset}")
        if self.verify_sentences < 1 or self.verify_max_new_tokens < 1:
            raise ValueError("verify_sentences and verify_max_new_tokens must be >= 1")


class VerificationFailed(RuntimeError):
    def __init__(self, failures: list[str], kept: Path):
        self.failures, self.kept = failures, kept
        super().__init__("fp32 verification failed:\n  " + "\n  ".join(failures) + f"\nthe rejected export is in {kept}")


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


def _status_mb(field: str) -> float | None:
    """A /proc/self/status figure in MB (VmHWM: peak RSS since start or the last reset; VmRSS: now);
    None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _release_freed_memory() -> None:
    """Hand freed heap back to the system between steps. glibc keeps large freed blocks (a graph's
    weights, once its mmap threshold has grown) in the process, so the next step would start on
    gigabytes it no longer uses; malloc_trim returns them. A no-op where there is no glibc."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Steps:
    """Prints each step with its duration and peak RSS, as the user watches a long export.

    Each step resets the process's peak RSS at its start (/proc/self/clear_refs) and reads it at its
    end, so `peak_rss_mb[title]` is that step's own high-water mark, what it held from earlier steps
    included (`start_rss_mb[title]`: the RSS it started with); None where the kernel refuses the
    reset (the figure would be the whole run's peak). Freed memory is handed back after each step.
    The reset also resets getrusage's ru_maxrss: `/usr/bin/time -v` then reports the last step's peak."""

    def __init__(self, total: int, log=print):
        self.total, self.n, self.log = total, 0, log
        self.durations: dict[str, float] = {}
        self.peak_rss_mb: dict[str, float | None] = {}
        self.start_rss_mb: dict[str, float | None] = {}

    def run(self, title: str, fn, *args, **kwargs):
        self.n += 1
        self.log(f"[{self.n}/{self.total}] {title} ...", flush=True)
        reset = reset_peak_rss()
        self.start_rss_mb[title] = _status_mb("VmRSS")
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds = time.perf_counter() - start
        peak = _status_mb("VmHWM") if reset else None
        _release_freed_memory()
        self.durations[title] = round(seconds, 2)
        self.peak_rss_mb[title] = peak
        began = self.start_rss_mb[title]
        memory = "" if peak is None else f", peak RSS {peak / 1024:.2f} GB (started at {(began or 0) / 1024:.2f} GB)"
        self.log(f"[{self.n}/{self.total}] {title}: done in {seconds:.1f} s{memory}", flush=True)
        return result


def _no_dropout(path: Path) -> None:
    ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
    if "Dropout" in ops:
        raise RuntimeError(f"{path.name} contains Dropout nodes: the model was not exported in eval mode")


def _graph_entry(spec: graphs.GraphSpec, precision: str, file: str | None = None) -> dict:
    entry = spec.describe()
    entry["precision"] = precision
    if file:
        entry["file"] = file
    return entry


def _model_facts(model, family) -> dict:
    c = model.config
    return {
        "architecture": family.architecture,
        "d_model": c.d_model,
        "encoder_layers": c.encoder_layers,
        "decoder_layers": c.decoder_layers,
        "encoder_attention_heads": c.encoder_attention_heads,
        "decoder_attention_heads": c.decoder_attention_heads,
        "head_dim": c.d_model // c.decoder_attention_heads,
        "encoder_ffn_dim": c.encoder_ffn_dim,
        "decoder_ffn_dim": c.decoder_ffn_dim,
        "activation_function": c.activation_function,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _generation(model, source: dict, languages: dict | None) -> dict:
    """The sidecar's "generation" section: the model's generation config as the decoding defaults.

    With language codes, the target language's code is the forced first token (as the tokenizer's
    translation pipeline passes `forced_bos_token_id` to generate()), whatever the config says."""
    c = model.config
    # The file it came from: its checksum tells export.ensure when the config changed.
    file = generation_source_file(Path(source["path"])) if source.get("path") else None
    special = {"pad": c.pad_token_id, "eos": c.eos_token_id, "decoder_start": c.decoder_start_token_id}
    config = model.generation_config.to_dict()
    note = None
    if languages is not None:
        forced = languages["codes"][languages["tgt_lang"]]
        if config.get("forced_bos_token_id") not in (None, forced):
            note = (f"the model's generation config forces id {config['forced_bos_token_id']} first; the target "
                    f"language {languages['tgt_lang']} (id {forced}) is forced instead")
        config["forced_bos_token_id"] = forced
    section = generation_section(
        config, special=special, limit=c.max_position_embeddings - 1, vocab_size=c.vocab_size, source_file=file,
    )
    if note:
        section["notes"].append(note)
    return section


def _tokenizer_record(tokenizer, source: dict, folder: Path, before: set[str]) -> dict:
    """The sidecar's "tokenizer" section: its class and the files `save_pretrained` wrote."""
    written = sorted(f.name for f in folder.iterdir() if f.is_file() and f.name not in before)
    return {"class": source["tokenizer_class"], "files": written}


def export(src: str, options: ExportOptions, log=print) -> Path:
    out = Path(options.out)
    if out.exists() and not options.force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    if options.threads:  # torch's too, as --threads says: tracing and the reference run on it
        import torch

        torch.set_num_threads(options.threads)
    steps = _Steps(9 if options.verify else 8, log)
    model, tokenizer, source, family, languages = steps.run(
        f"load {src}", load_source, src, options.src_lang, options.tgt_lang
    )
    config = model.config
    generation = _generation(model, source, languages)  # refuses unsupported options before any graph is made
    external = graphs.needs_external_data(model) if options.external_data is None else options.external_data
    steps.run("probe: trace each graph on a tiny input", graphs.probe, model, family, config, options.opset)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        specs = graphs.graph_specs(config)
        rewrites = {}

        def full():
            path = graphs.export_graph(model, family, config, specs["full"], tmp, options.opset, external)
            rewrites["full"] = rewrite.rewrite_file(path)

        steps.run("export full (single-step) graph", full)

        def kv_pair():
            graphs.export_graph(model, family, config, specs["encoder"], tmp, options.opset, external)
            path = graphs.export_graph(model, family, config, specs["decoder"], tmp, options.opset, external)
            rewrites["decoder"] = rewrite.rewrite_file(path)

        steps.run("export KV-cache encoder + decoder graphs", kv_pair)

        def to_fp16():
            report = {}
            for name in ("encoder", "decoder"):
                report[name] = fp16.convert_to_fp16(tmp / f"{name}.onnx", tmp / f"{name}_fp16.onnx")
            return report

        fp16_report = steps.run("convert KV-cache pair to fp16", to_fp16)

        # After fp16, before int8. The fp16 converter re-infers every value's type with ONNX's shape
        # inference, which knows no com.microsoft op: from a fused graph it would keep no types past
        # the first MultiHeadAttention, and service/locate.py maps modules by those types. So fp16 is
        # converted from the exported cores and fused after; int8 is quantized from the fused fp32.
        def fuse():
            heads = {"encoder": config.encoder_attention_heads, "decoder": config.decoder_attention_heads}
            for name in ("encoder", "decoder"):
                fused = {p: rewrite.fuse_attention_file(tmp / f"{name}{p}.onnx", heads[name]) for p in ("", "_fp16")}
                rewrites.setdefault(name, {}).update(fused[""])
                rewrites[f"{name}_fp16"] = fused["_fp16"]

        steps.run("fuse each attention core into one MultiHeadAttention, with its cache and packed q/k/v (fp32, fp16)", fuse)

        def to_int8():
            reports = {name: quantize.quantize_int8(tmp / f"{name}.onnx", tmp / f"{name}_int8.onnx")
                       for name in ("encoder", "decoder")}
            return {**reports["decoder"], "gathers": {name: r["gathers"] for name, r in reports.items()}}

        int8_report = steps.run("quantize KV-cache pair to int8 (dynamic)", to_int8)
        graph_entries = {
            "full": _graph_entry(specs["full"], "fp32"),
            "encoder": _graph_entry(specs["encoder"], "fp32"),
            "decoder": _graph_entry(specs["decoder"], "fp32"),
            "encoder_fp16": _graph_entry(specs["encoder"], "fp16", "encoder_fp16.onnx"),
            "decoder_fp16": _graph_entry(specs["decoder"], "fp16", "decoder_fp16.onnx"),
            "encoder_int8": _graph_entry(specs["encoder"], "int8", "encoder_int8.onnx"),
            "decoder_int8": _graph_entry(specs["decoder"], "int8", "decoder_int8.onnx"),
        }
        for entry in graph_entries.values():
            _no_dropout(tmp / entry["file"])
            data = external_files(tmp / entry["file"])
            if data:
                entry["external_data"] = data
        before = {f.name for f in tmp.iterdir()}
        tokenizer.save_pretrained(tmp)
        if family.name == "marian":
            for extra in ("added_tokens.json", "special_tokens_map.json"):
                (tmp / extra).unlink(missing_ok=True)
        tokenizer_record = _tokenizer_record(tokenizer, source, tmp, before)

        limit = config.max_position_embeddings
        # Marian masks pad at every step (its config's bad_words_ids); the other families' generate()
        # masks nothing unless their config says so.
        default_bad = [[config.pad_token_id]] if family.name == "marian" else []
        bad_words = [list(ids) for ids in (getattr(config, "bad_words_ids", None) or default_bad)]
        manifest = {
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
            "model": _model_facts(model, family),
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
            "opset": options.opset,
            "exporter": "torch.onnx.export(dynamo=True, optimize=True): constant folding on; model in eval mode, no grad",
            "first_step": FIRST_STEP,
            "graphs": graph_entries,
            # Tied output layer stored once, pre-transposed; attention cores fused: see export/rewrite.py.
            "rewrites": rewrites,
            "fp16": {
                **fp16_report["decoder"],
                "why_fp32_io": "cache and logits cross the session boundary in fp32 so every backend "
                "feeds the shared loop the same dtype; fp16 arithmetic stays inside the graphs",
                "encoder": fp16_report["encoder"],
            },
            "int8": int8_report,
            "versions": versions(),
            "verification": None,
            "export_seconds": None,
            # Each step's own peak RSS (VmHWM, reset at the step's start) and the RSS it started with.
            "export_peak_rss_mb": None,
            "export_start_rss_mb": None,
            "files": {},
        }

        def write_manifest():
            manifest["files"] = {
                f.name: {"sha256": sha256_file(f), "bytes": f.stat().st_size}
                for f in sorted(tmp.iterdir())
                if f.is_file() and f.name != MANIFEST_NAME
            }
            missing = [f for f in manifest["tokenizer"]["files"] if f not in manifest["files"]]
            if family.name == "marian":
                missing += [f for f in TOKENIZER_FILES if f not in manifest["files"]]
            if missing:
                raise RuntimeError(f"tokenizer files not written: {', '.join(missing)}")
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")

        # A provisional sidecar lets verification load the real backends from the partial folder;
        # nobody else looks there, and the final one replaces it.
        manifest["verification"] = None
        write_manifest()
        if options.verify:
            sentences = verify.read_dev_sentences(options.sentences, 64)
            greedy_sentences = verify.read_dev_sentences(options.sentences, options.verify_sentences)
            result = steps.run(
                "verify against PyTorch (logits; greedy and the model's own decoding: ids, text)",
                verify.run,
                model,
                tokenizer,
                tmp,
                sentences,
                greedy_sentences,
                options.verify_max_new_tokens,
                options.threads,
            )
            manifest["verification"] = result
            log(summarize(result))
            if not result["fp32_passed"]:
                rejected = out.with_name(out.name + ".rejected")
                shutil.rmtree(rejected, ignore_errors=True)
                manifest["verification"]["fp32_passed"] = False
                write_manifest()
                tmp.rename(rejected)
                raise VerificationFailed(result["failures"], rejected)
        manifest["export_seconds"] = steps.durations
        manifest["export_peak_rss_mb"] = dict(steps.peak_rss_mb)
        manifest["export_start_rss_mb"] = dict(steps.start_rss_mb)  # a copy: the write step adds its own
        steps.run("write manifest.json and move into place", write_manifest)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def summarize(result: dict) -> str:
    lines = [f"verification: fp32 {'PASSED' if result['fp32_passed'] else 'FAILED'} (tolerance {result['fp32_tolerance']:g})"]
    for case in result["logits"]:
        diffs = ", ".join(f"{k} {v:.2e}" for k, v in case["max_abs_logit_diff"].items())
        lines.append(f"  max |Δlogit| on {case['case']}: {diffs}")
    for label, g in (("greedy", result["greedy"]), (verify.decoding_label(result.get("model_decoding")), result.get("model_decoding"))):
        for name, r in (g or {"backends": {}})["backends"].items():
            lines.append(
                f"  {label} {name}: identical ids {r['identical_ids']}/{g['sentences']}, "
                f"identical text {r['identical_text']}/{g['sentences']}, token agreement {r['token_agreement']:.1%}"
            )
    return "\n".join(lines)
