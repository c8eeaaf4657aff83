"""The export sidecar (`manifest.json`): the one contract between `export/` and the backends.

Backends read nothing else to start: graph files and their inputs/outputs, special ids, limits,
checksums. `load_manifest` validates it once and raises errors that say what is wrong and where.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from families import target_token

from .generation import (
    GENERATE_DEFAULTS,
    SUPPORTED_GENERATION,
    GenerationDefaults,
    SpecialTokens,
    UnsupportedGeneration,
)
from .options import DecodeOptions

MANIFEST_NAME = "manifest.json"
FORMAT = "marian-onnx-export"
# 2: tied output layer stored pre-transposed, int8 embeddings (export/rewrite.py)
# 3: "generation": the model's own generation config, the decoding defaults (beam search, penalties)
# 4: attention cores as ONNX Runtime's MultiHeadAttention (export/rewrite.fuse_attention)
# 5: the decoder's cache appended inside MultiHeadAttention, q/k/v projections packed (export/rewrite.py)
# 6: int8 weights in a 7-bit range (export/quantize.py), exact on CPUs without VNNI too
# 7: the decoder's cross-attention inputs batched by sentence, shared by its beams (export/attention.py)
# 8: a tied embedding gathers rows of the (V, d) table, the output layer reads its own (d, V) copy
FORMAT_VERSION = 8
FORMAT_CHANGE = ("the decoder's embedding reads one row of the token table per id, not one number from each of "
                 "d columns")
# The batch dimension of a (v7 on) decoder's cross-attention inputs (keys, values, source mask): one row
# per sentence, where its other inputs have one per beam.
CROSS_BATCH = "sentences"
GRAPH_NAMES = ("full", "encoder", "decoder", "encoder_fp16", "decoder_fp16", "encoder_int8", "decoder_int8")
# The files a Marian tokenizer needs; the export checks it wrote them (every export lists its own
# in the sidecar's "tokenizer" section).
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json")


class ManifestError(ValueError):
    """The export folder cannot be trusted: missing, malformed, modified or failed verification."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# --- the model's generation config ----------------------------------------------------------------
#
# Recorded at export from `model.generation_config` (transformers 5.24) and used by every backend as
# the decoding defaults, so a backend decodes as `generate()` does for that model. An option that
# would change generate()'s output and that the decoding loop does not implement is refused at
# export, naming it: never silently ignored.

# The model's special ids: must agree with its config (the backends use those).
_IDENTITY = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
# Change how generate() runs, not which tokens it returns.
_BOOKKEEPING = (
    "transformers_version", "_from_model_config", "use_cache", "output_attentions", "output_hidden_states",
    "output_scores", "output_logits", "return_dict_in_generate", "cache_implementation", "cache_config",
    "compile_config", "disable_compile", "max_cache_len", "prefill_chunk_size", "continuous_batching_config",
    "is_assistant",
)
# Read by generate() only in a mode these backends never enter; recorded as inert, with the reason.
_SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
_ASSISTANT_ONLY = (
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind", "assistant_early_exit", "assistant_ensemble_weight",
    "max_matching_ngram_size", "speculation_type",
)


def source_prefix(languages: dict | None) -> str | None:
    """The text before every source ("<2zh> ") of a sidecar's languages whose target is a token
    there (MADLAD-400); None otherwise."""
    if not languages or not languages.get("target_token"):
        return None
    return target_token.source_prefix(languages["target_token"], languages["tgt_lang"])


def _is_set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}


def generation_source_file(folder: Path) -> Path:
    """Where transformers reads a local model's generation config from."""
    file = Path(folder) / "generation_config.json"
    return file if file.is_file() else Path(folder) / "config.json"


def _digest(path: Path | None) -> dict[str, str] | None:
    return None if path is None or not path.is_file() else {"file": path.name, "sha256": sha256_file(path)}


def generation_section(
    config: dict[str, Any], *, special: dict[str, Any], limit: int, vocab_size: int, source_file: Path | None = None
) -> dict[str, Any]:
    """The sidecar's "generation" section from `GenerationConfig.to_dict()`; raises UnsupportedGeneration.

    `special`: the ids recorded in `special_tokens`; `limit`: the most new tokens positions allow;
    `source_file`: the file the config was read from (its checksum tells `export.ensure` when it
    changed). Every refused option is named in one error.
    """
    refused, inert = [], {}
    do_sample = config.get("do_sample") is True
    for key, value in sorted(config.items()):
        if key in SUPPORTED_GENERATION or key in _BOOKKEEPING or not _is_set(value):
            continue
        if key in GENERATE_DEFAULTS and value == GENERATE_DEFAULTS[key]:
            continue
        if key == "guidance_scale" and value == 1:
            continue
        if key in _IDENTITY:
            expected = special.get(key.replace("_token_id", ""))
            if key == "bos_token_id" or value == expected or value == [expected]:
                continue
            refused.append(f"{key}={value!r} (the model config says {expected!r})")
        elif key in _SAMPLING_ONLY and not do_sample:
            inert[key] = f"{value!r}: read only when sampling (do_sample=True); generate() ignores it here too"
        elif key in _ASSISTANT_ONLY:
            inert[key] = f"{value!r}: read only with an assistant model, which these backends never use"
        else:
            refused.append(f"{key}={value!r}")
    if refused:
        raise UnsupportedGeneration(
            "the model's generation config sets options the backends do not implement: "
            + ", ".join(refused)
            + f". Supported: {', '.join(SUPPORTED_GENERATION)}; edit generation_config.json (or pass a "
            "model without these) and export again"
        )
    notes = []
    eos = special["eos"]
    if config.get("max_new_tokens") is not None:
        max_new = int(config["max_new_tokens"])
    elif config.get("max_length") is not None:
        max_new = int(config["max_length"]) - 1  # the decoder start token counts towards max_length
    else:
        max_new = None  # generate() would stop at 20 new tokens, a model-agnostic fallback: not copied
        notes.append("no max_length in the model's generation config: decoding runs up to the position limit "
                     "(generate() would fall back to its model-agnostic 20 new tokens)")
    if max_new is not None and max_new > limit:
        notes.append(f"max new tokens {max_new} capped at the position limit {limit}")
        max_new = limit
    if config.get("min_new_tokens") is not None:
        min_new = int(config["min_new_tokens"])
    else:
        min_new = max(0, int(config.get("min_length") or 0) - 1)
    bad_words = [list(ids) for ids in config.get("bad_words_ids") or [] if list(ids) != [eos]]
    out_of_range = [i for ids in bad_words for i in ids if not 0 <= i < vocab_size]
    for key in ("forced_bos_token_id", "forced_eos_token_id"):
        if config.get(key) is not None and not 0 <= config[key] < vocab_size:
            out_of_range.append(config[key])
    if out_of_range:
        raise UnsupportedGeneration(f"token ids outside the vocabulary (0..{vocab_size - 1}): {out_of_range}")
    defaults = {name: GENERATE_DEFAULTS.get(name) for name in ("num_beams", "length_penalty", "early_stopping",
                                                               "no_repeat_ngram_size", "repetition_penalty",
                                                               "num_return_sequences")}
    section = {
        **{k: (config.get(k) if config.get(k) is not None else v) for k, v in defaults.items()},
        "max_new_tokens": max_new,
        "min_new_tokens": min_new,
        "bad_words_ids": bad_words,
        "forced_bos_token_id": config.get("forced_bos_token_id"),
        "forced_eos_token_id": config.get("forced_eos_token_id"),
        "renormalize_logits": bool(config.get("renormalize_logits")),
        "inert": inert,
        "notes": notes,
        "source": _digest(source_file),
    }
    section["length_penalty"] = float(section["length_penalty"])
    section["repetition_penalty"] = float(section["repetition_penalty"])
    try:  # DecodeOptions is the one place option ranges are checked
        DecodeOptions().resolved(limit, GenerationDefaults.from_section(section))
    except ValueError as e:
        raise UnsupportedGeneration(f"the model's generation config is outside what the backends take: {e}") from e
    return section


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict[str, Any]

    @property
    def special(self) -> SpecialTokens:
        return SpecialTokens.from_section(self.data["special_tokens"])

    @property
    def generation(self) -> GenerationDefaults:
        return GenerationDefaults.from_section(self.data["generation"])

    @property
    def max_source_tokens(self) -> int:
        return int(self.data["limits"]["max_source_tokens"])

    @property
    def max_new_tokens(self) -> int:
        return int(self.data["limits"]["max_new_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.data["model"]["vocab_size"])

    def kept_in_float(self, precision: str) -> str | None:
        """One line for a low-precision backend's panel: what its graphs keep in fp32, and why."""
        section = self.data.get(precision) or {}
        if "keep_option" in section:  # int8: nodes kept by measured sensitivity (export/int8_choice.py)
            rescored = section.get("output_layer_rescored")
            rescore = f"; the output layer's {rescored['top']} best logits re-scored in fp32" if isinstance(
                rescored, dict) and rescored.get("rescored") else ""
            if section["keep_option"] == "none":
                return "int8: every MatMul and embedding in int8 (--int8-keep none)"
            return (f"int8 --int8-keep {section['keep_option']}: {len(section.get('kept_in_fp32') or [])} weight node(s) "
                    f"kept in fp32 by measured sensitivity{rescore}")
        guard = section.get("guard")
        if not guard:
            return None
        if guard.get("mode") != "auto":
            return f"fp32 kept by rule: {guard.get('rule')}"
        n = sum(len(nodes) for nodes in (guard.get("kept") or {}).values())
        tops = [v for v in (guard.get("largest") or {}).values() if v]
        top = max(tops, key=lambda v: v["max_abs"]) if tops else None
        peak = f"; largest |value| on calibration text {top['max_abs']:.3g} ({top['op']})" if top else ""
        return f"overflow guard: {n} node(s) in fp32, those reading or writing |values| >= {guard['threshold']:.0f}{peak}"

    @property
    def graphs_left_out(self) -> dict[str, str]:
        """{graph: why} for the graphs this export chose not to write (`--no-single-step`)."""
        return dict(self.data.get("graphs_left_out") or {})

    def graph(self, name: str) -> dict[str, Any]:
        graphs = self.data["graphs"]
        if name in self.graphs_left_out:
            raise ManifestError(f"{self.root}: graph {name!r} was {self.graphs_left_out[name]}")
        if name not in graphs:
            raise ManifestError(f"{self.root}: no graph {name!r}; this export has: {', '.join(graphs)}")
        return graphs[name]

    def graph_path(self, name: str) -> Path:
        return self.root / self.graph(name)["file"]

    def verify_file(self, filename: str) -> None:
        """Raise if `filename` is missing or its sha256 differs from the one recorded at export."""
        files = self.data["files"]
        if filename not in files:
            raise ManifestError(f"{self.root}: {filename} is not listed in {MANIFEST_NAME}")
        path = self.root / filename
        if not path.is_file():
            raise ManifestError(f"{path} is missing (listed in {MANIFEST_NAME})")
        actual = sha256_file(path)
        expected = files[filename]["sha256"]
        if actual != expected:
            raise ManifestError(
                f"{path} was modified after export: sha256 {actual[:12]}… but {MANIFEST_NAME} "
                f"records {expected[:12]}…; re-run the export"
            )

    def verify_graph(self, name: str) -> Path:
        """Checksum a graph file and its external-data file, if any; return its path."""
        graph = self.graph(name)
        for filename in [graph["file"], *graph.get("external_data", [])]:
            self.verify_file(filename)
        return self.graph_path(name)

    @property
    def family(self) -> str:
        """"marian", "m2m_100" or "mbart" (families/)."""
        return self.data["family"]["name"]

    @property
    def architecture(self) -> str:
        return self.data["model"]["architecture"]

    @property
    def tokenizer_class(self) -> str:
        return self.data["tokenizer"]["class"]

    @property
    def tokenizer_files(self) -> tuple[str, ...]:
        return tuple(self.data["tokenizer"]["files"])

    @property
    def languages(self) -> dict[str, Any] | None:
        """{"src_lang", "tgt_lang", "codes": {code: id}} (and "target_token", the template of a target
        named by a token before the source), or None for a model without language codes."""
        return self.data.get("languages")

    def with_languages(self, src_lang: str | None = None, tgt_lang: str | None = None) -> "Manifest":
        """This export with another source language and/or target language (forced first token).

        Raises ValueError naming the codes the tokenizer knows."""
        if src_lang is None and tgt_lang is None:
            return self
        languages = self.languages
        if not languages:
            raise ValueError(
                f"{self.root}: this {self.architecture} model has no language codes; --src-lang/--tgt-lang do not apply"
            )
        codes = languages["codes"]
        if src_lang is not None and languages.get("target_token"):
            raise ValueError(f"{self.root}: this {self.architecture} model reads the source language from the text "
                             "itself; --src-lang does not apply")
        unknown = [f"{what} {code!r}" for what, code in (("source language", src_lang), ("target language", tgt_lang))
                   if code is not None and code not in codes]
        if unknown:
            raise ValueError(f"unknown {' and '.join(unknown)}; the tokenizer knows: {', '.join(codes)}")
        data = dict(self.data)
        data["languages"] = {**languages, "src_lang": src_lang or languages["src_lang"],
                             "tgt_lang": tgt_lang or languages["tgt_lang"]}
        if not languages.get("target_token"):  # else the token before the source names the target
            data["generation"] = {**self.data["generation"],
                                  "forced_bos_token_id": codes[data["languages"]["tgt_lang"]]}
        return Manifest(root=self.root, data=data)

    @property
    def source_prefix(self) -> str | None:
        """The text before every source ("<2zh> ") where the target language is a token there (MADLAD-400)."""
        return source_prefix(self.languages)

    def verify_tokenizer(self) -> None:
        for filename in self.tokenizer_files:
            self.verify_file(filename)


def load_manifest(export_dir: str | Path) -> Manifest:
    root = Path(export_dir)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise ManifestError(f"export folder not found: {root}")
    if not path.is_file():
        raise ManifestError(
            f"{root} has no {MANIFEST_NAME}: not a finished export (run `python -m export SRC --out {root}`)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from e
    version = data.get("format_version")
    if data.get("format") == FORMAT and isinstance(version, int) and version < FORMAT_VERSION:
        raise ManifestError(
            f"{path}: written by an older export (format v{version}); this version reads v{FORMAT_VERSION} "
            f"({FORMAT_CHANGE}): re-run the export "
            f"(`python -m export SRC --out {root}`; the app re-creates its embedded model's export by itself)"
        )
    if data.get("format") != FORMAT or version != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: format {data.get('format')!r} v{data.get('format_version')!r}, "
            f"expected {FORMAT!r} v{FORMAT_VERSION}"
        )
    missing = [
        k for k in ("model", "family", "tokenizer", "special_tokens", "limits", "generation", "graphs", "files",
                    "verification") if k not in data
    ]
    if missing:
        raise ManifestError(f"{path} lacks: {', '.join(missing)}")
    verification = data["verification"]
    if verification is not None and not (verification.get("fp32_passed", False) and verification.get("passed", True)):
        first = (verification.get("failures") or ["(no failure recorded)"])[0]
        raise ManifestError(f"{path}: this export failed its verification ({first}); re-export before using it")
    return Manifest(root=root, data=data)
