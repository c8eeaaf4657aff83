"""The architecture registry: what differs between the model families the export supports.

One entry per family, read by the export-friendly forward passes (`wrappers.py`), the source
loader (`source.py`), the sidecar and the fixtures. The forward itself is written once; an entry
only says how a family's layers are ordered and where its positions, scales and biases come from
(each checked against transformers 5.24's own modeling files):

| family | layer norms | positions | embedding scale | logits bias |
| --- | --- | --- | --- | --- |
| Marian (`MarianMTModel`) | post-LN | sinusoidal table (`.weight`), row = position | `embed_scale` on the stack | `final_logits_bias` |
| M2M100 / NLLB-200 (`M2M100ForConditionalGeneration`) | pre-LN + final LN | sinusoidal `weights` buffer, row = pad + 1 + position, pad tokens read the zero row pad | inside `embed_tokens` | none |
| mBART-50 (`MBartForConditionalGeneration`) | pre-LN + embedding LN + final LN | learned table, row = position + 2 | inside `embed_tokens` | `final_logits_bias` |

Language codes: M2M100/NLLB and mBART-50 tokenizers prefix the source with its language code,
and generation forces the target's code as the first token (`forced_bos_token_id`); the decoder
starts from eos (id 2). Marian models are one language pair each: no codes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str  # the sidecar's "family"
    title: str  # for messages: "Marian", "M2M100/NLLB", "mBART-50"
    model_type: str  # config.json's model_type
    architecture: str  # the transformers class exported (config.json's architectures)
    tokenizer_classes: tuple[str, ...]  # transformers tokenizer classes this family ships with
    pre_norm: bool  # LayerNorm before each sub-layer (else after the residual sum)
    positions: str  # "sinusoidal" | "sinusoidal_padding_offset" | "learned_offset"
    position_offset: int  # rows of the position table before position 0 (learned_offset)
    embedding_norm: bool  # LayerNorm right after token + position embedding (mBART)
    final_norm: bool  # LayerNorm after the last encoder layer and after the last decoder layer
    logits_bias: bool  # final_logits_bias added to the output layer
    # The tokenizer's language codes (None: the family has none) and the defaults: English in,
    # Chinese out, as the rest of the product.
    default_src_lang: str | None = None
    default_tgt_lang: str | None = None
    example_hub_ids: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {
    "marian": Family(
        name="marian",
        title="Marian",
        model_type="marian",
        architecture="MarianMTModel",
        tokenizer_classes=("MarianTokenizer",),
        pre_norm=False,
        positions="sinusoidal",
        position_offset=0,
        embedding_norm=False,
        final_norm=False,
        logits_bias=True,
        example_hub_ids=("Helsinki-NLP/opus-mt-en-zh",),
    ),
    "m2m_100": Family(
        name="m2m_100",
        title="M2M100/NLLB",
        model_type="m2m_100",
        architecture="M2M100ForConditionalGeneration",
        tokenizer_classes=("NllbTokenizer", "NllbTokenizerFast", "M2M100Tokenizer"),
        pre_norm=True,
        positions="sinusoidal_padding_offset",
        position_offset=2,
        embedding_norm=False,
        final_norm=True,
        logits_bias=False,
        default_src_lang="eng_Latn",  # NLLB's code; M2M100Tokenizer's is "en" (see default_languages)
        default_tgt_lang="zho_Hans",
        example_hub_ids=("facebook/nllb-200-distilled-600M", "facebook/m2m100_418M"),
    ),
    "mbart": Family(
        name="mbart",
        title="mBART-50",
        model_type="mbart",
        architecture="MBartForConditionalGeneration",
        tokenizer_classes=("MBart50Tokenizer", "MBart50TokenizerFast"),
        pre_norm=True,
        positions="learned_offset",
        position_offset=2,
        embedding_norm=True,
        final_norm=True,
        logits_bias=True,
        default_src_lang="en_XX",
        default_tgt_lang="zh_CN",
        example_hub_ids=("facebook/mbart-large-50-many-to-many-mmt",),
    ),
}

# Default (source, target) language codes per tokenizer class, where they differ from the family's.
_TOKENIZER_LANGUAGES = {"M2M100Tokenizer": ("en", "zh")}


class UnsupportedArchitecture(ValueError):
    pass


def supported() -> str:
    """'MarianMTModel (marian), ...' for error messages."""
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


def default_languages(family: Family, tokenizer_class: str) -> tuple[str | None, str | None]:
    return _TOKENIZER_LANGUAGES.get(tokenizer_class, (family.default_src_lang, family.default_tgt_lang))
