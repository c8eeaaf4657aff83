"""Marian (`MarianMTModel`, the opus-mt models and the embedded model): post-LN, sinusoidal
positions (row = position), `embed_scale` on the stack, `final_logits_bias`; one language pair
per model, so no language codes."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .bart import BART
from .family import Family
from .overflow import OverflowFixture


@dataclass(frozen=True)
class MarianFixture:
    """A random-weight Marian folder whose tokenizer is written by training's own writer
    (train/tokenizer.py): same recipe, same checks as the shipped model."""

    # Sentencepiece vocabulary sizes (<unk> and </s> included), trained on a corpus sample; the
    # joint vocab.json is then padded with unused entries up to `vocab_size` so the embedding has
    # the intended shape.
    source_spm_size: int
    target_spm_size: int
    vocab_size: int
    sample_pairs: int
    # Chinese has thousands of characters; a small target vocabulary must leave rare ones to <unk>.
    target_coverage: float = 0.9995
    # opus-mt-en-zh's own config.json and decoding settings, else the two-layer `tiny_config`.
    published_shape: bool = False

    def write_tokenizer(self, out: Path, pairs: list[tuple[str, str]]) -> int:
        """Write source.spm, target.spm, vocab.json and tokenizer_config.json; return the vocab size."""
        from train.tokenizer import train_spm, write_tokenizer

        with tempfile.TemporaryDirectory(prefix="spm-") as spm_dir:
            source = train_spm([en for en, _ in pairs], Path(spm_dir) / "source", self.source_spm_size, 1.0)
            # identity normalisation, as training: Chinese text comes back with its full-width punctuation.
            target = train_spm(
                [zh for _, zh in pairs], Path(spm_dir) / "target", self.target_spm_size, self.target_coverage, "identity"
            )
            samples = [zh for _, zh in pairs[:: max(1, len(pairs) // 200)]]
            tokenizer = write_tokenizer(out, source, target, samples, self.vocab_size)
        return len(tokenizer.get_vocab())

    def build(self, out: Path, pairs: list[tuple[str, str]], seed: int) -> None:
        import torch
        from transformers import MarianConfig, MarianMTModel

        from corpus import REFERENCE_CONFIG

        vocab_size = self.write_tokenizer(out, pairs)
        if self.published_shape:
            config_dict = json.loads(REFERENCE_CONFIG.read_text(encoding="utf-8"))
            if config_dict["vocab_size"] != vocab_size:
                raise AssertionError(f"tokenizer has {vocab_size} ids, config expects {config_dict['vocab_size']}")
        else:
            config_dict = tiny_config(vocab_size)
        config = MarianConfig(**{k: v for k, v in config_dict.items() if not k.startswith("_")})
        torch.manual_seed(seed)
        model = MarianMTModel(config).eval()
        if self.published_shape:
            # transformers 5 no longer derives decoding settings from config.json; the published
            # model's (4 beams, its bad word, max_length 512) are what its users run: keep them.
            for key in ("num_beams", "max_length", "bad_words_ids"):
                setattr(model.generation_config, key, config_dict[key])
            model.generation_config._from_model_config = False  # a file of its own, not re-derived
        model.save_pretrained(out, safe_serialization=True)


def tiny_config(vocab_size: int) -> dict:
    pad = vocab_size - 1
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "activation_function": "swish",
        "d_model": 32,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "max_position_embeddings": 512,
        "scale_embedding": True,
        "static_position_embeddings": True,
        "normalize_before": False,
        "vocab_size": vocab_size,
        "decoder_vocab_size": vocab_size,
        "pad_token_id": pad,
        "decoder_start_token_id": pad,
        "eos_token_id": 0,
        "bos_token_id": 0,
        "bad_words_ids": [[pad]],
        "max_length": 512,
        "num_beams": 1,
        "dropout": 0.1,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
    }


MARIAN = Family(
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
    layout=BART,
    label="Marian",
    tokenizer_files=("source.spm", "target.spm", "vocab.json"),
    export_tokenizer_files=("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"),
    # save_pretrained writes these too; a Marian export's tokenizer is the four files above alone.
    unsaved_tokenizer_files=("added_tokens.json", "special_tokens_map.json"),
    bans_pad=True,
    example_hub_ids=("Helsinki-NLP/opus-mt-en-zh",),
    fixtures={
        # 1302 ids, the size it had before it used training's recipe (whose pieces fill 1299 of them).
        "tiny": MarianFixture(
            source_spm_size=400, target_spm_size=1000, vocab_size=1302, sample_pairs=4000, target_coverage=0.98
        ),
        # opus-mt-en-zh's exact configuration and a working tokenizer with 65001 ids: the same compute
        # per decode step as the real model, the speed and memory fixture at real scale.
        "opus-mt-random": MarianFixture(
            source_spm_size=4000, target_spm_size=4000, vocab_size=65001, sample_pairs=30000, published_shape=True
        ),
        # `tiny` with its last decoder layer's feed-forward peaking past fp16's range: the fp16 guard's fixture.
        "tiny-overflow": OverflowFixture("tiny"),
    },
)
