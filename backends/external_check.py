"""Does someone else's export belong to the reference? Every difference named in one error.

config.json's vocabulary size, special ids and model type, the graphs' logits width, and the
tokenizer (every id's piece, special ids, sentencepiece files, the encoding of probe sentences) are
compared with the reference's sidecar and tokenizer; every difference is named in one
`ExternalExportError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .external_layout import ExternalExportError, Layout
from .manifest import Manifest, sha256_file

# Sentences whose encodings must agree token for token: words, numbers, punctuation, accents, symbols.
PROBE_TEXTS = (
    "Hello world.",
    "Click outside the spreadsheet to view the slide.",
    "On 3 May 2024 the 12 cats' owner paid $1,250.75 (tax included), didn't she?",
    "Naïve café façades — “quoted” — and e-mail@example.com.",
)


def _config_differences(config: dict[str, Any], manifest: Manifest) -> list[str]:
    special = manifest.special
    out = []
    for key, want in (("model_type", manifest.family), ("vocab_size", manifest.vocab_size),
                      ("pad_token_id", special.pad), ("eos_token_id", special.eos),
                      ("decoder_start_token_id", special.decoder_start)):
        got = config.get(key)
        if key == "decoder_start_token_id" and got is None:
            continue  # not recorded: the model's config falls back to its own rule, which the logits check covers
        if got != want and not (isinstance(got, list) and want in got):
            out.append(f"config.json {key} is {got!r}, the reference's {want!r}")
    return out


def _tokenizer_differences(folder: Path, manifest: Manifest, reference) -> list[str]:
    """Compare the folder's tokenizer with the reference's (a `TokenizerWrapper`)."""
    from .tokenizer import TokenizerWrapper

    wanted = manifest.tokenizer_files
    missing = [f for f in wanted if not (folder / f).is_file()]
    if missing:
        return [f"tokenizer files missing: {', '.join(missing)} (the reference has {', '.join(wanted)}; "
                "copy the tokenizer the model was exported with next to the graphs)"]
    out = []
    for name in wanted:  # sentencepiece models are copied byte for byte by save_pretrained
        if name.endswith((".spm", ".model")) and sha256_file(folder / name) != sha256_file(manifest.root / name):
            out.append(f"{name} differs from the reference's (sha256)")
    try:
        theirs = TokenizerWrapper(folder, src_lang=reference.src_lang, tokenizer_class=manifest.tokenizer_class,
                                  source_prefix=reference.source_prefix)
    except Exception as e:  # reported as a difference: the message is what the user needs
        return [*out, f"its tokenizer does not load as {manifest.tokenizer_class}: {type(e).__name__}: {e}"]
    for what in ("pad_id", "eos_id"):
        if getattr(theirs, what) != getattr(reference, what):
            out.append(f"tokenizer {what} is {getattr(theirs, what)}, the reference's {getattr(reference, what)}")
    ids = list(range(manifest.vocab_size))
    mine, yours = reference.pieces(ids), theirs.pieces(ids)
    differing = [i for i, (a, b) in enumerate(zip(mine, yours)) if a != b]
    if differing:
        i = differing[0]
        out.append(f"tokenizer: {len(differing)} of {len(ids)} ids map to other pieces (id {i}: "
                   f"{yours[i]!r} here, {mine[i]!r} in the reference)")
    for text in PROBE_TEXTS:
        a = reference.encode([text], 10_000).input_ids[0].tolist()
        b = theirs.encode([text], 10_000).input_ids[0].tolist()
        if a != b:
            out.append(f"tokenizer: {text!r} encodes to {b[:12]}… here, {a[:12]}… in the reference")
            break
    return out


def check(layout: Layout, manifest: Manifest, reference_tokenizer, graphs: list[dict[str, Any]]) -> dict[str, Any]:
    """Raise ExternalExportError naming every difference from the reference; return what was checked."""
    problems = []
    config_path = layout.meta / "config.json"
    config: dict[str, Any] = {}
    if not config_path.is_file():
        problems.append(f"no config.json in {layout.meta} (Optimum writes the model's config next to the graphs)")
    else:
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            problems.append(f"{config_path} is not valid JSON: {e}")
        problems += _config_differences(config, manifest)
    for g in graphs:
        shape = g["logits_shape"]
        if shape is not None and isinstance(shape[-1], int) and shape[-1] != manifest.vocab_size:
            problems.append(f"{g['file']} outputs logits over {shape[-1]} ids, the reference's vocabulary has "
                            f"{manifest.vocab_size}")
    problems += _tokenizer_differences(layout.meta, manifest, reference_tokenizer)
    if problems:
        raise ExternalExportError(
            f"{layout.folder} is not an export of the reference model ({manifest.root}): " + "; ".join(problems)
        )
    return {
        "config": {k: config.get(k) for k in ("model_type", "architectures", "vocab_size", "d_model",
                                              "decoder_layers", "transformers_version") if k in config},
        "checked": [
            f"vocabulary: {manifest.vocab_size} ids (config.json and the logits)",
            "special ids: pad, eos, decoder start",
            f"tokenizer: every id's piece, pad/eos ids, sentencepiece files, {len(PROBE_TEXTS)} probe sentences",
        ],
    }
