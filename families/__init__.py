"""The family registry: one entry per model family the export supports, read by every layer.

An entry (`family.py`) names the family's transformers classes and tokenizer files, the flags the
export-friendly forward passes read (`export/wrappers.py`: norm order, positions, embedding scale
and norm, final norms, logits bias, each checked against transformers' own modeling files), the
layout its graphs and module names follow (`bart.py`, `t5.py`), how the app names it, and its fixtures.
Adding a family is a module here with its entry, and its name in `FAMILIES` below; a family with
a layout of its own also brings its graph wrappers (and, for another attention core, the fusion
that matches it) as modules of their own. Nothing else branches on a family's name.

Standard library only, below every layer (see `family.py`): the exporter, the backends, the request
layer, the UI and the peers' environment all read it.
"""

from __future__ import annotations

from .family import Family, Layout
from .m2m_100 import M2M100
from .marian import MARIAN
from .mbart import MBART
from .t5 import MT5, T5

FAMILIES: dict[str, Family] = {f.name: f for f in (MARIAN, M2M100, MBART, T5, MT5)}

# The embedded model's family: what a model folder without a sidecar, or a sidecar without a
# "family" section, holds.
DEFAULT_FAMILY = MARIAN.name


class UnsupportedArchitecture(ValueError):
    pass


def supported() -> str:
    """'MarianMTModel (model_type 'marian'), ...' for error messages."""
    return ", ".join(f"{f.architecture} (model_type {f.model_type!r})" for f in FAMILIES.values())


def family_of(config: dict, where: str) -> Family:
    """The family of a config.json's content; raises UnsupportedArchitecture listing the supported ones."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    family = next((f for f in FAMILIES.values() if f.model_type == model_type), None)
    if family is None or (architectures and family.architecture not in architectures):
        raise UnsupportedArchitecture(
            f"{where}: unsupported architecture {', '.join(architectures) or '?'} (model_type {model_type!r}); "
            f"supported: {supported()}"
        )
    return family


def family_named(name: str) -> Family | None:
    """The entry a sidecar's family name refers to; None if no family has that name."""
    return FAMILIES.get(name)


def shape_of(config) -> dict:
    """The sidecar's "model" facts of a loaded HF config, read as its family's layout names them."""
    family = next((f for f in FAMILIES.values() if f.model_type == config.model_type), None)
    if family is None:
        raise UnsupportedArchitecture(f"unsupported model_type {config.model_type!r}; supported: {supported()}")
    return family.layout.shape(config)


def default_languages(family: Family, tokenizer_class: str) -> tuple[str | None, str | None]:
    return family.tokenizer_languages.get(tokenizer_class, (family.default_src_lang, family.default_tgt_lang))


def architectures() -> tuple[str, ...]:
    """Every transformers model class an export can come from."""
    return tuple(f.architecture for f in FAMILIES.values())


def tokenizer_classes() -> tuple[str, ...]:
    """Every transformers tokenizer class an export may name."""
    return tuple(c for f in FAMILIES.values() for c in f.tokenizer_classes)


def layouts() -> list[Layout]:
    """The distinct layouts of the registered families, in registry order."""
    seen: list[Layout] = []
    for f in FAMILIES.values():
        if all(f.layout is not s for s in seen):
            seen.append(f.layout)
    return seen


def fixtures() -> dict:
    """Every family's fixture recipes, by fixture name."""
    return {name: recipe for f in FAMILIES.values() for name, recipe in f.fixtures.items()}


__all__ = [
    "DEFAULT_FAMILY", "FAMILIES", "Family", "Layout", "UnsupportedArchitecture", "architectures",
    "default_languages", "family_named", "family_of", "fixtures", "layouts", "shape_of", "supported",
    "tokenizer_classes",
]
