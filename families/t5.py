"""T5 (`T5ForConditionalGeneration`: T5, T5 v1.1, MADLAD-400) and mT5 (`MT5ForConditionalGeneration`,
the same modules), with a layout of their own, not BART's:
relative position buckets (one bias table per stack, in its first block, shared by the others), RMS LayerNorm without bias before each sub-layer and after each stack,
unscaled attention scores, a ReLU (T5) or gated-GELU (v1.1, mT5, MADLAD) feed-forward, the output
layer rescaled by `d_model ** -0.5` when it is tied to the embedding, and the decoder starting from
`decoder_start_token_id` (T5's pad 0; MADLAD's 0 is unk, its pad 1). MADLAD-400 names the target language with a token such as `<2zh>` before the source text; a
T5 vocabulary without such tokens has no language codes."""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .family import Family, Layout
from .overflow import OverflowFixture

# A T5 model has no position table; its published checkpoints were trained on inputs of this
# many tokens, which is the limit the export and the app read (the sidecar's "limits").
T5_POSITIONS = 512

# The self-attention's q, k and v are one packed MatMul in the KV-cache graphs (T5's projections
# have no bias to tell them apart after it), so locate reports the attention whole; the
# cross-attention's are computed apart (q in the decoder step, k and v in the encoder graph).
_ENCODER_PARTS = ("layer.0.layer_norm", "layer.0.SelfAttention", "layer.1.layer_norm", "layer.1.DenseReluDense")
_DECODER_PARTS = ("layer.0.layer_norm", "layer.0.SelfAttention", "layer.1.layer_norm", "layer.1.EncDecAttention.q",
                  "layer.1.EncDecAttention.k", "layer.1.EncDecAttention.v", "layer.1.EncDecAttention",
                  "layer.2.layer_norm", "layer.2.DenseReluDense")


class T5Naming:
    """HF's module paths: `encoder.block.N.layer.0.SelfAttention.q`, `decoder.final_layer_norm`, `lm_head`."""

    wrapper_scopes = {
        "export.t5_wrappers.EncoderWithCrossKV": (
            (r"^block\.", "encoder.block."),
            (r"^cross_attn\.(\d+)(?=\.|$)", r"decoder.block.\1.layer.1.EncDecAttention"),
            (r"^embed_tokens$", "encoder.embed_tokens"),
            (r"^final_layer_norm$", "encoder.final_layer_norm"),
        ),
        "export.t5_wrappers.DecoderStepWithCache": (
            (r"^block\.", "decoder.block."),
            (r"^embed_tokens$", "decoder.embed_tokens"),
            (r"^final_layer_norm$", "decoder.final_layer_norm"),
            (r"^lm_head$", "lm_head"),
        ),
    }
    hf_path = re.compile(
        r"(?:^|\.)((?:encoder|decoder)\.(?:block\.\d+(?:\.\w+)*|embed_tokens|final_layer_norm)|lm_head)$"
    )
    over_source = re.compile(r"^decoder\.block\.\d+\.layer\.1\.EncDecAttention\.[kv]$")

    def order(self, family, encoder_layers: int, decoder_layers: int) -> list[str]:
        """Every module locate compares, in execution order."""

        def stack(side: str, layers: int, parts) -> list[str]:
            return [f"{side}.embed_tokens", *(f"{side}.block.{i}.{p}" for i in range(layers) for p in parts),
                    f"{side}.final_layer_norm"]

        return [*stack("encoder", encoder_layers, _ENCODER_PARTS), *stack("decoder", decoder_layers, _DECODER_PARTS),
                "lm_head"]


def t5_shape(config) -> dict:
    """The sidecar's "model" facts from a T5 config (`num_layers`, `d_kv`, `d_ff`...)."""
    return {
        "d_model": config.d_model,
        "encoder_layers": config.num_layers,
        "decoder_layers": config.num_decoder_layers,
        "encoder_attention_heads": config.num_heads,
        "decoder_attention_heads": config.num_heads,
        "head_dim": config.d_kv,  # T5's d_kv need not be d_model / heads (MADLAD-3B: 128 x 16 over 1024)
        "encoder_ffn_dim": config.d_ff,
        "decoder_ffn_dim": config.d_ff,
        "activation_function": config.feed_forward_proj,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": getattr(config, "n_positions", None) or T5_POSITIONS,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "relative_attention_max_distance": config.relative_attention_max_distance,
        "output_scaled": bool(getattr(config, "scale_decoder_outputs", False)),
    }


T5_LAYOUT = Layout(name="t5", wrappers="export.t5_wrappers", attention="export.attention", naming=T5Naming(),
                   shape=t5_shape)

@dataclass(frozen=True)
class SpecialIds:
    """Where a sentencepiece model puts its special pieces, and the config ids that follow."""

    spm: dict  # SentencePieceTrainer's unk_id, bos_id, eos_id, pad_id (-1: none)
    config: dict  # pad_token_id, eos_token_id, decoder_start_token_id
    pad_token: str | None = None  # the tokenizer's pad piece, where the spm model has no pad of its own


# T5's sentencepiece layout: pad 0 (also the decoder start), eos 1, unk 2, no bos.
T5_IDS = SpecialIds(spm={"pad_id": 0, "eos_id": 1, "unk_id": 2, "bos_id": -1},
                    config={"pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0})
# MADLAD-400's (its config.json and tokenizer_config.json): unk 0, <s> 1 serving as pad, eos 2, and
# the decoder starting from 0 (unk), not from pad.
MADLAD_IDS = SpecialIds(spm={"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1},
                        config={"pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}, pad_token="<s>")
# MADLAD-400's target-language tokens look like this; a few of them in the tiny fixture.
TARGET_TOKEN = "<2{}>"
_FIXTURE_LANGUAGES = ("zh", "en", "de", "fr", "ja", "es")


@dataclass(frozen=True)
class T5Fixture:
    """A random-weight T5 folder: a unigram sentencepiece model trained on both sides of a corpus
    sample (T5's ids: pad 0, eos 1, unk 2), MADLAD's `<2xx>` tokens where `target_tokens`, and the
    model saved tied (the output layer is the embedding, rescaled) or untied as `config` says.

    `streamed` writes the weights block by block without ever holding the model (`random_weights`),
    for the fixtures at a published model's full size; its vocabulary may then be larger than the
    tokenizer's (a corpus sample cannot fill 256k pieces), as in `nllb-600m-random`."""

    config: dict
    spm_size: int
    sample_pairs: int
    target_tokens: bool = False
    extra_ids: int = 0
    generation: dict = field(default_factory=dict, hash=False)
    architecture: str = "T5ForConditionalGeneration"  # or mT5's class, the same layout
    ids: SpecialIds = T5_IDS
    streamed: bool = False
    character_coverage: float = 0.98

    def write_tokenizer(self, out: Path, pairs: list[tuple[str, str]]):
        import sentencepiece as spm
        import transformers

        symbols = [TARGET_TOKEN.format(code) for code in _FIXTURE_LANGUAGES] if self.target_tokens else []
        with tempfile.TemporaryDirectory(prefix="spm-") as work:
            work = Path(work)
            text = work / "corpus.txt"
            text.write_text("\n".join(x for pair in pairs for x in pair) + "\n", encoding="utf-8")
            spm.SentencePieceTrainer.train(
                input=str(text), model_prefix=str(work / "spiece"), model_type="unigram", vocab_size=self.spm_size,
                character_coverage=self.character_coverage, hard_vocab_limit=False, num_threads=1, minloglevel=2,
                input_sentence_size=0, user_defined_symbols=symbols, **self.ids.spm,
            )
            settings = {"tokenizer_class": "T5Tokenizer", "extra_ids": self.extra_ids, "model_max_length": T5_POSITIONS}
            if self.ids.pad_token:
                settings["pad_token"] = self.ids.pad_token
            (work / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
            tokenizer = transformers.T5Tokenizer.from_pretrained(str(work))
            tokenizer.save_pretrained(str(out))
        tokenizer = transformers.T5Tokenizer.from_pretrained(str(out))
        text = (TARGET_TOKEN.format("zh") + " " if self.target_tokens else "") + "Click OK to save the document."
        ids = tokenizer(text).input_ids
        expected = (self.ids.config["pad_token_id"], self.ids.config["eos_token_id"])
        if (tokenizer.pad_token_id, tokenizer.eos_token_id) != expected:
            raise AssertionError(f"T5Tokenizer fixture has pad, eos {tokenizer.pad_token_id, tokenizer.eos_token_id}, "
                                 f"not {expected}")
        if ids[-1] != tokenizer.eos_token_id or tokenizer.unk_token_id in ids or (
                self.target_tokens and tokenizer.convert_ids_to_tokens(ids[0]) != TARGET_TOKEN.format("zh")):
            raise AssertionError(f"T5Tokenizer fixture encodes {text!r} as {ids}")
        return tokenizer

    def build(self, out: Path, pairs: list[tuple[str, str]], seed: int) -> None:
        import transformers

        from . import random_weights

        tokenizer = self.write_tokenizer(out, pairs)
        model_class = getattr(transformers, self.architecture)
        config = model_class.config_class(
            **{**self.config, **self.ids.config, "vocab_size": self.config.get("vocab_size") or len(tokenizer)},
            architectures=[self.architecture])
        tied = self.config.get("tie_word_embeddings", True)
        if self.streamed:
            config.save_pretrained(out)
            generation = transformers.GenerationConfig.from_model_config(config)
            for key, value in {**self.ids.config, **self.generation}.items():
                setattr(generation, key, value)
            generation.save_pretrained(out)
            random_weights.write(model_class, config, out / "model.safetensors", seed, _T5_UNITS,
                                 untie={} if tied else {"lm_head": 1.0})
        else:
            self._save(model_class, config, out, seed, tied)
        if not tied:
            data = json.loads((out / "config.json").read_text(encoding="utf-8"))
            data["tie_word_embeddings"] = False
            data.pop("scale_decoder_outputs", None)
            (out / "config.json").write_text(json.dumps(data, indent=2), encoding="utf-8")

    def _save(self, model_class, config, out: Path, seed: int, tied: bool) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        torch.manual_seed(seed)
        model = model_class(config).eval()
        for key, value in {**self.ids.config, **self.generation}.items():
            setattr(model.generation_config, key, value)
        model.save_pretrained(out, safe_serialization=True)
        if not tied:
            # transformers ties T5's output layer to the embedding whatever the config says, unless the
            # checkpoint holds an lm_head of its own: write one, as MADLAD's and T5 v1.1's files do.
            weights = out / "model.safetensors"
            tensors = load_file(str(weights))
            generator = torch.Generator().manual_seed(seed + 1)
            tensors["lm_head.weight"] = torch.randn(tensors["shared.weight"].shape, generator=generator)
            save_file(tensors, str(weights), metadata={"format": "pt"})


# The sub-layers whose init sets their children's weights (T5Attention its q/k/v/o, the feed-forward its wi/wo).
_T5_UNITS = ("T5LayerSelfAttention", "T5LayerCrossAttention", "T5LayerFF")

_TINY = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
         "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "dropout_rate": 0.1,
         "layer_norm_epsilon": 1e-6}
# google/madlad400-3b-mt's config.json (its special ids are MADLAD_IDS).
MADLAD_3B = {"d_model": 1024, "d_kv": 128, "d_ff": 8192, "num_layers": 32, "num_decoder_layers": 32, "num_heads": 16,
             "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "dropout_rate": 0.1,
             "layer_norm_epsilon": 1e-6, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
             "vocab_size": 256000}
_FILES = ("tokenizer_config.json", frozenset({"tokenizer.json", "spiece.model"}))

T5 = Family(
    name="t5",
    title="T5/MADLAD-400",
    model_type="t5",
    architecture="T5ForConditionalGeneration",
    tokenizer_classes=("T5Tokenizer", "T5TokenizerFast"),
    pre_norm=True,
    positions="relative",
    position_offset=0,
    embedding_norm=False,
    final_norm=True,
    logits_bias=False,
    layout=T5_LAYOUT,
    label="T5",
    tokenizer_files=_FILES,
    target_token=TARGET_TOKEN,
    default_tgt_lang="zh",
    example_hub_ids=("google/madlad400-3b-mt", "google-t5/t5-small"),
    fixtures={
        # Original T5: ReLU, the output layer tied to the embedding (and rescaled), 100 sentinel ids.
        "t5-tiny": T5Fixture(config={**_TINY, "feed_forward_proj": "relu"}, spm_size=2000, sample_pairs=4000,
                             extra_ids=100),
        # MADLAD-400's structure: gated-GELU, d_kv not d_model / heads, an untied output layer, `<2xx>` tokens.
        "madlad-tiny": T5Fixture(config={**_TINY, "d_kv": 16, "feed_forward_proj": "gated-gelu",
                                         "tie_word_embeddings": False},
                                 spm_size=2000, sample_pairs=4000, target_tokens=True, ids=MADLAD_IDS),
        # google/madlad400-3b-mt's exact configuration (2.94B parameters, 11.8 GB in fp32), written
        # block by block; its tokenizer is smaller than the 256,000-id vocabulary, as nllb-600m-random's.
        "madlad-3b-random": T5Fixture(config=MADLAD_3B, spm_size=8000, sample_pairs=30000, character_coverage=0.9995,
                                      target_tokens=True, ids=MADLAD_IDS, streamed=True),
        # `madlad-tiny` with its last decoder block's feed-forward peaking past fp16's range: the guard on T5.
        "madlad-tiny-overflow": OverflowFixture("madlad-tiny"),
    },
)


# mT5: T5 v1.1's structure under its own class and model_type; its checkpoints are untied and never
# rescale the output layer's input. No language codes (a task prefix, if any, is the user's text).
MT5 = Family(
    name="mt5",
    title="mT5",
    model_type="mt5",
    architecture="MT5ForConditionalGeneration",
    tokenizer_classes=("T5Tokenizer", "T5TokenizerFast"),
    pre_norm=True,
    positions="relative",
    position_offset=0,
    embedding_norm=False,
    final_norm=True,
    logits_bias=False,
    layout=T5_LAYOUT,
    label="mT5",
    tokenizer_files=_FILES,
    example_hub_ids=("google/mt5-small",),
    fixtures={
        "mt5-tiny": T5Fixture(config={**_TINY, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
                              spm_size=2000, sample_pairs=4000, architecture="MT5ForConditionalGeneration"),
    },
)
