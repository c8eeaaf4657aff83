"""Greedy decoding and sacrebleu scores on dev.tsv; `python -m train.evaluate MODEL_DIR`."""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from corpus import DEV_TSV

logger = logging.getLogger(__name__)


def translate(model, tok, sentences: list[str], batch_size: int = 32, max_new_tokens: int = 256) -> list[str]:
    """Greedy translations, batched by length so padding stays small; returned in input order."""
    import torch

    model.eval()
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    out: list[str] = [""] * len(sentences)
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            enc = tok([sentences[i] for i in idx], return_tensors="pt", padding=True)
            # Chinese needs fewer pieces than English; the cap keeps a looping early model cheap.
            limit = min(max_new_tokens, 2 * enc["input_ids"].shape[1] + 10)
            gen = model.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=limit)
            for i, text in zip(idx, tok.batch_decode(gen, skip_special_tokens=True)):
                out[i] = text
    return out


def score(hyps: list[str], refs: list[str]) -> tuple[float, float]:
    import sacrebleu

    bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh").score
    chrf = sacrebleu.corpus_chrf(hyps, [refs]).score
    return bleu, chrf


def evaluate(model_dir: Path, dev_path: Path, hyps_out: Path | None = None, threads: int | None = None,
             examples: Path | None = None) -> dict:
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    from corpus import read_pairs, read_sentences

    from .data import is_tatoeba

    if threads:
        torch.set_num_threads(threads)
    tok = MarianTokenizer.from_pretrained(str(model_dir))
    model = MarianMTModel.from_pretrained(str(model_dir))
    pairs = read_pairs(dev_path, require_zh=True)
    t0 = time.monotonic()
    hyps = translate(model, tok, [p.en for p in pairs])
    seconds = time.monotonic() - t0
    if hyps_out is not None:
        hyps_out.write_text("".join(f"{p.en}\t{p.zh}\t{h}\n" for p, h in zip(pairs, hyps)), encoding="utf-8")
    result = {"dev_file": dev_path.name, "decoding": "greedy (num_beams=1, do_sample=False), batch 32",
              "metrics": "sacrebleu BLEU tokenize=zh, chrF defaults", "decode_seconds": round(seconds, 1)}
    for name, keep in (("whole", lambda p: True), ("tatoeba", lambda p: is_tatoeba(p.source)),
                       ("docs", lambda p: not is_tatoeba(p.source))):
        sel = [i for i, p in enumerate(pairs) if keep(p)]
        bleu, chrf = score([hyps[i] for i in sel], [pairs[i].zh for i in sel])
        result[name] = {"rows": len(sel), "bleu": round(bleu, 2), "chrf": round(chrf, 2)}
    if examples is not None and examples.exists():
        inputs = [p.en for p in read_sentences(examples)]
        result["examples"] = [{"en": en, "zh": zh} for en, zh in zip(inputs, translate(model, tok, inputs))]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--dev", type=Path, default=DEV_TSV, help="default: data/dev.tsv")
    parser.add_argument("--hyps", type=Path, default=None, help="also write en/ref/hyp rows here")
    parser.add_argument("--examples", type=Path, default=None,
                        help="also translate these inputs (default: assets/examples.tsv next to the model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is faster on a shared 2-core box)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import transformers

    transformers.logging.set_verbosity_error()  # max_new_tokens vs config max_length, per batch
    dev = args.dev
    examples = args.examples or args.model_dir.parent / "examples.tsv"
    result = evaluate(args.model_dir, dev, args.hyps, args.threads, examples)
    out = args.model_dir / "eval.json"
    if out.exists():
        # Keep the training summary that `python -m train` stored next to the scores.
        previous = json.loads(out.read_text(encoding="utf-8"))
        if "training" in previous:
            result["training"] = previous["training"]
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "training"}, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
