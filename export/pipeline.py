"""The export, step by step: load, probe, three fp32 graphs, fp16, verify, sidecar, rename.

Everything is written into a temporary sibling folder and renamed into place only after the
sidecar is written, so a half-written export is never mistaken for a finished one.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.memory import release_freed_memory, reset_peak_rss

from . import fp16, fp16_guard, graphs, int8_choice, quantize, ranges, rewrite, sidecar, verify
from .fp16_guard import Fp16Keep
from .source import load_source


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
    # What stays fp32 in the fp16 graphs (export/fp16_guard.py): measured by default.
    fp16_keep: Fp16Keep = Fp16Keep()
    # int8 nodes kept in fp32: "none", "auto", a count or "N+rescore", by measured sensitivity (export/int8_choice.py).
    int8_keep: str = "none"
    # The single-step graph repeats every weight in a file of its own and serves only the naive
    # baseline backend; at billions of parameters a user may leave it out (said so in the sidecar).
    single_step: bool = True

    def __post_init__(self):
        object.__setattr__(self, "int8_keep", str(int8_choice.parse_keep(self.int8_keep)))
        if self.opset < 17:
            raise ValueError(f"opset must be >= 17 (LayerNormalization is a single op from 17), got {self.opset}")
        if self.verify_sentences < 1 or self.verify_max_new_tokens < 1:
            raise ValueError("verify_sentences and verify_max_new_tokens must be >= 1")


class VerificationFailed(RuntimeError):
    def __init__(self, failures: list[str], kept: Path):
        self.failures, self.kept = failures, kept
        super().__init__("verification failed:\n  " + "\n  ".join(failures) + f"\nthe rejected export is in {kept}")


def _status_mb(field: str) -> float | None:
    """A /proc/self/status figure in MB of 1e6 bytes, as the weights are counted (VmHWM: peak RSS
    since start or the last reset; VmRSS: now); None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):  # the kernel counts in KiB
                return round(int(line.split()[1]) * 1024 / 1e6, 1)
    except OSError:
        pass
    return None


def _release_weights(model) -> None:
    """Empty every parameter and buffer of `model` in place. torch.onnx.export's graph keeps the
    Parameter objects alive after the call, so dropping the model alone would not free its weights
    (memory-mapped pages of the weights file, all resident once traced)."""
    import torch

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = torch.empty(0, dtype=tensor.dtype)


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
        release_freed_memory()
        self.durations[title] = round(seconds, 2)
        self.peak_rss_mb[title] = peak
        began = self.start_rss_mb[title]
        memory = "" if peak is None else f", peak RSS {peak / 1e3:.2f} GB (started at {(began or 0) / 1e3:.2f} GB)"
        self.log(f"[{self.n}/{self.total}] {title}: done in {seconds:.1f} s{memory}", flush=True)
        return result


def export(src: str, options: ExportOptions, log=print) -> Path:
    out = Path(options.out)
    if out.exists() and not options.force:
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    if options.threads:  # torch's too, as --threads says: tracing and the reference run on it
        import torch

        torch.set_num_threads(options.threads)
    steps = _Steps(7 + options.verify + options.single_step, log)
    model, tokenizer, source, family, languages = steps.run(
        f"load {src}", load_source, src, options.src_lang, options.tgt_lang
    )
    config = model.config
    shape = family.layout.shape(config)
    generation = sidecar.generation(model, family, source, languages)  # refuses unsupported options before any graph is made
    external = graphs.needs_external_data(model) if options.external_data is None else options.external_data
    exported = ("full", "encoder", "decoder") if options.single_step else ("encoder", "decoder")
    steps.run("probe: trace each graph on a tiny input", graphs.probe, model, family, config, options.opset, exported)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        specs = graphs.graph_specs(config)
        rewrites = {}

        def full():
            path = graphs.export_graph(model, family, config, specs["full"], tmp, options.opset, external)
            rewrites["full"] = rewrite.rewrite_file(path)

        if options.single_step:
            steps.run("export full (single-step) graph", full)

        def kv_pair():
            graphs.export_graph(model, family, config, specs["encoder"], tmp, options.opset, external)
            path = graphs.export_graph(model, family, config, specs["decoder"], tmp, options.opset, external)
            rewrites["decoder"] = rewrite.rewrite_file(path)

        steps.run("export KV-cache encoder + decoder graphs", kv_pair)
        # The model's weights are not read again until verification, which loads it anew: every
        # step from here on works from the graph files, without the model's copy in memory.
        facts = sidecar.model_facts(model, family)
        _release_weights(model)
        del model

        # Calibration text for the fp16 guard and for verification's finiteness check.
        calibration = ranges.calibration(
            tokenizer, fp16_guard.calibration_text(verify.read_dev_sentences(options.sentences, 64)),
            decoder_start=config.decoder_start_token_id, eos=config.eos_token_id,
            forced_bos=generation["forced_bos_token_id"], max_source_tokens=shape["max_position_embeddings"])

        def to_fp16():
            plan = fp16_guard.plan(tmp / "encoder.onnx", tmp / "decoder.onnx", options.fp16_keep, calibration,
                                   options.threads)
            report = {name: fp16.convert_to_fp16(tmp / f"{name}.onnx", tmp / f"{name}_fp16.onnx", plan["ops"], plan[name])
                      for name in ("encoder", "decoder")}
            report["decoder"]["guard"] = plan["record"]
            return report

        fp16_report = steps.run("convert KV-cache pair to fp16", to_fp16)

        # After fp16, before int8. The fp16 converter re-infers every value's type with ONNX's shape
        # inference, which knows no com.microsoft op: from a fused graph it would keep no types past
        # the first MultiHeadAttention, and service/locate.py maps modules by those types. So fp16 is
        # converted from the exported cores and fused after; int8 is quantized from the fused fp32.
        # The rewrites that match the attention core the family's graph wrappers write.
        attention = family.layout.attention_module()

        def fuse():
            heads = {"encoder": shape["encoder_attention_heads"], "decoder": shape["decoder_attention_heads"]}
            for name in ("encoder", "decoder"):
                fused = {p: attention.fuse_attention_file(tmp / f"{name}{p}.onnx", heads[name]) for p in ("", "_fp16")}
                rewrites.setdefault(name, {}).update(fused[""])
                rewrites[f"{name}_fp16"] = fused["_fp16"]

        steps.run("fuse each attention core into one MultiHeadAttention, with its cache and packed q/k/v (fp32, fp16)", fuse)

        def to_int8():
            calib = None
            if options.int8_keep != "none":
                calib = int8_choice.calibration(tokenizer, config, generation, verify.read_dev_sentences(
                    options.sentences, int8_choice.CALIBRATION_SENTENCES))
            choice = int8_choice.choose(tmp, shape, calib, options.int8_keep, threads=options.threads, log=log)
            keep = int8_choice.keep_sets(choice)
            reports = {name: quantize.quantize_int8(tmp / f"{name}.onnx", tmp / f"{name}_int8.onnx", keep=keep[name],
                                                    rescore=choice["rescore"] if name == "decoder" else 0)
                       for name in ("encoder", "decoder")}
            return {**reports["decoder"], "gathers": {name: r["gathers"] for name, r in reports.items()},
                    "keep_option": choice["option"], "keep_rule": choice["rule"], "kept_in_fp32": choice["kept"],
                    "sensitivity": choice["sensitivity"]}

        int8_report = steps.run("quantize KV-cache pair to int8 (dynamic)", to_int8)
        left_out = {} if options.single_step else {"full": sidecar.SINGLE_STEP_LEFT_OUT}
        graph_section = sidecar.graph_entries(specs, tmp, left_out)
        tokenizer_record = sidecar.save_tokenizer(tokenizer, source, family, tmp)
        manifest = sidecar.manifest(
            config, facts, tokenizer, source, family, languages, generation, opset=options.opset, graph_section=graph_section,
            tokenizer_record=tokenizer_record, rewrites=rewrites, fp16=fp16_report, int8=int8_report, left_out=left_out,
        )

        def write_manifest():
            sidecar.write(tmp, manifest, family)

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
                lambda: load_source(src, options.src_lang, options.tgt_lang)[0],
                tokenizer,
                tmp,
                sentences,
                greedy_sentences,
                options.verify_max_new_tokens,
                options.threads,
                calibration,
            )
            manifest["verification"] = result
            log(sidecar.summarize(result))
            if not result["passed"]:
                rejected = out.with_name(out.name + ".rejected")
                shutil.rmtree(rejected, ignore_errors=True)
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
