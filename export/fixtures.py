"""Local Marian model folders for tests and benchmarks: no hub needed.

`python -m export.fixtures opus-mt-random --out DIR` writes a random-weight MarianMTModel with
exactly opus-mt-en-zh's configuration and a working MarianTokenizer with 65001 ids: the same compute
per decode step as the real model, so it is the speed and memory fixture at real scale.
`tiny` writes a two-layer model small enough to export in seconds, for the test suite.
The tokenizer is written by training's own writer (train/tokenizer.py): same recipe, same checks.
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


def build(name: str, out: Path, corpus: Path = TRAIN_TSV, seed: int = 0, force: bool = False) -> Path:
    """Build fixture `name` into `out` (written to a temporary folder, then renamed)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    if name not in FIXTURES:
        raise ValueError(f"unknown fixture {name!r}; expected one of: {', '.join(FIXTURES)}")
    spec = FIXTURES[name]
    out = Path(out)
    if out.exists():
        if not force:
            raise FileExistsError(f"{out} exists; pass --force to replace it")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
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
        model.save_pretrained(tmp, safe_serialization=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.fixtures", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(FIXTURES))
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
    from transformers import MarianMTModel

    n = sum(p.numel() for p in MarianMTModel.from_pretrained(path).parameters())
    print(f"wrote {args.name} to {path}: {n / 1e6:.1f}M parameters ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
