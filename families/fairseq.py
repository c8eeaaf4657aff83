"""The fixture recipe NLLB and mBART-50 share: fairseq's special ids, one sentencepiece model
trained on both sides of a corpus sample, the family's language-code tokens, and transformers'
own tokenizer class writing its tokenizer.json."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

TINY = {
    "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "max_position_embeddings": 512, "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
}
# fairseq's special ids: <s> 0, <pad> 1, </s> 2 (also the decoder start).
FAIRSEQ_IDS = {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}


@dataclass(frozen=True)
class FairseqFixture:
    family: str  # its registry entry's name
    architecture: str  # transformers model class
    tokenizer_class: str
    spm_type: str  # "bpe" (NLLB) or "unigram" (mBART-50), as the published models
    spm_size: int
    sample_pairs: int
    config: dict  # the model config (vocab_size None: the tokenizer's size)
    generation: dict  # generation_config.json beyond the special ids
    # The transformers module whose FAIRSEQ_LANGUAGE_CODES the tokenizer class knows, and whether
    # tokenizer_config.json must list them (NllbTokenizer reads them as extra special tokens).
    codes_module: str = ""
    codes_in_config: bool = False
    character_coverage: float = 0.98

    def language_codes(self) -> list[str]:
        import importlib

        return list(importlib.import_module(self.codes_module).FAIRSEQ_LANGUAGE_CODES)

    def write_tokenizer(self, out: Path, pairs: list[tuple[str, str]]):
        """Train the sentencepiece model on both sides of `pairs` (one shared vocabulary, as NLLB and
        mBART-50 have), then let transformers' own class build and save its tokenizer.json from it."""
        import sentencepiece as spm
        import transformers

        from . import FAMILIES, default_languages

        src_lang, tgt_lang = default_languages(FAMILIES[self.family], self.tokenizer_class)
        with tempfile.TemporaryDirectory(prefix="spm-") as work:
            work = Path(work)
            text = work / "corpus.txt"
            text.write_text("\n".join(x for pair in pairs for x in pair) + "\n", encoding="utf-8")
            # fairseq's layout: <unk> 0, <s> 1, </s> 2 in the spm model; the tokenizer class reorders
            # them to <s> 0, <pad> 1, </s> 2, <unk> 3 and appends the language codes and <mask>.
            spm.SentencePieceTrainer.train(
                input=str(text), model_prefix=str(work / "sentencepiece.bpe"), model_type=self.spm_type,
                vocab_size=self.spm_size, character_coverage=self.character_coverage, hard_vocab_limit=False,
                split_digits=True, num_threads=1, minloglevel=2, input_sentence_size=0,
            )
            config = {"tokenizer_class": self.tokenizer_class, "src_lang": src_lang, "tgt_lang": tgt_lang,
                      "model_max_length": self.config["max_position_embeddings"]}
            if self.codes_in_config:
                config["extra_special_tokens"] = self.language_codes()
            (work / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
            tokenizer = getattr(transformers, self.tokenizer_class).from_pretrained(str(work))
            tokenizer.save_pretrained(str(out))
        tokenizer = getattr(transformers, self.tokenizer_class).from_pretrained(str(out), src_lang=src_lang)
        ids = tokenizer("Click OK to save the document.").input_ids
        expected_first = tokenizer.convert_tokens_to_ids(src_lang)
        if ids[0] != expected_first or ids[-1] != tokenizer.eos_token_id or tokenizer.unk_token_id in ids:
            raise AssertionError(f"{self.tokenizer_class} fixture encodes a test sentence as {ids}")
        return tokenizer

    def build(self, out: Path, pairs: list[tuple[str, str]], seed: int) -> None:
        import torch
        import transformers

        tokenizer = self.write_tokenizer(out, pairs)
        config_dict = dict(self.config)
        if config_dict["vocab_size"] is None:
            config_dict["vocab_size"] = len(tokenizer)
        model_class = getattr(transformers, self.architecture)
        config = model_class.config_class(**{k: v for k, v in config_dict.items() if k != "model_type"},
                                          architectures=[self.architecture])
        torch.manual_seed(seed)
        model = model_class(config).eval()
        for key, value in {**FAIRSEQ_IDS, **self.generation}.items():
            setattr(model.generation_config, key, value)
        model.save_pretrained(out, safe_serialization=True)
