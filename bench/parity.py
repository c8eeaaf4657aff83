"""python -m bench.parity EXPORT_DIR: greedy ids of every backend against PyTorch on dev sentences.

The export's own verification runs 16 sentences; this is the larger check a user runs before
shipping: by default the first 100 English sentences of data/dev.tsv. `--num-beams 4` (and the
other decoding flags) decode with beam search; `--generate` compares every backend, pytorch
included, with transformers' `generate()` itself on the export's source model. `--external NAME=DIR`
(repeatable) adds an Optimum-layout export of the same model as backend NAME (backends/ort_external.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backends import APPROXIMATE, BACKEND_NAMES, REFERENCE, SessionConfig, load_backends
from backends.divergence import parity_report
from backends.ort_external import parse_external
from corpus import DEV_TSV, read_pairs


class GenerateReference:
    """transformers' `generate()` on the export's source model, shaped like a backend for
    `parity_report`: the same tokenizer, the same options, the sidecar's bad words and forced
    first token (the target language's code, for NLLB/M2M100/mBART-50). Greedy search keeps our
    contract at the length cap (no forced eos; see backends/processors.py)."""

    def __init__(self, export_dir: Path, threads: int | None, src_lang: str | None = None, tgt_lang: str | None = None):
        import torch
        import transformers

        from backends import load_manifest
        from backends.pytorch import source_model_of
        from backends.tokenizer import TokenizerWrapper

        if threads:
            torch.set_num_threads(threads)
        transformers.logging.set_verbosity_error()  # not one "max_new_tokens and max_length" warning per batch
        self.manifest = load_manifest(export_dir).with_languages(src_lang, tgt_lang)
        model_class = getattr(transformers, self.manifest.architecture)  # the family's own class
        self.model = model_class.from_pretrained(str(source_model_of(self.manifest))).eval()
        self.tokenizer = TokenizerWrapper(Path(export_dir), src_lang=(self.manifest.languages or {}).get("src_lang"))

    def translate(self, texts: list[str], *, top_k: int = 5, **decode) -> list:
        import torch
        from types import SimpleNamespace

        options = {k: v for k, v in decode.items() if v is not None}
        greedy = options.get("num_beams", self.manifest.generation.num_beams) == 1
        batch = self.tokenizer.encode(texts, self.manifest.max_source_tokens)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=torch.from_numpy(batch.input_ids),
                attention_mask=torch.from_numpy(batch.attention_mask),
                do_sample=False,
                bad_words_ids=[[i] for i in self.manifest.special.bad_words_ids] or None,
                forced_bos_token_id=self.manifest.generation.forced_bos_token_id,
                **({"forced_eos_token_id": None} if greedy else {}),
                **options,
            )
        per = out.shape[0] // len(texts)  # num_return_sequences rows per sentence: the first is the best
        pad = self.manifest.special.pad
        rows = [[i for i in row[1:] if i != pad] for row in out[::per].tolist()]
        return [SimpleNamespace(token_ids=ids, text=self.tokenizer.decode(ids)) for ids in rows]

    def close(self) -> None:
        self.model = None


def run(
    export_dir: Path,
    sentences: list[str],
    max_new_tokens: int,
    batch_size: int,
    threads: int | None,
    names: tuple[str, ...] = BACKEND_NAMES,
    against_generate: bool = False,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    external: dict[str, str] | None = None,
    **decode,
) -> dict:
    """The report of `backends.divergence.parity_report` (the export's own greedy check, at a larger
    size); `decode` options go to `Backend.translate` with `max_new_tokens`. `against_generate`:
    the reference is transformers' generate() ("generate"), not the pytorch backend."""
    reference = "generate" if against_generate else REFERENCE
    if not against_generate and REFERENCE not in names:
        names = (REFERENCE, *names)
    languages = {"src_lang": src_lang, "tgt_lang": tgt_lang}
    backends = load_backends(export_dir, names=names, session=SessionConfig(threads=threads), external=external,
                             **languages)
    if against_generate:
        backends = {"generate": GenerateReference(export_dir, threads, **languages), **backends}
    try:
        report = parity_report(backends, sentences, reference, batch_size, max_new_tokens=max_new_tokens, **decode)
    finally:
        for backend in backends.values():
            backend.close()
    result = {"export": str(export_dir), **report}
    if external:  # what each external export is (backends/ort_external.py): its precision and provenance
        result["external"] = {n: {"precision": backends[n].info["precision"], **backends[n].info["source"]}
                              for n in external}
    return result


def approximate(report: dict) -> list[str]:
    """Backends whose ids may differ by design (reduced precision): the built-in fp16/int8 ones, and
    external exports whose graphs are not fp32."""
    external = report.get("external") or {}
    return [n for n in report["backends"]
            if n in APPROXIMATE or (n in external and external[n]["precision"] != "fp32")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("--tsv", type=Path, default=DEV_TSV, help="TSV with an `en` column")
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--backends", default=",".join(BACKEND_NAMES), help="comma-separated; pytorch is always run")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--src-lang", default=None, help="source language code (NLLB/M2M100/mBART-50; default: the export's)")
    parser.add_argument("--tgt-lang", default=None, help="target language code, forced first (default: the export's)")
    parser.add_argument("--num-beams", type=int, default=None, help="default: the export's (its model's generation config)")
    parser.add_argument("--length-penalty", type=float, default=None)
    parser.add_argument("--early-stopping", choices=("true", "false", "never"), default=None)
    parser.add_argument("--generate", action="store_true", help="compare with transformers' generate(), not the pytorch backend")
    parser.add_argument("--external", action="append", default=[], metavar="NAME=DIR",
                        help="also check an Optimum-layout export of the same model as backend NAME (repeatable)")
    args = parser.parse_args(argv)
    try:
        external = parse_external(args.external)
    except ValueError as e:
        parser.error(str(e))
    names = tuple(n for n in args.backends.split(",") if n)
    sentences = [p.en for p in read_pairs(args.tsv, limit=args.sentences)]
    early = {"true": True, "false": False, "never": "never", None: None}[args.early_stopping]
    decode = {"num_beams": args.num_beams, "length_penalty": args.length_penalty, "early_stopping": early}
    decode = {k: v for k, v in decode.items() if v is not None}
    report = run(args.export_dir, sentences, args.max_new_tokens, args.batch_size, args.threads, names, args.generate,
                 src_lang=args.src_lang, tgt_lang=args.tgt_lang, external=external, **decode)
    reference = "generate()" if args.generate else REFERENCE
    for name, r in report["backends"].items():
        print(
            f"{name}: identical ids {r['identical_ids']}/{report['sentences']}, "
            f"identical text {r['identical_text']}/{report['sentences']} ({r['seconds']} s; {reference} {report['reference_seconds']} s)"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
    fp32 = [r for n, r in report["backends"].items() if n not in approximate(report)]
    return 0 if all(r["identical_ids"] == report["sentences"] for r in fp32) else 1


if __name__ == "__main__":
    raise SystemExit(main())
