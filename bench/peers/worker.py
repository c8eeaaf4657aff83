"""python -m bench.peers worker: one peer, alone in its process, through the measurement protocol.

Imports only this package and `runtime/` before the peer's own library, so its import time, load
time and peak memory are the peer's alone; writes its results as JSON for the parent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from runtime.memory import peak_rss_mb, reset_peak_rss, rss_mb
from runtime.protocol import Spec, measure

from .ct2 import CT2_GEMMS, ct2_gemm_env, load_ct2
from .hf import early_stopping_arg, load_optimum, load_transformers
from .model import PeerModel, versions
from .specs import PEER_NAMES, PEERS, is_ct2


def _threads_env(threads: int) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


def tokenization_mismatches(tokenizer, spec: Spec) -> list[int]:
    """Indices of sentences this environment's tokenizer encodes differently from the project's."""
    if spec.source_ids is None:
        return []
    return [i for i, (s, ids) in enumerate(zip(spec.sentences, spec.source_ids)) if tokenizer(s).input_ids != ids]


def load_peer(name: str, model_dir: str, model: PeerModel, threads: int, decode: dict | None = None) -> tuple[object, dict]:
    """(runtime, info); imports of the runtime library happen before this is timed. `decode`: num_beams
    (default 1, greedy) and, when given, length_penalty / early_stopping."""
    library = PEERS[name].library
    if library == "transformers":
        return load_transformers(model, model_dir, threads, decode)
    if library == "optimum":
        return load_optimum(name, model, model_dir, threads, decode)
    return load_ct2(name, model, model_dir, threads, decode)


def _preimport(name: str) -> None:
    import transformers  # noqa: F401

    library = PEERS[name].library
    if library in ("transformers", "optimum"):
        import torch  # noqa: F401
    if library == "optimum":
        import optimum.onnxruntime  # noqa: F401
    if library == "ctranslate2":
        import ctranslate2  # noqa: F401


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers worker")
    parser.add_argument("--peer", required=True, choices=PEER_NAMES)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--source", required=True, help="the export's model folder (its config and tokenizer)")
    parser.add_argument("--src-lang", help="families with language codes: the source's code (the export's sidecar)")
    parser.add_argument("--tgt-lang", help="families with language codes: the target's code, forced first")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-beams", type=int, default=1, help="1: greedy search (the default)")
    parser.add_argument("--length-penalty", type=float, help="beam search; default: the model's generation config")
    parser.add_argument("--early-stopping", type=early_stopping_arg, help="beam search (not CTranslate2): true, false or never")
    parser.add_argument("--repetition-penalty", type=float,
                        help="CTranslate2 only (it reads no generation config): the model's repetition_penalty")
    parser.add_argument("--no-repeat-ngram-size", type=int,
                        help="CTranslate2 only (it reads no generation config): the model's no_repeat_ngram_size")
    parser.add_argument("--ct2-gemm", choices=CT2_GEMMS, default="auto",
                        help="CTranslate2 only: its GEMM library, Intel MKL or oneDNN (auto: its own choice by CPU vendor)")
    parser.add_argument("--ct2-threads", type=int,
                        help="CTranslate2 only: its threads, at most the spec's (default: the spec's)")
    args = parser.parse_args(argv)
    reset_peak_rss()  # the peak reported is this runtime's own, whatever started this process
    if args.num_beams < 1:
        parser.error(f"--num-beams must be at least 1, got {args.num_beams}")
    decode = {"num_beams": args.num_beams}
    decode.update({k: v for k, v in (("length_penalty", args.length_penalty), ("early_stopping", args.early_stopping),
                                     ("repetition_penalty", args.repetition_penalty),
                                     ("no_repeat_ngram_size", args.no_repeat_ngram_size))
                   if v is not None})
    spec = Spec.load(args.spec)
    threads = spec.threads
    if is_ct2(args.peer):
        threads = args.ct2_threads or spec.threads
        if not 1 <= threads <= spec.threads:
            parser.error(f"--ct2-threads must be in 1..{spec.threads} (the spec's threads), got {threads}")
        ct2_gemm_env(args.ct2_gemm)
    elif args.ct2_threads or args.ct2_gemm != "auto":
        parser.error(f"--ct2-gemm and --ct2-threads are CTranslate2 settings; {args.peer} takes neither")
    _threads_env(threads)
    start = time.perf_counter()
    _preimport(args.peer)
    import_s = time.perf_counter() - start
    rss_before = rss_mb()
    start = time.perf_counter()
    model = PeerModel(Path(args.source), args.src_lang, args.tgt_lang)
    runtime, info = load_peer(args.peer, args.model_dir, model, threads, decode)
    load_s = time.perf_counter() - start
    if is_ct2(args.peer):
        info["ct2_setting"] = {"gemm": args.ct2_gemm, "threads": threads}
    result = {"name": args.peer, "kind": "peer", "info": {**info, "threads": threads}, "decoding": decode,
              "call": runtime.kwargs,
              "import_s": import_s, "load_s": load_s, "rss_before_load_mb": rss_before,
              "rss_after_load_mb": rss_mb(), "size_bytes": info["size_bytes"],
              "versions": versions("transformers", "torch", "optimum", "optimum-onnx", "onnxruntime", "ctranslate2", "numpy")}
    result["tokenization_mismatches"] = tokenization_mismatches(runtime.tokenizer, spec)
    result.update(measure(runtime, spec, lambda msg: print(f"[{args.peer}] {msg}", file=sys.stderr, flush=True)))
    result["peak_rss_mb"] = peak_rss_mb()
    result["torch_in_process"] = "torch" in sys.modules
    Path(args.out).write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")
    return 0
