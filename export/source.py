"""Find, validate and load the source model: a local HF Marian folder or a hub id."""

from __future__ import annotations

import json
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("MarianMTModel",)
SUPPORTED_MODEL_TYPES = ("marian",)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")


class SourceError(ValueError):
    """The source model cannot be exported; the message names what is missing or unsupported."""


def check_local_folder(folder: Path) -> dict:
    """Validate a local model folder before loading anything heavy; return its config."""
    if not folder.is_dir():
        raise SourceError(f"{folder} is not a folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise SourceError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SourceError(f"{config_path} is not valid JSON: {e}") from e
    check_architecture(config, str(folder))
    missing = []
    if not any((folder / w).is_file() for w in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    missing += [f for f in TOKENIZER_FILES if not (folder / f).is_file()]
    if missing:
        raise SourceError(f"{folder} lacks {', '.join(missing)} (a Marian model folder needs weights and tokenizer files)")
    return config


def check_architecture(config: dict, where: str) -> None:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES or (
        architectures and not any(a in SUPPORTED_ARCHITECTURES for a in architectures)
    ):
        raise SourceError(
            f"{where}: unsupported architecture {', '.join(architectures) or '?'} (model_type {model_type!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(map(repr, SUPPORTED_MODEL_TYPES))})"
        )


def load_source(src: str):
    """Return (model in eval mode, tokenizer, source record for the sidecar)."""
    from transformers import MarianMTModel, MarianTokenizer

    path = Path(src)
    if path.exists():
        check_local_folder(path)
        weights = next(path / w for w in WEIGHT_FILES if (path / w).is_file())
        from backends.manifest import sha256_file

        record = {"path": str(path.resolve()), "hub_id": None, "weights_sha256": sha256_file(weights)}
        where = str(path)
    else:
        if src.count("/") != 1 or src.startswith((".", "/")):
            raise SourceError(f"{src} is neither a local folder nor a hub id (owner/name)")
        record = {"path": None, "hub_id": src, "weights_sha256": None}
        where = src
    try:
        if record["hub_id"]:
            from transformers import AutoConfig

            check_architecture(AutoConfig.from_pretrained(src).to_dict(), src)
        model = MarianMTModel.from_pretrained(where).eval()
        tokenizer = MarianTokenizer.from_pretrained(where)
    except SourceError:
        raise
    except OSError as e:
        raise SourceError(f"could not load {where}: {e}") from e
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer, record
