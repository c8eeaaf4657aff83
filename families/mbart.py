"""mBART-50 (`MBartForConditionalGeneration`): pre-LN with an embedding LN and a final LN, a
learned position table (row = position + 2), the embedding scale inside `embed_tokens`,
`final_logits_bias`. Language codes as M2M100/NLLB: the source's prefixed, the target's forced first."""

from __future__ import annotations

from .bart import BART
from .fairseq import FAIRSEQ_IDS, TINY, FairseqFixture
from .family import Family

MBART = Family(
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
    layout=BART,
    label="mBART-50",
    tokenizer_files=("tokenizer_config.json", frozenset({"tokenizer.json", "sentencepiece.bpe.model"})),
    default_src_lang="en_XX",
    default_tgt_lang="zh_CN",
    example_hub_ids=("facebook/mbart-large-50-many-to-many-mmt",),
    fixtures={
        # 2+2 layers, d_model 32, a unigram tokenizer.
        "mbart50-tiny": FairseqFixture(
            family="mbart", architecture="MBartForConditionalGeneration", tokenizer_class="MBart50Tokenizer",
            spm_type="unigram", codes_module="transformers.models.mbart50.tokenization_mbart50",
            spm_size=2000, sample_pairs=4000,
            config={**TINY, "model_type": "mbart", "activation_function": "gelu", "scale_embedding": True,
                    "vocab_size": None, "tie_word_embeddings": True, "forced_eos_token_id": 2, **FAIRSEQ_IDS},
            # facebook/mbart-large-50-many-to-many-mmt's generation config
            generation={"max_length": 200, "num_beams": 5, "early_stopping": True, "forced_eos_token_id": 2},
        ),
    },
)
