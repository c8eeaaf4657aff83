"""Local model folders for tests and benchmarks, one per family: no hub needed.

`python -m export.fixtures opus-mt-random --out DIR` writes a random-weight MarianMTModel with
exactly opus-mt-en-zh's configuration and a working MarianTokenizer with 65001 ids: the same compute
per decode step as the real model, so it is the speed and memory fixture at real scale.
`tiny` writes a two-layer model small enough to export in seconds, for the test suite.
The Marian tokenizer is written by training's own writer (train/tokenizer.py): same recipe, same checks.

The other families (export/families.py), random weights and a sentencepiece model trained on the
corpus, with the family's language-code tokens and its transformers 5 tokenizer class:
- `nllb-tiny`: M2M100ForConditionalGeneration + NllbTokenizer (BPE), 2+2 layers, d_model 32.
- `mbart50-tiny`: MBartForConditionalGeneration + MBart50Tokenizer (unigram), 2+2 layers, d_model 32.
- `nllb-600m-random`: facebook/nllb-200-distilled-600M's exact shape (d_model 1024, 12+12 layers,
  16 heads, ffn 4096, vocabulary 256,206: 615M parameters, 2.46 GB in fp32). Its tokenizer is
  smaller than the vocabulary (the corpus cannot fill 256k pieces): the ids past it are never
  produced by the tokenizer but exist in the embedding and the output layer, so every step costs
  what the real model's does.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from corpus import REFERENCE_CONFIG, TRAIN_TSV, read_pairs as read_corpus


@dataclass(frozen=True)
class FixtureSpec:
    # Sentencepiece vocabulary sizes (<unk> and </s> included), trained on a corpus sample; the
    # joint vocab.json is then padded with unused entries up to `vocab_size` so the embedding has
    # the intended shape.
    source_spm_size: int
    target_spm_size: int
    vocab_size: int
    sample_pairs: int
    # Chinese has thousands of characters; a small target vocabulary must leave rare ones to <unk>.
    target_coverage: float = 0.9995


FIXTURES = {
    # 1302 ids, the size it had before it used training's recipe (whose pieces fill 1299 of them).
    "tiny": FixtureSpec(
        source_spm_size=400, target_spm_size=1000, vocab_size=1302, sample_pairs=4000, target_coverage=0.98
    ),
    "opus-mt-random": FixtureSpec(
        source_spm_size=4000, target_spm_size=4000, vocab_size=65001, sample_pairs=30000
    ),
}


def read_pairs(path: Path, limit: int, seed: int = 0) -> list[tuple[str, str]]:
    """Sample `limit` (en, zh) pairs of a corpus TSV (data/train.tsv.gz by default) with a fixed seed."""
    pairs = [(p.en, p.zh) for p in read_corpus(path, require_zh=True)]
    random.Random(seed).shuffle(pairs)
    return pairs[:limit]


def write_tokenizer(out: Path, pairs: list[tuple[str, str]], spec: FixtureSpec) -> int:
    """Write source.spm, target.spm, vocab.json and tokenizer_config.json; return the vocab size.

    Training's recipe and writer (train/tokenizer.py), so a fixture follows the conventions the
    shipped model does and passes the same `check_tokenizer` on a sample of its targets.
    """
    from train.tokenizer import train_spm, write_tokenizer as write_marian_tokenizer

    with tempfile.TemporaryDirectory(prefix="spm-") as spm_dir:
        source = train_spm([en for en, _ in pairs], Path(spm_dir) / "source", spec.source_spm_size, 1.0)
        # identity normalisation, as training: Chinese text comes back with its full-width punctuation.
        target = train_spm(
            [zh for _, zh in pairs], Path(spm_dir) / "target", spec.target_spm_size, spec.target_coverage, "identity"
        )
        samples = [zh for _, zh in pairs[:: max(1, len(pairs) // 200)]]
        tokenizer = write_marian_tokenizer(out, source, target, samples, spec.vocab_size)
    return len(tokenizer.get_vocab())


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


@dataclass(frozen=True)
class FamilyFixture:
    """A non-Marian fixture: its family's config and tokenizer, trained on a corpus sample."""

    architecture: str  # transformers model class
    tokenizer_class: str
    spm_type: str  # "bpe" (NLLB) or "unigram" (mBART-50), as the published models
    spm_size: int
    sample_pairs: int
    config: dict  # the model config (vocab_size None: the tokenizer's size)
    generation: dict  # generation_config.json beyond the special ids
    character_coverage: float = 0.98


_TINY = {
    "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "max_position_embeddings": 512, "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
}
# fairseq's special ids, shared by M2M100/NLLB and mBART-50: <s> 0, <pad> 1, </s> 2 (also the decoder start).
_FAIRSEQ_IDS = {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2}

FAMILY_FIXTURES = {
    "nllb-tiny": FamilyFixture(
        architecture="M2M100ForConditionalGeneration", tokenizer_class="NllbTokenizer", spm_type="bpe",
        spm_size=2000, sample_pairs=4000,
        config={**_TINY, "model_type": "m2m_100", "activation_function": "relu", "scale_embedding": True,
                "vocab_size": None, "tie_word_embeddings": True, **_FAIRSEQ_IDS},
        generation={"max_length": 200, "num_beams": 4},
    ),
    "mbart50-tiny": FamilyFixture(
        architecture="MBartForConditionalGeneration", tokenizer_class="MBart50Tokenizer", spm_type="unigram",
        spm_size=2000, sample_pairs=4000,
        config={**_TINY, "model_type": "mbart", "activation_function": "gelu", "scale_embedding": True,
                "vocab_size": None, "tie_word_embeddings": True, "forced_eos_token_id": 2, **_FAIRSEQ_IDS},
        # facebook/mbart-large-50-many-to-many-mmt's generation config
        generation={"max_length": 200, "num_beams": 5, "early_stopping": True, "forced_eos_token_id": 2},
    ),
    "nllb-600m-random": FamilyFixture(
        architecture="M2M100ForConditionalGeneration", tokenizer_class="NllbTokenizer", spm_type="bpe",
        spm_size=8000, sample_pairs=30000, character_coverage=0.9995,
        # facebook/nllb-200-distilled-600M's config.json
        config={"model_type": "m2m_100", "d_model": 1024, "encoder_layers": 12, "decoder_layers": 12,
                "encoder_attention_heads": 16, "decoder_attention_heads": 16, "encoder_ffn_dim": 4096,
                "decoder_ffn_dim": 4096, "max_position_embeddings": 1024, "vocab_size": 256206,
                "activation_function": "relu", "scale_embedding": True, "dropout": 0.1,
                "attention_dropout": 0.1, "activation_dropout": 0.0, "tie_word_embeddings": True, **_FAIRSEQ_IDS},
        generation={"max_length": 200},
    ),
}


def language_codes(tokenizer_class: str) -> list[str]:
    """The language codes transformers 5 ships for a tokenizer class (FAIRSEQ_LANGUAGE_CODES)."""
    if tokenizer_class == "NllbTokenizer":
        from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES
    else:
        from transformers.models.mbart50.tokenization_mbart50 import FAIRSEQ_LANGUAGE_CODES
    return list(FAIRSEQ_LANGUAGE_CODES)


def write_family_tokenizer(out: Path, pairs: list[tuple[str, str]], spec: FamilyFixture):
    """Train the sentencepiece model on both sides of `pairs` (one shared vocabulary, as NLLB and
    mBART-50 have), then let transformers' own class build and save its tokenizer.json from it."""
    import sentencepiece as spm
    import transformers

    from .families import FAMILIES, default_languages

    family = next(f for f in FAMILIES.values() if f.architecture == spec.architecture)
    src_lang, tgt_lang = default_languages(family, spec.tokenizer_class)
    with tempfile.TemporaryDirectory(prefix="spm-") as work:
        work = Path(work)
        text = work / "corpus.txt"
        text.write_text("\n".join(x for pair in pairs for x in pair) + "\n", encoding="utf-8")
        # fairseq's layout: <unk> 0, <s> 1, </s> 2 in the spm model; the tokenizer class reorders
        # them to <s> 0, <pad> 1, </s> 2, <unk> 3 and appends the language codes and <mask>.
        spm.SentencePieceTrainer.train(
            input=str(text), model_prefix=str(work / "sentencepiece.bpe"), model_type=spec.spm_type,
            vocab_size=spec.spm_size, character_coverage=spec.character_coverage, hard_vocab_limit=False,
            split_digits=True, num_threads=1, minloglevel=2, input_sentence_size=0,
        )
        config = {"tokenizer_class": spec.tokenizer_class, "src_lang": src_lang, "tgt_lang": tgt_lang,
                  "model_max_length": spec.config["max_position_embeddings"]}
        if spec.tokenizer_class == "NllbTokenizer":
            config["extra_special_tokens"] = language_codes(spec.tokenizer_class)
        (work / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        tokenizer = getattr(transformers, spec.tokenizer_class).from_pretrained(str(work))
        tokenizer.save_pretrained(str(out))
    tokenizer = getattr(transformers, spec.tokenizer_class).from_pretrained(str(out), src_lang=src_lang)
    ids = tokenizer("Click OK to save the document.").input_ids
    expected_first = tokenizer.convert_tokens_to_ids(src_lang)
    if ids[0] != expected_first or ids[-1] != tokenizer.eos_token_id or tokenizer.unk_token_id in ids:
        raise AssertionError(f"{spec.tokenizer_class} fixture encodes a test sentence as {ids}")
    return tokenizer


def build_family(name: str, tmp: Path, pairs: list[tuple[str, str]], seed: int) -> None:
    import torch
    import transformers

    spec = FAMILY_FIXTURES[name]
    tokenizer = write_family_tokenizer(tmp, pairs, spec)
    config_dict = dict(spec.config)
    if config_dict["vocab_size"] is None:
        config_dict["vocab_size"] = len(tokenizer)
    model_class = getattr(transformers, spec.architecture)
    config = model_class.config_class(**{k: v for k, v in config_dict.items() if k != "model_type"},
                                      architectures=[spec.architecture])
    torch.manual_seed(seed)
    model = model_class(config).eval()
    for key, value in {**_FAIRSEQ_IDS, **spec.generation}.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(tmp, safe_serialization=True)


def build(name: str, out: Path, corpus: Path = TRAIN_TSV, seed: int = 0, force: bool = False) -> Path:
    """Build fixture `name` into `out` (written to a temporary folder, then renamed)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    if name not in FIXTURES and name not in FAMILY_FIXTURES:
        raise ValueError(f"unknown fixture {name!r}; expected one of: {', '.join([*FIXTURES, *FAMILY_FIXTURES])}")
    out = Path(out)
    if out.exists():
        if not force:
            raise FileExistsError(f"{out} exists; pass --force to replace it")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if name in FAMILY_FIXTURES:
            build_family(name, tmp, read_pairs(corpus, FAMILY_FIXTURES[name].sample_pairs, seed), seed)
            tmp.rename(out)
            return out
        spec = FIXTURES[name]
        pairs = read_pairs(corpus, spec.sample_pairs, seed)
        vocab_size = write_tokenizer(tmp, pairs, spec)
        if name == "opus-mt-random":
            config_dict = json.loads(REFERENCE_CONFIG.read_text(encoding="utf-8"))
            if config_dict["vocab_size"] != vocab_size:
                raise AssertionError(f"tokenizer has {vocab_size} ids, config expects {config_dict['vocab_size']}")
        else:
            config_dict = tiny_config(vocab_size)
        config = MarianConfig(**{k: v for k, v in config_dict.items() if not k.startswith("_")})
        torch.manual_seed(seed)
        model = MarianMTModel(config).eval()
        if name == "opus-mt-random":
            # transformers 5 no longer derives decoding settings from config.json; the published
            # model's (4 beams, its bad word, max_length 512) are what its users run: keep them.
            for key in ("num_beams", "max_length", "bad_words_ids"):
                setattr(model.generation_config, key, config_dict[key])
            model.generation_config._from_model_config = False  # a file of its own, not re-derived
        model.save_pretrained(tmp, safe_serialization=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.fixtures", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted([*FIXTURES, *FAMILY_FIXTURES]))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, default=TRAIN_TSV, help="training pairs TSV (default data/train.tsv.gz)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = build(args.name, args.out, args.corpus, args.seed, args.force)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import numpy as np
    from safetensors import safe_open

    # Counted from the file's tensor shapes (tied weights stored once), without loading the model.
    with safe_open(str(path / "model.safetensors"), "np") as f:
        n = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    print(f"wrote {args.name} to {path}: {n / 1e6:.1f}M parameters ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
