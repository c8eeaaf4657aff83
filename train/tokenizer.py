"""SentencePiece training and the MarianTokenizer files (source.spm, target.spm, vocab.json,
tokenizer_config.json): the one writer, used by training (`python -m train`) and by the test and
benchmark fixtures (`python -m export.fixtures`).

Conventions (opus-mt-en-zh's, and what the backends and `check_tokenizer` rely on): `</s>` = 0,
`<unk>` = 1, the pieces of both languages in one joint vocab.json, `<pad>` as the last id (also the
decoder start token). The spm models carry `<unk>` and `</s>` as their own ids 0 and 1.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import sentencepiece as spm

if TYPE_CHECKING:
    from transformers import MarianTokenizer

logger = logging.getLogger(__name__)

EOS, UNK, PAD = "</s>", "<unk>", "<pad>"


def train_spm(lines: list[str], prefix: Path, vocab_size: int, character_coverage: float,
              normalization: str = "nmt_nfkc") -> Path:
    """Train a unigram model on `lines`; returns the .model path.

    Deterministic: every line is used (no sampling), so no seed is needed.
    """
    prefix.parent.mkdir(parents=True, exist_ok=True)
    text_path = prefix.with_suffix(".txt")
    text_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text_path),
        model_prefix=str(prefix),
        model_type="unigram",
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        # Only unk and eos; the decoder starts from <pad>, which lives in vocab.json alone.
        unk_id=0, eos_id=1, bos_id=-1, pad_id=-1,
        unk_piece=UNK, eos_piece=EOS,
        seed_sentencepiece_size=200_000,
        num_threads=2,
        input_sentence_size=0,
        # Keep placeholders' characters and digits as pieces the model can copy.
        split_digits=True,
        byte_fallback=False,
        # Tiny corpora (tests) cannot fill the vocabulary; take what they give.
        hard_vocab_limit=False,
        normalization_rule_name=normalization,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def build_vocab(source_model: Path, target_model: Path, size: int | None = None) -> dict[str, int]:
    """opus-mt layout: </s>=0, <unk>=1, source pieces, unseen target pieces, <pad> last.

    `size`: pad with unused `<unused_N>` entries up to exactly this many ids (a model whose
    embedding must have a given shape, e.g. opus-mt-en-zh's 65001); None: no padding.
    """
    vocab = {EOS: 0, UNK: 1}
    for path in (source_model, target_model):
        sp = spm.SentencePieceProcessor(model_file=str(path))
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if piece in (EOS, UNK) or sp.is_control(i):
                continue
            vocab.setdefault(piece, len(vocab))
    if size is not None:
        if len(vocab) + 1 > size:
            raise ValueError(f"{len(vocab) + 1} pieces do not fit a vocabulary of {size}")
        while len(vocab) < size - 1:
            vocab[f"<unused_{len(vocab)}>"] = len(vocab)
    vocab[PAD] = len(vocab)
    return vocab


def write_tokenizer(
    folder: Path, source_model: Path, target_model: Path, zh_samples: list[str], vocab_size: int | None = None
) -> "MarianTokenizer":
    """Write the four MarianTokenizer files into `folder`, reload them and `check_tokenizer` the
    result on `zh_samples`; return the loaded tokenizer. `vocab_size`: see `build_vocab`."""
    from transformers import MarianTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab(source_model, target_model, vocab_size)
    vocab_path = folder / "vocab.json"
    vocab_path.write_text(json.dumps(vocab, ensure_ascii=False, indent=0), encoding="utf-8")
    tok = MarianTokenizer(
        source_spm=str(source_model), target_spm=str(target_model), vocab=str(vocab_path),
        source_lang="en", target_lang="zh", model_max_length=512,
    )
    tok.save_pretrained(str(folder))
    tok = MarianTokenizer.from_pretrained(str(folder))
    check_tokenizer(tok, zh_samples)
    logger.info("tokenizer: %d ids (pad=%d)", len(vocab), vocab[PAD])
    return tok


def check_tokenizer(tok, zh_samples: list[str]) -> None:
    """Raise if the tokenizer breaks the conventions the model config and the backends rely on."""
    problems = []
    vocab = tok.get_vocab()
    if tok.eos_token_id != 0:
        problems.append(f"eos id {tok.eos_token_id}, expected 0")
    if tok.unk_token_id != 1:
        problems.append(f"unk id {tok.unk_token_id}, expected 1")
    if tok.pad_token_id != len(vocab) - 1:
        problems.append(f"pad id {tok.pad_token_id}, expected the last id {len(vocab) - 1}")
    src = tok("Click OK to save the document.").input_ids
    if src[-1] != 0:
        problems.append(f"source ids do not end with eos: {src}")
    checked = 0
    for zh in zh_samples:
        tgt = tok(text_target=zh).input_ids
        if tok.unk_token_id in tgt:
            continue  # a character left out by character_coverage; nothing to compare
        checked += 1
        back = tok.decode(tgt, skip_special_tokens=True)
        if back != zh or tgt[-1] != 0:
            problems.append(f"target round trip: {zh!r} -> {tgt} -> {back!r}")
    if zh_samples and not checked:
        problems.append("no target sample without <unk> to check the round trip on")
    if problems:
        raise ValueError("tokenizer check failed: " + "; ".join(problems))
