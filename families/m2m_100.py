"""M2M100 / NLLB-200 (`M2M100ForConditionalGeneration`): pre-LN with a final LN, sinusoidal
positions in a `weights` buffer (row = pad + 1 + position, pad tokens read the zero row pad), the
embedding scale inside `embed_tokens`, no logits bias. The tokenizer prefixes the source with its
language code and generation forces the target's code first; the decoder starts from eos (id 2)."""

from __future__ import annotations

from .bart import BART
from .fairseq import FAIRSEQ_IDS, TINY, FairseqFixture
from .overflow import OverflowFixture
from .family import Family

# transformers 5's tokenizers-backed classes read tokenizer.json, or build it from the sentencepiece
# model; M2M100Tokenizer (sentencepiece) reads vocab.json + the model.
_FILES = ("tokenizer_config.json", frozenset({"tokenizer.json", "sentencepiece.bpe.model"}))
_NLLB = {"family": "m2m_100", "architecture": "M2M100ForConditionalGeneration", "tokenizer_class": "NllbTokenizer",
         "spm_type": "bpe", "codes_module": "transformers.models.nllb.tokenization_nllb", "codes_in_config": True}

M2M100 = Family(
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
    layout=BART,
    label="M2M100",
    labels={"NllbTokenizer": "NLLB-200", "M2M100Tokenizer": "M2M100"},
    tokenizer_files=_FILES,
    default_src_lang="eng_Latn",  # NLLB's code; M2M100Tokenizer's is "en" (tokenizer_languages)
    default_tgt_lang="zho_Hans",
    tokenizer_languages={"M2M100Tokenizer": ("en", "zh")},
    example_hub_ids=("facebook/nllb-200-distilled-600M", "facebook/m2m100_418M"),
    fixtures={
        # 2+2 layers, d_model 32, a BPE tokenizer.
        "nllb-tiny": FairseqFixture(
            **_NLLB, spm_size=2000, sample_pairs=4000,
            config={**TINY, "model_type": "m2m_100", "activation_function": "relu", "scale_embedding": True,
                    "vocab_size": None, "tie_word_embeddings": True, **FAIRSEQ_IDS},
            generation={"max_length": 200, "num_beams": 4},
        ),
        # facebook/nllb-200-distilled-600M's exact shape (615M parameters, 2.46 GB in fp32). Its
        # tokenizer is smaller than the vocabulary (the corpus cannot fill 256k pieces): the ids past
        # it are never produced but exist in the embedding and the output layer, so every step costs
        # what the real model's does.
        "nllb-600m-random": FairseqFixture(
            **_NLLB, spm_size=8000, sample_pairs=30000, character_coverage=0.9995,
            # facebook/nllb-200-distilled-600M's config.json
            config={"model_type": "m2m_100", "d_model": 1024, "encoder_layers": 12, "decoder_layers": 12,
                    "encoder_attention_heads": 16, "decoder_attention_heads": 16, "encoder_ffn_dim": 4096,
                    "decoder_ffn_dim": 4096, "max_position_embeddings": 1024, "vocab_size": 256206,
                    "activation_function": "relu", "scale_embedding": True, "dropout": 0.1,
                    "attention_dropout": 0.1, "activation_dropout": 0.0, "tie_word_embeddings": True,
                    **FAIRSEQ_IDS},
            generation={"max_length": 200},
        ),
        # `nllb-tiny` with its last decoder layer's feed-forward peaking past fp16's range: the fp16 guard's fixture.
        "nllb-tiny-overflow": OverflowFixture("nllb-tiny"),
    },
)
