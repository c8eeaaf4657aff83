"""python -m export SRC --out DIR: a HF translation model of a registered family (families/) to verified ONNX graphs plus manifest.json."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from corpus import DEV_TSV
from families import FAMILIES
from runtime.memory import map_large_blocks

from .fp16_guard import MODES as FP16_KEEP_MODES, Fp16Keep
from .graphs import DEFAULT_OPSET, ExportError
from .pipeline import ExportOptions, VerificationFailed, export
from .source import SourceError


def _language_help() -> tuple[str, str]:
    """The families' own language codes, as examples for --src-lang and --tgt-lang."""
    coded = [f for f in FAMILIES.values() if f.default_src_lang]
    sources = ", ".join(f"{f.title} {f.default_src_lang}" for f in coded)
    targets = [code for f in coded for code in (f.default_tgt_lang, *(t for _, t in f.tokenizer_languages.values()))]
    return sources, ", ".join(dict.fromkeys(targets))


def main(argv: list[str] | None = None) -> int:
    families = ", ".join(f.title for f in FAMILIES.values())
    sources, targets = _language_help()
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__)
    parser.add_argument("src", help=f"local model folder ({families}), or a hub id where a hub is reachable")
    parser.add_argument("--out", type=Path, required=True, help="export folder to create")
    parser.add_argument("--force", action="store_true", help="replace an existing export folder")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    parser.add_argument("--no-verify", action="store_true", help="skip parity verification (not recommended)")
    parser.add_argument("--no-single-step", action="store_true",
                        help="leave out the single-step graph (full.onnx, the naive baseline backend): at billions "
                             "of parameters it repeats every weight in a file of its own; the sidecar says so")
    parser.add_argument("--sentences", type=Path, default=DEV_TSV, help="TSV (en column) or text file of verification sentences (default data/dev.tsv)")
    parser.add_argument("--verify-sentences", type=int, default=16)
    parser.add_argument("--verify-max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="ORT/torch threads (default: physical cores)")
    parser.add_argument("--src-lang", default=None, help=f"source language code ({sources}; default English)")
    parser.add_argument("--tgt-lang", default=None, help=f"target language code, forced first (default Chinese: {targets})")
    parser.add_argument("--fp16-keep", default="auto", metavar="|".join(FP16_KEEP_MODES),
                        help="what stays fp32 in the fp16 graphs: auto (default: the nodes whose values on "
                             "calibration text come near fp16's range), none (the converter's own block list), "
                             "or ONNX op types")
    parser.add_argument("--int8-keep", default="none", help="int8 nodes kept in fp32 by their sensitivity, measured on "
                        "the first 64 --sentences: none (default: every MatMul int8), N (the N most sensitive), "
                        "N+rescore (the N most sensitive but the output layer, whose best logits are re-scored "
                        "in fp32), auto "
                        "(the once-per-sentence nodes that help, the output layer's best logits re-scored in fp32, "
                        "then decoder-step MatMuls until the agreement target or a weight budget; export/int8_choice.py)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        options = ExportOptions(
            out=args.out,
            force=args.force,
            opset=args.opset,
            verify=not args.no_verify,
            single_step=not args.no_single_step,
            sentences=args.sentences,
            verify_sentences=args.verify_sentences,
            verify_max_new_tokens=args.verify_max_new_tokens,
            threads=args.threads,
            src_lang=args.src_lang,
            tgt_lang=args.tgt_lang,
            fp16_keep=Fp16Keep.parse(args.fp16_keep),
            int8_keep=args.int8_keep,
        )
        out = export(args.src, options)
    except (FileExistsError, SourceError, ExportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except VerificationFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"export written to {out} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    map_large_blocks()  # a process of its own, judged by its peak (not in main(): callers in-process keep glibc's)
    raise SystemExit(main())
