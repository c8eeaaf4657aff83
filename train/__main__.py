"""`python -m train --out assets/marian-en-zh-small`: corpus → tokenizer → model → eval.

Defaults are the shipped model's recipe: data/train.tsv.gz + data/extra.tsv.gz, a MarianMTModel
(d_model 384, 6+3 layers), peak lr 1e-3. Work files (spm inputs, checkpoints,
snapshots, log) go to --run-dir; `--resume` continues from its latest checkpoint with a fresh
--max-minutes budget, so the recipe runs as several invocations of at most 90 minutes each.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

from corpus import DATA, DEV_TSV, TRAIN_TSV

logger = logging.getLogger("train")

REPO = Path(__file__).resolve().parents[1]
# Game catalogs (Wesnoth, Freeciv) added for v2; see data/SOURCES.md. Same format as train.tsv.gz.
EXTRA_TSV = DATA / "extra.tsv.gz"
DEFAULT_TRAIN = (TRAIN_TSV, EXTRA_TSV)


def parse_args(argv=None):
    from .evaluate import SHIPPED_DECODING, Decoding
    from .loop import TrainOptions
    from .model import ModelSize

    t, m = TrainOptions(), ModelSize()
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="model folder to write (HF format)")
    p.add_argument("--train", type=Path, nargs="+", default=list(DEFAULT_TRAIN),
                   help="training pairs TSV file(s), read in order (default data/train.tsv.gz data/extra.tsv.gz)")
    p.add_argument("--dev", type=Path, default=DEV_TSV, help="dev pairs TSV for selection and scores (default data/dev.tsv)")
    p.add_argument("--run-dir", type=Path, default=None, help="work files; default runs/<out folder name>")
    p.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
    p.add_argument("--init-from", type=Path, default=None,
                   help="warm start: weights, size and tokenizer of this Marian folder (e.g. the shipped model), "
                   "fresh optimizer; with --schedule-offset N the lr schedule continues from step N")
    p.add_argument("--schedule-offset", type=int, default=0,
                   help="with --init-from: steps the source model already trained (its schedule resumes there)")
    p.add_argument("--max-minutes", type=float, default=t.max_minutes, help="training wall-time budget (≤ 90)")
    p.add_argument("--max-steps", type=int, default=t.max_steps, help="total step limit, 0 = none")
    p.add_argument("--checkpoint-minutes", type=float, default=t.checkpoint_minutes)
    p.add_argument("--max-tokens", type=int, default=t.max_tokens)
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {t.lr}); with --resume, re-bases the checkpoint's schedule")
    p.add_argument("--warmup", type=int, default=t.warmup)
    p.add_argument("--label-smoothing", type=float, default=t.label_smoothing)
    p.add_argument("--dev-subset", type=int, default=t.dev_subset)
    p.add_argument("--src-vocab", type=int, default=8000, help="English sentencepiece size")
    p.add_argument("--tgt-vocab", type=int, default=8000, help="Chinese sentencepiece size")
    p.add_argument("--d-model", type=int, default=m.d_model)
    p.add_argument("--heads", type=int, default=m.heads)
    p.add_argument("--ffn", type=int, default=m.ffn)
    p.add_argument("--encoder-layers", type=int, default=m.encoder_layers)
    p.add_argument("--decoder-layers", type=int, default=m.decoder_layers)
    p.add_argument("--num-beams", type=int, default=SHIPPED_DECODING.num_beams,
                   help="decoding setting written to generation_config.json (chosen on dev.tsv, see MODEL_CARD.md)")
    p.add_argument("--repetition-penalty", type=float, default=SHIPPED_DECODING.repetition_penalty)
    p.add_argument("--no-repeat-ngram-size", type=int, default=SHIPPED_DECODING.no_repeat_ngram_size)
    p.add_argument("--limit", type=int, default=0, help="use only the first N training pairs (tests)")
    p.add_argument("--no-eval", action="store_true", help="skip the full dev evaluation at the end")
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--threads", type=int, default=t.threads)
    args = p.parse_args(argv)
    if args.schedule_offset and not args.init_from:
        p.error("--schedule-offset continues a warm start's schedule: it needs --init-from")
    if args.init_from and not (args.init_from / "config.json").is_file():
        p.error(f"--init-from {args.init_from}: no config.json there (a Marian model folder, e.g. assets/marian-en-zh-small)")
    if not 0 < args.max_minutes <= 90:
        p.error("--max-minutes must be in (0, 90]: one run must fit the 90-minute budget; use --resume")
    try:
        args.decoding = Decoding(args.num_beams, args.repetition_penalty, args.no_repeat_ngram_size)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    run_dir = args.run_dir or REPO / "runs" / args.out.name
    run_dir.mkdir(parents=True, exist_ok=True)
    fmt = "%(asctime)s %(name)s %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt)
    # On the package logger, not the root: basicConfig is a no-op once a host (pytest) configured it.
    file_handler = logging.FileHandler(run_dir / "train.log")
    file_handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(file_handler)
    logger.setLevel(logging.INFO)
    try:
        _run(args, run_dir, argv)
    finally:
        logger.removeHandler(file_handler)
        file_handler.close()


def _run(args, run_dir: Path, argv) -> None:
    import torch
    from transformers import MarianTokenizer

    from corpus import read_pairs

    from .data import filter_pairs
    from .evaluate import evaluate
    from .loop import Trainer, TrainOptions, encode_pairs
    from .model import ModelSize, build_model, count_parameters, generation_config
    from .tokenizer import check_tokenizer, train_spm, write_tokenizer

    lr = args.lr if args.lr is not None else TrainOptions.lr
    opts = TrainOptions(max_tokens=args.max_tokens, lr=lr, warmup=args.warmup,
                        label_smoothing=args.label_smoothing, max_minutes=args.max_minutes,
                        max_steps=args.max_steps, checkpoint_minutes=args.checkpoint_minutes,
                        dev_subset=args.dev_subset, seed=args.seed, threads=args.threads,
                        schedule_offset=args.schedule_offset)
    size = ModelSize(d_model=args.d_model, heads=args.heads, ffn=args.ffn,
                     encoder_layers=args.encoder_layers, decoder_layers=args.decoder_layers)
    import transformers

    transformers.logging.set_verbosity_error()  # max_new_tokens vs config max_length, per batch
    torch.set_num_threads(opts.threads)
    random.seed(opts.seed)
    torch.manual_seed(opts.seed)
    wall_start = time.monotonic()

    pairs, filter_stats = filter_pairs(read_training_pairs(args.train))
    if args.limit:
        pairs = pairs[: args.limit]
    dev_pairs = read_pairs(args.dev, require_zh=True)
    tok_samples = [p.zh for p in pairs[:: max(1, len(pairs) // 200)]]
    # A fixed shuffle so the model-selection subset mixes tatoeba and documentation rows.
    dev_subset = random.Random(opts.seed).sample(dev_pairs, min(opts.dev_subset, len(dev_pairs)))

    tok_dir = run_dir / "tokenizer"
    if args.resume and (tok_dir / "vocab.json").exists():
        tok = MarianTokenizer.from_pretrained(str(tok_dir))
        check_tokenizer(tok, tok_samples)
    elif args.init_from:  # the warm start's own pieces: its embeddings are indexed by them
        tok = MarianTokenizer.from_pretrained(str(args.init_from))
        check_tokenizer(tok, tok_samples)
        tok.save_pretrained(str(tok_dir))
    else:
        src = train_spm([p.en for p in pairs], run_dir / "spm" / "source", args.src_vocab, 1.0)
        # 0.9995 leaves the rarest Chinese characters (mostly names) to <unk> instead of spending ids.
        # identity normalisation: Chinese text must come back with its full-width punctuation.
        tgt = train_spm([p.zh for p in pairs], run_dir / "spm" / "target", args.tgt_vocab, 0.9995, "identity")
        tok = write_tokenizer(tok_dir, src, tgt, tok_samples)

    encoded = encode_pairs(tok, pairs, opts.max_len)
    n_src = sum(len(s) for s, _ in encoded)
    n_tgt = sum(len(t) for _, t in encoded)
    logger.info("encoded %d pairs (%d dropped > %d tokens); %d source / %d target tokens",
                len(encoded), len(pairs) - len(encoded), opts.max_len, n_src, n_tgt)

    if args.init_from:
        from transformers import MarianMTModel

        model = MarianMTModel.from_pretrained(str(args.init_from))
        c = model.config
        size = ModelSize(d_model=c.d_model, heads=c.encoder_attention_heads, ffn=c.encoder_ffn_dim,
                         encoder_layers=c.encoder_layers, decoder_layers=c.decoder_layers)
        logger.info("warm start from %s (schedule continues at step %d)", args.init_from, opts.schedule_offset)
    else:
        model = build_model(len(tok.get_vocab()), size, seed=opts.seed)
    model.config.to_json_file(str(run_dir / "config.json"))  # for `python -m train.curve RUN_DIR`
    n_params = count_parameters(model)
    logger.info("model: %s, %d parameters", asdict(size), n_params)
    trainer = Trainer(model, tok, encoded, dev_subset, run_dir, opts)
    if args.resume:
        if trainer.latest_path.exists():
            trainer.load_checkpoint(keep_lr=args.lr is None)
        else:
            logger.warning("--resume: no checkpoint in %s, starting fresh", run_dir)
    trainer.train()

    model.load_state_dict(torch.load(trainer.best_path, map_location="cpu"))
    save_model(model, tok, args.out, generation_config(model.config, **asdict(args.decoding)))
    summary = {
        "command": "python -m train " + " ".join(argv if argv is not None else sys.argv[1:]),
        "filter": filter_stats, "pairs_used": len(encoded), "source_tokens": n_src, "target_tokens": n_tgt,
        "vocab": {"source_spm": args.src_vocab, "target_spm": args.tgt_vocab, "joint": len(tok.get_vocab())},
        "model": asdict(size), "parameters": n_params, "options": asdict(opts),
        "steps": trainer.step, "epochs_completed": trainer.epoch, "train_minutes": round(trainer.train_seconds / 60, 1),
        "this_invocation_wall_minutes": round((time.monotonic() - wall_start) / 60, 1),
        "selection": {"best_dev_subset_bleu": round(trainer.best_bleu, 2), "history": trainer.history},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    examples = REPO / "assets" / "examples.tsv"
    result = {} if args.no_eval else evaluate(args.out, args.dev, run_dir / "dev_hyps.tsv", examples=examples)
    result["training"] = summary
    (args.out / "eval.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    logger.info("wrote %s: %s", args.out, {k: v for k, v in result.items() if k != "training"})


def read_training_pairs(paths):
    """The pairs of every training file, in the order given (the filter then dedupes across them)."""
    from corpus import read_pairs

    pairs = []
    for path in paths:
        part = read_pairs(path, require_zh=True)
        logger.info("read %d pairs from %s", len(part), path)
        pairs.extend(part)
    return pairs


def save_model(model, tok, out: Path, gen_config) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = gen_config
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    # transformers 5 keeps generation settings out of config.json; older tools (opus-mt's own
    # config, CTranslate2, optimum) read them there, so carry them in both files.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    pad = model.config.pad_token_id
    cfg.update({"bad_words_ids": [[pad]], "max_length": 512, "num_beams": gen_config.num_beams,
                "repetition_penalty": gen_config.repetition_penalty,
                "no_repeat_ngram_size": gen_config.no_repeat_ngram_size,
                "decoder_start_token_id": pad, "pad_token_id": pad, "eos_token_id": 0})
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
