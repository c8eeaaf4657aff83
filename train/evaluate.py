"""Decoding and sacrebleu scores on dev.tsv; `python -m train.evaluate MODEL_DIR`.

One decoding setting (`Decoding`: beams, repetition penalty, n-gram blocking) per evaluation; by
default the model's own generation_config. `--sweep` scores several settings and prints a table
(BLEU / chrF overall, BLEU on the Tatoeba rows, the share of outputs with a repeated-token run).
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from corpus import DEV_TSV

logger = logging.getLogger(__name__)

# An output "stutters" when one token (a Chinese character, or a word/number elsewhere, as
# sacrebleu's zh tokenizer splits them) occurs this many times in a row: 很很很很, 被被被被.
# Runs of 4+ are the stutter the model card reports; runs of 3+ are reported too, because blocking repeated
# trigrams (no_repeat_ngram_size 3) caps every run at 3 without curing the stutter (风风风很很很).
REPEAT_RUN = 4
SHORT_RUN = 3


@dataclass(frozen=True)
class Decoding:
    # 1: greedy search; more: beam search (early_stopping False, length_penalty 1.0: generate()'s defaults).
    num_beams: int = 1
    # generate()'s repetition_penalty: logits of tokens already in the output divided (if > 0) or
    # multiplied by this; 1.0 is off. It also penalises legitimate repeats (的, 了).
    repetition_penalty: float = 1.0
    # Block any n-gram of this size from occurring twice in an output; 0 is off.
    no_repeat_ngram_size: int = 0

    def __post_init__(self):
        if not 1 <= self.num_beams <= 16:
            raise ValueError(f"num_beams must be in 1..16, got {self.num_beams}")
        if not 1.0 <= self.repetition_penalty <= 3.0:
            raise ValueError(f"repetition_penalty must be in [1.0, 3.0], got {self.repetition_penalty}")
        if not 0 <= self.no_repeat_ngram_size <= 10:
            raise ValueError(f"no_repeat_ngram_size must be in 0..10, got {self.no_repeat_ngram_size}")

    @classmethod
    def parse(cls, text: str) -> "Decoding":
        """`BEAMS[:PENALTY[:NGRAM]]`, e.g. `5:1.0:3` (the --sweep syntax)."""
        parts = text.split(":")
        if not 1 <= len(parts) <= 3:
            raise ValueError(f"expected BEAMS[:PENALTY[:NGRAM]], got {text!r}")
        kinds = (int, float, int)
        return cls(*(kind(p) for kind, p in zip(kinds, parts)))

    @classmethod
    def of(cls, generation_config) -> "Decoding":
        """The setting a model ships with (its generation_config; unset fields are generate()'s defaults)."""
        return cls(num_beams=generation_config.num_beams or 1,
                   repetition_penalty=generation_config.repetition_penalty or 1.0,
                   no_repeat_ngram_size=generation_config.no_repeat_ngram_size or 0)

    def describe(self) -> str:
        search = "greedy" if self.num_beams == 1 else f"beam {self.num_beams}"
        return f"{search}, repetition_penalty {self.repetition_penalty:g}, no_repeat_ngram_size {self.no_repeat_ngram_size}"

    def generate_kwargs(self) -> dict:
        return {"num_beams": self.num_beams, "do_sample": False,
                "repetition_penalty": self.repetition_penalty, "no_repeat_ngram_size": self.no_repeat_ngram_size}


# What `python -m train` writes into generation_config.json unless told otherwise, chosen by
# measurement on all of dev.tsv with the v1 model (MODEL_CARD.md, "Decoding"): beam 4 with
# repetition_penalty 1.2 and no_repeat_ngram_size 2 scored 27.28 BLEU / 20.33 Tatoeba BLEU, 0% of
# outputs with a 4+ run and 0.2% with a 3+ run, against greedy's 24.65 / 18.30 / 10.8% / 16.2%.
# Beam 4 with trigram blocking alone scored the same BLEU but left 13.4% of outputs with 3-runs
# (风风风很很很): blocking trigrams caps a stutter at three instead of curing it.
SHIPPED_DECODING = Decoding(num_beams=4, repetition_penalty=1.2, no_repeat_ngram_size=2)


def translate(model, tok, sentences: list[str], batch_size: int = 32, max_new_tokens: int = 256,
              decoding: Decoding = Decoding()) -> list[str]:
    """Translations, batched by length so padding stays small; returned in input order."""
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
            gen = model.generate(**enc, max_new_tokens=limit, **decoding.generate_kwargs())
            for i, text in zip(idx, tok.batch_decode(gen, skip_special_tokens=True)):
                out[i] = text
    return out


def longest_run(text: str) -> int:
    """The longest run of one repeated token, tokens as sacrebleu's zh tokenizer splits them."""
    from sacrebleu.tokenizers.tokenizer_zh import TokenizerZh

    best, run, prev = 0, 0, None
    for token in TokenizerZh()(text).split():
        run = run + 1 if token == prev else 1
        prev = token
        best = max(best, run)
    return best


def repeat_share(hyps: list[str], min_run: int = REPEAT_RUN) -> float:
    """Share (0..1) of outputs holding a token repeated `min_run` or more times in a row."""
    if not hyps:
        return 0.0
    return sum(longest_run(h) >= min_run for h in hyps) / len(hyps)


def score(hyps: list[str], refs: list[str]) -> tuple[float, float]:
    import sacrebleu

    bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh").score
    chrf = sacrebleu.corpus_chrf(hyps, [refs]).score
    return bleu, chrf


def score_parts(pairs, hyps: list[str]) -> dict:
    """BLEU, chrF and the repeated-run share on the whole set and its Tatoeba / documentation parts."""
    from .data import is_tatoeba

    result = {}
    for name, keep in (("whole", lambda p: True), ("tatoeba", lambda p: is_tatoeba(p.source)),
                       ("docs", lambda p: not is_tatoeba(p.source))):
        sel = [i for i, p in enumerate(pairs) if keep(p)]
        part = [hyps[i] for i in sel]
        bleu, chrf = score(part, [pairs[i].zh for i in sel])
        result[name] = {"rows": len(sel), "bleu": round(bleu, 2), "chrf": round(chrf, 2),
                        f"repeat{REPEAT_RUN}_share": round(repeat_share(part), 4),
                        f"repeat{SHORT_RUN}_share": round(repeat_share(part, SHORT_RUN), 4)}
    return result


def evaluate_model(model, tok, pairs, decoding: Decoding = Decoding(), hyps_out: Path | None = None) -> dict:
    """Translate `pairs` (with references) and score them: the body of `evaluate`, for loaded models."""
    t0 = time.monotonic()
    hyps = translate(model, tok, [p.en for p in pairs], decoding=decoding)
    seconds = time.monotonic() - t0
    if hyps_out is not None:
        hyps_out.write_text("".join(f"{p.en}\t{p.zh}\t{h}\n" for p, h in zip(pairs, hyps)), encoding="utf-8")
    result = {"decoding": f"{decoding.describe()}, batch 32", "decoding_options": asdict(decoding),
              "metrics": f"sacrebleu BLEU tokenize=zh, chrF defaults; repeat{REPEAT_RUN}_share: outputs with a "
                         f"token (zh tokenizer) repeated {REPEAT_RUN}+ times in a row",
              "decode_seconds": round(seconds, 1)}
    result.update(score_parts(pairs, hyps))
    return result


def evaluate(model_dir: Path, dev_path: Path, hyps_out: Path | None = None, threads: int | None = None,
             examples: Path | None = None, decoding: Decoding | None = None) -> dict:
    """Score one decoding setting (default: the model's generation_config) on all of `dev_path`."""
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    from corpus import read_pairs, read_sentences

    if threads:
        torch.set_num_threads(threads)
    tok = MarianTokenizer.from_pretrained(str(model_dir))
    model = MarianMTModel.from_pretrained(str(model_dir))
    decoding = decoding or Decoding.of(model.generation_config)
    pairs = read_pairs(dev_path, require_zh=True)
    result = {"dev_file": dev_path.name, **evaluate_model(model, tok, pairs, decoding, hyps_out)}
    if examples is not None and examples.exists():
        inputs = [p.en for p in read_sentences(examples)]
        outputs = translate(model, tok, inputs, decoding=decoding)
        result["examples"] = [{"en": en, "zh": zh} for en, zh in zip(inputs, outputs)]
    return result


def sweep(model_dir: Path, dev_path: Path, settings: list[Decoding], threads: int | None = None) -> list[dict]:
    """`evaluate` once per setting (no examples, no files written); one summary row each."""
    rows = []
    for decoding in settings:
        r = evaluate(model_dir, dev_path, threads=threads, decoding=decoding)
        key = f"repeat{REPEAT_RUN}_share"
        rows.append({**asdict(decoding), "bleu": r["whole"]["bleu"], "chrf": r["whole"]["chrf"],
                     "tatoeba_bleu": r["tatoeba"]["bleu"], "docs_bleu": r["docs"]["bleu"],
                     key: r["whole"][key], f"repeat{SHORT_RUN}_share": r["whole"][f"repeat{SHORT_RUN}_share"],
                     "decode_seconds": r["decode_seconds"]})
        logger.info("%s: %s", decoding.describe(), rows[-1])
    return rows


def sweep_table(rows: list[dict]) -> str:
    key = f"repeat{REPEAT_RUN}_share"
    short = f"repeat{SHORT_RUN}_share"
    lines = ["| beams | repetition_penalty | no_repeat_ngram | BLEU | chrF | Tatoeba BLEU | docs BLEU | "
             f"{REPEAT_RUN}+ runs | {SHORT_RUN}+ runs | decode s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        three = f"{100 * r[short]:.1f}%" if short in r else ""
        lines.append(f"| {r['num_beams']} | {r['repetition_penalty']:g} | {r['no_repeat_ngram_size']} | {r['bleu']:.2f} | "
                     f"{r['chrf']:.2f} | {r['tatoeba_bleu']:.2f} | {r['docs_bleu']:.2f} | {100 * r[key]:.1f}% | "
                     f"{three} | {r['decode_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--dev", type=Path, default=DEV_TSV, help="default: data/dev.tsv")
    parser.add_argument("--hyps", type=Path, default=None, help="also write en/ref/hyp rows here")
    parser.add_argument("--examples", type=Path, default=None,
                        help="also translate these inputs (default: assets/examples.tsv next to the model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is faster on a shared 2-core box)")
    parser.add_argument("--num-beams", type=int, default=None, help="default: the model's generation_config")
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--no-repeat-ngram-size", type=int, default=None)
    parser.add_argument("--sweep", nargs="+", metavar="BEAMS[:PENALTY[:NGRAM]]", default=None,
                        help="score each setting, print a table and write it to --sweep-out; eval.json is left alone")
    parser.add_argument("--sweep-out", type=Path, default=None, help="JSON rows of the sweep")
    parser.add_argument("--no-write", action="store_true", help="print the scores, do not write eval.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import transformers

    transformers.logging.set_verbosity_error()  # max_new_tokens vs config max_length, per batch
    if args.sweep:
        rows = sweep(args.model_dir, args.dev, [Decoding.parse(s) for s in args.sweep], args.threads)
        if args.sweep_out:
            args.sweep_out.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
        print(sweep_table(rows))
        return
    decoding = None
    if (args.num_beams, args.repetition_penalty, args.no_repeat_ngram_size) != (None, None, None):
        from transformers import GenerationConfig

        shipped = Decoding.of(GenerationConfig.from_pretrained(str(args.model_dir)))
        decoding = Decoding(
            num_beams=args.num_beams if args.num_beams is not None else shipped.num_beams,
            repetition_penalty=args.repetition_penalty if args.repetition_penalty is not None else shipped.repetition_penalty,
            no_repeat_ngram_size=args.no_repeat_ngram_size if args.no_repeat_ngram_size is not None else shipped.no_repeat_ngram_size,
        )
    examples = args.examples or args.model_dir.parent / "examples.tsv"
    result = evaluate(args.model_dir, args.dev, args.hyps, args.threads, examples, decoding)
    out = args.model_dir / "eval.json"
    if out.exists():
        # Keep what `python -m train` (and a sweep) stored next to the scores.
        previous = json.loads(out.read_text(encoding="utf-8"))
        for key in ("training", "decoding_sweep"):
            if key in previous:
                result[key] = previous[key]
    if not args.no_write:
        out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k not in ("training", "decoding_sweep")}, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
