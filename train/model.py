"""The MarianConfig of the shipped model: opus-mt-en-zh's family, scaled down for 2 CPU cores."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSize:
    # The shipped model's size: the largest that trains on two cores in a few sessions and stays
    # under the demo's limit of 30M parameters / 120 MB (train/README.md has the measurements).
    d_model: int = 384
    heads: int = 6
    ffn: int = 1536
    encoder_layers: int = 6
    # A shallower decoder: decoding cost is per generated token, encoding once per sentence.
    decoder_layers: int = 3
    dropout: float = 0.1


def build_config(vocab_size: int, size: ModelSize = ModelSize()):
    from transformers import MarianConfig

    pad = vocab_size - 1
    # Generation settings (bad_words_ids, max_length, num_beams) live in generation_config();
    # transformers 5 no longer keeps them on the model config.
    return MarianConfig(
        vocab_size=vocab_size,
        d_model=size.d_model,
        encoder_layers=size.encoder_layers,
        decoder_layers=size.decoder_layers,
        encoder_attention_heads=size.heads,
        decoder_attention_heads=size.heads,
        encoder_ffn_dim=size.ffn,
        decoder_ffn_dim=size.ffn,
        activation_function="swish",
        dropout=size.dropout,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=512,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        bos_token_id=0,
        architectures=["MarianMTModel"],
    )


def build_model(vocab_size: int, size: ModelSize = ModelSize(), seed: int = 1234):
    import torch
    from transformers import MarianMTModel

    torch.manual_seed(seed)
    return MarianMTModel(build_config(vocab_size, size))


def generation_config(config, num_beams: int = 1, repetition_penalty: float = 1.0, no_repeat_ngram_size: int = 0):
    """The shipped decoding setting; the backends read it from here (via the export manifest).

    The defaults are plain greedy search; `python -m train` passes the setting chosen on dev.tsv.
    """
    from transformers import GenerationConfig

    pad = config.pad_token_id
    return GenerationConfig(
        decoder_start_token_id=pad, pad_token_id=pad, eos_token_id=0, bos_token_id=0,
        bad_words_ids=[[pad]], max_length=512, num_beams=num_beams, do_sample=False,
        repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
    )


def count_parameters(model) -> int:
    """Unique parameters: the tied embedding/output matrix counts once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
