"""The CTranslate2 peers: settings, the translator, and the conversion that keeps them exact.

`ct2-convert` runs ct2-transformers-converter's loader for the model's family (Marian, M2M100/NLLB,
mBART) with two corrections that make greedy float32 token-identical to generate(): a trained
Marian's learned decoder start is kept, and the decoder starts from the model's own
`decoder_start_token_id`. The target language's code is forced first with `target_prefix`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from runtime.protocol import Output

from .model import PeerModel, dir_bytes, versions

CT2_RECIPE = "bench.peers ct2-convert v2 (learned decoder start kept)"
# CTranslate2's CPU settings: its GEMM library (CT2_USE_MKL; "auto" is its own choice by CPU vendor)
# and its thread count (intra_threads, and MKL's and OpenMP's). Which is fastest depends on the
# machine by several times (docs/benchmarks.md), so `bench speed` probes them and keeps the fastest.
CT2_GEMMS = ("auto", "mkl", "dnnl")


def ct2_settings(threads: int) -> list[dict]:
    """The CTranslate2 settings worth trying with at most `threads` threads: MKL and oneDNN, each
    with one thread and with all of them (1 and `threads`; at 4 or more, half of them too)."""
    counts = sorted({1, max(1, threads // 2), threads} if threads >= 4 else {1, threads})
    return [{"gemm": g, "threads": t} for g in CT2_GEMMS if g != "auto" for t in counts]


def ct2_setting_args(setting: dict) -> list[str]:
    return ["--ct2-gemm", setting["gemm"], "--ct2-threads", str(setting["threads"])]


def ct2_gemm_env(gemm: str) -> None:
    """Before ctranslate2 is imported: it reads CT2_USE_MKL once, when it loads."""
    if gemm == "auto":
        os.environ.pop("CT2_USE_MKL", None)
    else:
        os.environ["CT2_USE_MKL"] = "1" if gemm == "mkl" else "0"


def ct2_kwargs(decode: dict | None) -> dict:
    """translate_batch's search options: beam_size, and length_penalty when given (early_stopping has no
    CTranslate2 equivalent: its patience stays 1)."""
    decode = decode or {}
    kwargs = {"beam_size": int(decode.get("num_beams", 1))}
    if decode.get("length_penalty") is not None:
        kwargs["length_penalty"] = float(decode["length_penalty"])
    if decode.get("repetition_penalty") is not None:
        kwargs["repetition_penalty"] = float(decode["repetition_penalty"])
    if decode.get("no_repeat_ngram_size"):
        kwargs["no_repeat_ngram_size"] = int(decode["no_repeat_ngram_size"])
    return kwargs


def _logged(make):
    """(make(), what CTranslate2 logged): at load it says which ISA, GEMM libraries and compute type
    it dispatched to, at info level, on the C++ side's stderr. Captured from file descriptor 2 around
    the load, passed on to stderr (the worker's log), and parsed into {"Selected ISA": "AVX2", ...}."""
    import logging
    import re
    import tempfile

    import ctranslate2

    level = ctranslate2.get_log_level()
    ctranslate2.set_log_level(logging.INFO)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            result = make()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            ctranslate2.set_log_level(level)
        f.seek(0)
        text = f.read().decode(errors="replace")
    sys.stderr.write(text)
    said = dict(re.findall(r"\[info\]\s+(?:- )?([A-Za-z_0-9 ]+): (.+)", text))
    return result, said


class CT2Runtime:
    """`target_lang`: the target language's code, given as every sentence's `target_prefix` so it is
    the first generated token, as generate()'s forced BOS (None: a family without codes)."""

    def __init__(self, model_dir: str, tokenizer, threads: int, compute_type: str, decode: dict | None = None,
                 target_lang: str | None = None):
        import ctranslate2

        self.translator, self.dispatch = _logged(lambda: ctranslate2.Translator(
            model_dir, device="cpu", compute_type=compute_type, intra_threads=threads, inter_threads=1
        ))
        self.tokenizer = tokenizer
        self.kwargs = ct2_kwargs(decode)
        self.target_lang = target_lang

    def translate(self, texts, max_new_tokens, min_new_tokens):
        source = [self.tokenizer.convert_ids_to_tokens(ids) for ids in self.tokenizer(texts).input_ids]
        prefix = {"target_prefix": [[self.target_lang]] * len(texts)} if self.target_lang else {}
        results = self.translator.translate_batch(
            source, **self.kwargs, **prefix, max_decoding_length=max_new_tokens, min_decoding_length=min_new_tokens,
            return_end_token=True,
        )
        outs = []
        for r in results:
            ids = self.tokenizer.convert_tokens_to_ids(r.hypotheses[0])
            outs.append(Output(ids, self.tokenizer.decode(ids, skip_special_tokens=True)))
        return outs


def load_ct2(name: str, model: PeerModel, model_dir: str, threads: int, decode: dict | None) -> tuple[CT2Runtime, dict]:
    compute = name.split("_")[1]
    tokenizer = model.tokenizer()
    runtime = CT2Runtime(model_dir, tokenizer, threads, compute, decode,
                         model.tgt_lang if model.forced_bos(tokenizer) is not None else None)
    info = {"runtime": f"CTranslate2 {versions('ctranslate2').get('ctranslate2')}", "precision": compute,
            "files": ["model.bin"], "size_bytes": dir_bytes(Path(model_dir), "model.bin"), "dispatch": runtime.dispatch}
    note = Path(model_dir) / "bench-conversion.json"
    if note.is_file():
        info["conversion"] = json.loads(note.read_text())
    return runtime, info
