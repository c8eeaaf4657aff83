"""python -m bench.peers ct2-convert: ct2-transformers-converter, exact to generate() for every family.

Runs CTranslate2's `TransformersConverter` with the loader it registers for the model's config
(`MarianMTLoader`, `M2M100Loader`, `MBartLoader`), corrected where its decoder would start from
another token than transformers' `generate()`:

- Marian: transformers starts the decoder from the embedding of `decoder_start_token_id` (= `<pad>`),
  times sqrt(d_model) with `scale_embedding`, plus position 0. The stock loader drops the `<pad>` row
  from the vocabulary and every embedding/output matrix and starts from a zero embedding: exact for
  models converted from Marian C++ (the opus-mt family, and random fixtures, whose `<pad>` row is
  zero) but not for a model trained in transformers with tied embeddings, where the output layer's
  gradient makes the `<pad>` row non-zero (`assets/marian-en-zh-small`); there no output matched.
  When that row is non-zero this keeps it: vocabulary and weights keep `<pad>`, the decoder starts
  from the `<pad>` token's embedding, and the output bias of `<pad>` is set to -1e9 so it is never
  generated, like transformers' `bad_words_ids=[[pad]]` and the stock converter's removed row.
  When the row is zero the stock loader runs unchanged.
- mBART: the stock loader starts mBART-25 style (no decoder start token: the target prefix's
  language code is the start) unless config.json names an mBART-50 tokenizer class; generate()
  starts every mBART from `decoder_start_token_id` (eos), then forces the language code. The
  decoder start is taken from the model's config, as the loader of its parent (BART) does.
- M2M100/NLLB: the stock loader, whose decoder start already is `decoder_start_token_id`.
- mBART and M2M100/NLLB: where config.json lacks `normalize_before` / `normalize_embedding` (transformers
  5 no longer writes them), the family registry's layer-norm layout fills them in.

The tokenizer is the family's, read as `PeerModel.tokenizer` reads it (a tokenizer saved by
transformers 5 loads in this environment's transformers 4). `bench-conversion.json` in the output
says which loader ran and how the decoder starts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .model import PeerModel


def _learned_start_marian(stock, note: dict):
    """The Marian loader, keeping a non-zero `<pad>` row as the learned decoder start (see above)."""
    import torch
    from ctranslate2.converters import transformers as ct2t

    class LearnedStartMarianLoader(type(stock)):
        learned_start = False

        def get_model_spec(self, model):
            pad = model.config.pad_token_id
            row = model.model.decoder.embed_tokens.weight[pad]
            note["pad_row_abs_max"] = float(row.abs().max())
            self.learned_start = bool(row.any())
            if not self.learned_start:
                return super().get_model_spec(model)
            model.config.normalize_before = False
            model.config.normalize_embedding = False
            spec = ct2t.BartLoader.get_model_spec(self, model)  # the Marian settings, minus the <pad> row removal
            projection = spec.decoder.projection
            bias = torch.as_tensor(projection.bias).clone() if projection.has_bias() else torch.zeros(model.config.vocab_size)
            bias[pad] = -1e9
            projection.bias = bias
            note.update(loader="ctranslate2 MarianMTLoader, <pad> row kept (bench.peers ct2-convert)",
                        decoder_start="learned <pad> embedding, as transformers", pad_output_bias=-1e9)
            return spec

        def set_decoder(self, spec, decoder):
            super().set_decoder(spec, decoder)
            spec.start_from_zero_embedding = not self.learned_start

        def set_config(self, config, model, tokenizer):
            super().set_config(config, model, tokenizer)
            if self.learned_start:
                config.decoder_start_token = tokenizer.convert_ids_to_tokens(model.config.decoder_start_token_id)

        def get_vocabulary(self, model, tokenizer):
            if self.learned_start:
                return ct2t.BartLoader.get_vocabulary(self, model, tokenizer)
            return super().get_vocabulary(model, tokenizer)

    return LearnedStartMarianLoader()


def _configured_start(stock, family, note: dict):
    """The family's stock loader, its decoder starting from the config's `decoder_start_token_id`, its
    layer norms placed as the family registry says (`family.pre_norm`, `family.embedding_norm`): the
    loaders read them from config.json keys that transformers 5 no longer writes."""

    class ConfiguredStartLoader(type(stock)):
        def get_model_spec(self, model):
            if not hasattr(model.config, "normalize_before"):
                model.config.normalize_before = family.pre_norm
            if not hasattr(model.config, "normalize_embedding"):
                model.config.normalize_embedding = family.embedding_norm
            return super().get_model_spec(model)

        def set_config(self, config, model, tokenizer):
            super().set_config(config, model, tokenizer)
            config.decoder_start_token = tokenizer.convert_ids_to_tokens(model.config.decoder_start_token_id)
            if config.bos_token is None:  # a tokenizer saved without one: CTranslate2 refuses a null token
                config.bos_token = tokenizer.convert_ids_to_tokens(model.config.bos_token_id)
            note["decoder_start"] = f"decoder_start_token_id {model.config.decoder_start_token_id} " \
                                    f"({config.decoder_start_token}), as transformers"

    return ConfiguredStartLoader()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers ct2-convert")
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", default="float32")
    parser.add_argument("--output_dir", required=True, type=Path)
    args = parser.parse_args(argv)
    from ctranslate2.converters import TransformersConverter
    from ctranslate2.converters import transformers as ct2t

    model = PeerModel(Path(args.model))
    config_name = f"{type_name(model)}Config"
    stock = ct2t._MODEL_LOADERS[config_name]
    note = {"loader": f"ctranslate2 {type(stock).__name__} (stock)", "decoder_start": "zero embedding"}
    if config_name == "MarianConfig":
        patched = _learned_start_marian(stock, note)
    else:
        note["loader"] = f"ctranslate2 {type(stock).__name__}, decoder start from the config (bench.peers ct2-convert)"
        patched = _configured_start(stock, model.family(), note)

    class FamilyTokenizerConverter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return model.tokenizer()

    ct2t._MODEL_LOADERS[config_name] = patched
    try:
        FamilyTokenizerConverter(args.model).convert(str(args.output_dir), quantization=args.quantization, force=True)
    finally:
        ct2t._MODEL_LOADERS[config_name] = stock
    (args.output_dir / "bench-conversion.json").write_text(json.dumps(note))
    return 0


def type_name(model: PeerModel) -> str:
    """The transformers config class's prefix CTranslate2 registers its loader under: Marian, M2M100, MBart."""
    import transformers

    return getattr(transformers, model.family().architecture).config_class.__name__.removesuffix("Config")
