"""The runtimes a user would pick instead of ours, timed by the same protocol in the same run.

- `transformers`: `MarianMTModel.generate` (PyTorch eager), in the project's own environment.
- `optimum_fp32`: Hugging Face Optimum's `ORTModelForSeq2SeqLM` over its own export
  (`optimum-cli export onnx --task text2text-generation-with-past`, merged decoder with past).
- `optimum_int8`: the same, its encoder and merged decoder quantized by Optimum's `ORTQuantizer`
  (dynamic int8, `AutoQuantizationConfig.avx512_vnni` or `.avx2` after the CPU's flags).
- `ct2_float32`, `ct2_int8`: CTranslate2 `Translator` over the output of `ct2-transformers-converter`'s
  own Marian loader (`--quantization float32` / `int8`), `translate_batch(beam_size=N)`, run through
  `python -m bench.peers ct2-convert`: when the model's `<pad>` (decoder start) embedding is not zero it
  keeps that row, as transformers does, instead of the stock converter's zero start (see `ct2_convert`).

Optimum needs transformers<4.58, the project needs 5.x, so Optimum and CTranslate2 live in their own
environment, `.venv-bench` (`make bench-venv`, from requirements-bench.txt). The parent process
(`python -m bench speed --peers`) converts the model once per source weights into
`exports/peers/<export name>/` with that environment's tools, then runs each peer in its own
subprocess of that environment: `python -m bench.peers worker ...`, which imports only this module
and the measurement protocol (service/protocol.py, loaded by path: `bench/protocol.py` says why),
and writes its results as JSON.

Decoding: `--num-beams N` (default 1, greedy) on the worker's command line, as `python -m bench speed
--num-beams N` passes it. transformers and Optimum call `generate(num_beams=N, do_sample=False)` and
take length_penalty / early_stopping from the model folder's generation config unless
`--length-penalty` / `--early-stopping` are given; CTranslate2 runs `beam_size=N` with the given
length_penalty (it reads no generation config) and its own stopping rule (patience 1). CTranslate2
scores hypotheses its own way, so at N > 1 its outputs are compared as agreement, never expected
identical.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from runtime.memory import peak_rss_mb, reset_peak_rss, rss_mb
from runtime.protocol import Output, Spec, measure

PEER_NAMES = ("transformers", "optimum_fp32", "optimum_int8", "ct2_float32", "ct2_int8")
IN_PROJECT_ENV = ("transformers",)  # these run in the project's environment, the rest in .venv-bench
REPO = Path(__file__).resolve().parent.parent
DEFAULT_PEER_PYTHON = REPO / ".venv-bench" / "bin" / "python"
PEER_CACHE = REPO / "exports" / "peers"
CT2_RECIPE = "bench.peers ct2-convert v2 (learned decoder start kept)"
# CTranslate2's CPU settings: its GEMM library (CT2_USE_MKL; "auto" is its own choice by CPU vendor)
# and its thread count (intra_threads, and MKL's and OpenMP's). Which is fastest depends on the
# machine by 3-5x (docs/benchmarks.md), so `bench speed` probes them and keeps the fastest.
CT2_GEMMS = ("auto", "mkl", "dnnl")
EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


def early_stopping_arg(value: str) -> bool | str:
    """--early-stopping: true, false or never (generate()'s three settings)."""
    try:
        return EARLY_STOPPING[value.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected one of: {', '.join(EARLY_STOPPING)}; got {value!r}") from None


# --- parent side: conversions ------------------------------------------------------------------


def _dir_bytes(path: Path, pattern: str = "*") -> int:
    return sum(f.stat().st_size for f in Path(path).glob(pattern) if f.is_file())


def _converted(out: Path, stamp: dict) -> bool:
    f = out / "bench-stamp.json"
    return f.is_file() and json.loads(f.read_text()) == stamp


def _convert(cmd: list[str], out: Path, stamp: dict, log) -> float:
    """Run one converter into a temporary sibling, rename into place; returns seconds."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"converting: {' '.join(map(str, cmd))}")
    start = time.perf_counter()
    proc = subprocess.run([*map(str, cmd[:-1]), str(tmp)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    seconds = time.perf_counter() - start
    (tmp / "bench-stamp.json").write_text(json.dumps(stamp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return seconds


def prepare(source: Path, root: Path, peers: list[str], peer_python: Path, log=print) -> dict[str, dict]:
    """Convert `source` (a MarianMT folder) for each peer once, under `root`.

    Returns {peer: {"dir", "convert_s" or "reused"}} or {peer: {"error"}} when its conversion failed.

    A conversion is reused while its stamp (source folder and weights size/mtime) matches.
    """
    weights = next((source / n for n in ("model.safetensors", "pytorch_model.bin") if (source / n).is_file()), None)
    if weights is None:
        raise FileNotFoundError(f"{source}: no model.safetensors or pytorch_model.bin for the peers to convert")
    st = weights.stat()
    stamp = {"source": str(source.resolve()), "weights_bytes": st.st_size, "weights_mtime": st.st_mtime}
    bindir = Path(peer_python).parent
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    prepared = {}
    for peer in peers:
        if peer == "transformers":
            prepared[peer] = {"dir": str(source), "reused": True}
            continue
        if peer == "optimum_fp32":
            out = root / "optimum"
            cmd = [bindir / "optimum-cli", "export", "onnx", "--model", source,
                   "--task", "text2text-generation-with-past", out]
        elif peer == "optimum_int8":  # quantizes the fp32 export, made first if needed
            fp32 = prepared.get("optimum_fp32") or prepare(source, root, ["optimum_fp32"], peer_python, log)["optimum_fp32"]
            if "error" in fp32:
                prepared[peer] = {"error": f"needs the fp32 Optimum export, which failed: {fp32['error']}"}
                continue
            out = root / "optimum-int8"
            cmd = [peer_python, "-m", "bench.peers", "quantize", "--src", fp32["dir"], "--out", out]
        elif peer in ("ct2_float32", "ct2_int8"):
            quant = peer.split("_")[1]
            out = root / f"ct2-{quant}"
            cmd = [peer_python, "-m", "bench.peers", "ct2-convert", "--model", source, "--quantization", quant,
                   "--output_dir", out]
        else:
            raise ValueError(f"unknown peer {peer!r}; expected one of: {', '.join(PEER_NAMES)}")
        # Conversions made by an older recipe (the stock ct2 CLI) are redone.
        peer_stamp = {**stamp, "recipe": CT2_RECIPE} if peer.startswith("ct2") else stamp
        if _converted(out, peer_stamp):
            prepared[peer] = {"dir": str(out), "reused": True}
            continue
        try:
            prepared[peer] = {"dir": str(out), "convert_s": round(_convert(cmd, out, peer_stamp, log), 1)}
        except (OSError, RuntimeError) as e:  # reported per peer; the other peers still run
            prepared[peer] = {"error": f"conversion failed: {e}"}
    return prepared


# --- peer side: the runtimes --------------------------------------------------------------------


def _threads_env(threads: int) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)


def ct2_settings(threads: int) -> list[dict]:
    """The CTranslate2 settings worth trying with at most `threads` threads: MKL and oneDNN, each
    with one thread and with all of them (1 and `threads`; at 4 or more, half of them too)."""
    counts = sorted({1, max(1, threads // 2), threads} if threads >= 4 else {1, threads})
    return [{"gemm": g, "threads": t} for g in CT2_GEMMS if g != "auto" for t in counts]


def ct2_setting_args(setting: dict) -> list[str]:
    return ["--ct2-gemm", setting["gemm"], "--ct2-threads", str(setting["threads"])]


def _ct2_gemm_env(gemm: str) -> None:
    """Before ctranslate2 is imported: it reads CT2_USE_MKL once, when it loads."""
    if gemm == "auto":
        os.environ.pop("CT2_USE_MKL", None)
    else:
        os.environ["CT2_USE_MKL"] = "1" if gemm == "mkl" else "0"


def tokenization_mismatches(tokenizer, spec: Spec) -> list[int]:
    """Indices of sentences this environment's tokenizer encodes differently from the project's."""
    if spec.source_ids is None:
        return []
    return [i for i, (s, ids) in enumerate(zip(spec.sentences, spec.source_ids)) if tokenizer(s).input_ids != ids]


def generate_kwargs(decode: dict | None) -> dict:
    """generate()'s search options for a `decode` dict (num_beams, and length_penalty / early_stopping
    only when given: otherwise the model folder's generation config applies, as it does for our backends)."""
    decode = dict(decode or {})
    beams = int(decode.pop("num_beams", 1))
    kwargs = {"num_beams": beams, "do_sample": False, "num_return_sequences": 1, **decode}
    if beams == 1:
        # The config's forced_eos_token_id would replace the last token with eos when the cap is reached;
        # our backends' greedy search does not, so it is off to keep outputs comparable. In beam search
        # our backends force it as generate() does, so there the config's value applies.
        kwargs["forced_eos_token_id"] = None
    return kwargs


class _HFGenerate:
    """Shared by transformers and Optimum: MarianTokenizer + `generate` (greedy, or beam search)."""

    def __init__(self, model, tokenizer, decode: dict | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.kwargs = generate_kwargs(decode)

    def translate(self, texts, max_new_tokens, min_new_tokens):
        import torch

        batch = self.tokenizer(texts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = self.model.generate(**batch, **self.kwargs, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens)
        pad, eos = self.model.config.pad_token_id, self.model.config.eos_token_id
        results = []
        for row in out[:, 1:].tolist():  # drop the decoder start token
            ids = []
            for t in row:
                if t == pad:
                    break
                ids.append(t)
                if t == eos:
                    break
            results.append(Output(ids, self.tokenizer.decode(ids, skip_special_tokens=True)))
        return results


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


class _CT2:
    def __init__(self, model_dir: str, tokenizer, threads: int, compute_type: str, decode: dict | None = None):
        import ctranslate2

        self.translator, self.dispatch = _logged(lambda: ctranslate2.Translator(
            model_dir, device="cpu", compute_type=compute_type, intra_threads=threads, inter_threads=1
        ))
        self.tokenizer = tokenizer
        self.kwargs = ct2_kwargs(decode)

    def translate(self, texts, max_new_tokens, min_new_tokens):
        source = [self.tokenizer.convert_ids_to_tokens(ids) for ids in self.tokenizer(texts).input_ids]
        results = self.translator.translate_batch(
            source, **self.kwargs, max_decoding_length=max_new_tokens, min_decoding_length=min_new_tokens,
            return_end_token=True,
        )
        outs = []
        for r in results:
            ids = self.tokenizer.convert_tokens_to_ids(r.hypotheses[0])
            outs.append(Output(ids, self.tokenizer.decode(ids, skip_special_tokens=True)))
        return outs


def _versions(*packages: str) -> dict[str, str]:
    from importlib import metadata

    out = {}
    for p in packages:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out


def load_peer(peer: str, model_dir: str, source: str, threads: int, decode: dict | None = None) -> tuple[object, dict]:
    """(runtime, info); imports of the runtime library happen before this is timed. `decode`: num_beams
    (default 1, greedy) and, when given, length_penalty / early_stopping."""
    from transformers import MarianTokenizer

    tokenizer = MarianTokenizer.from_pretrained(source)
    if peer == "transformers":
        import torch
        from transformers import MarianMTModel

        torch.set_num_threads(threads)
        model = MarianMTModel.from_pretrained(model_dir).eval()
        info = {"runtime": f"transformers {_versions('transformers')['transformers']} generate, PyTorch {torch.__version__} eager",
                "precision": "fp32", "files": ["model.safetensors"]}
        size = _dir_bytes(Path(model_dir), "model.safetensors") or _dir_bytes(Path(model_dir), "pytorch_model.bin")
        return _HFGenerate(model, tokenizer, decode), {**info, "size_bytes": size}
    if peer in ("optimum_fp32", "optimum_int8"):
        import onnxruntime as ort
        import torch
        from optimum.onnxruntime import ORTModelForSeq2SeqLM

        torch.set_num_threads(threads)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        model = ORTModelForSeq2SeqLM.from_pretrained(
            model_dir, use_merged=True, use_cache=True, session_options=options, provider="CPUExecutionProvider"
        )
        # Which graph files were really loaded (Optimum can load decoder_with_past silently).
        loaded = [Path(p).name for p in (model.encoder.path, model.decoder.path,
                                         getattr(model.decoder_with_past, "path", None)) if p is not None]
        v = _versions("optimum-onnx", "optimum", "onnxruntime", "transformers")
        info = {"runtime": f"Optimum ORT {v.get('optimum-onnx')} (onnxruntime {v.get('onnxruntime')}, transformers {v.get('transformers')})",
                "precision": "int8 (dynamic)" if peer == "optimum_int8" else "fp32", "files": loaded}
        size = sum((Path(model_dir) / f).stat().st_size for f in loaded)
        q = Path(model_dir) / "bench-quantization.json"
        if q.is_file():
            info["quantization"] = json.loads(q.read_text())
        return _HFGenerate(model, tokenizer, decode), {**info, "size_bytes": size}
    if peer in ("ct2_float32", "ct2_int8"):
        compute = peer.split("_")[1]
        runtime = _CT2(model_dir, tokenizer, threads, compute, decode)
        v = _versions("ctranslate2")
        info = {"runtime": f"CTranslate2 {v.get('ctranslate2')}", "precision": compute, "files": ["model.bin"],
                "size_bytes": _dir_bytes(Path(model_dir), "model.bin"), "dispatch": runtime.dispatch}
        note = Path(model_dir) / "bench-conversion.json"
        if note.is_file():
            info["conversion"] = json.loads(note.read_text())
        return runtime, info
    raise ValueError(f"unknown peer {peer!r}; expected one of: {', '.join(PEER_NAMES)}")


def _preimport(peer: str) -> None:
    import transformers  # noqa: F401

    if peer in ("transformers", "optimum_fp32", "optimum_int8"):
        import torch  # noqa: F401
    if peer in ("optimum_fp32", "optimum_int8"):
        import optimum.onnxruntime  # noqa: F401
    if peer.startswith("ct2"):
        import ctranslate2  # noqa: F401


def worker(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers worker")
    parser.add_argument("--peer", required=True, choices=PEER_NAMES)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--source", required=True, help="the MarianMT folder (its tokenizer)")
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
    if args.peer.startswith("ct2"):
        threads = args.ct2_threads or spec.threads
        if not 1 <= threads <= spec.threads:
            parser.error(f"--ct2-threads must be in 1..{spec.threads} (the spec's threads), got {threads}")
        _ct2_gemm_env(args.ct2_gemm)
    elif args.ct2_threads or args.ct2_gemm != "auto":
        parser.error(f"--ct2-gemm and --ct2-threads are CTranslate2 settings; {args.peer} takes neither")
    _threads_env(threads)
    start = time.perf_counter()
    _preimport(args.peer)
    import_s = time.perf_counter() - start
    rss_before = rss_mb()
    start = time.perf_counter()
    runtime, info = load_peer(args.peer, args.model_dir, args.source, threads, decode)
    load_s = time.perf_counter() - start
    if args.peer.startswith("ct2"):
        info["ct2_setting"] = {"gemm": args.ct2_gemm, "threads": threads}
    result = {"name": args.peer, "kind": "peer", "info": {**info, "threads": threads}, "decoding": decode,
              "call": runtime.kwargs,
              "import_s": import_s, "load_s": load_s, "rss_before_load_mb": rss_before,
              "rss_after_load_mb": rss_mb(), "size_bytes": info["size_bytes"],
              "versions": _versions("transformers", "torch", "optimum", "optimum-onnx", "onnxruntime", "ctranslate2", "numpy")}
    result["tokenization_mismatches"] = tokenization_mismatches(runtime.tokenizer, spec)
    result.update(measure(runtime, spec, lambda msg: print(f"[{args.peer}] {msg}", file=sys.stderr, flush=True)))
    result["peak_rss_mb"] = peak_rss_mb()
    result["torch_in_process"] = "torch" in sys.modules
    Path(args.out).write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")
    return 0


QUANTIZED = ("encoder_model.onnx", "decoder_model_merged.onnx")
COPIED = ("config.json", "generation_config.json", "source.spm", "target.spm", "vocab.json", "tokenizer_config.json",
          "special_tokens_map.json")


def quantize(argv=None) -> int:
    """Dynamic int8 quantization of an Optimum export's encoder and merged decoder, standard file names kept."""
    parser = argparse.ArgumentParser(prog="python -m bench.peers quantize")
    parser.add_argument("--src", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    flags = Path("/proc/cpuinfo").read_text().split()
    preset = "avx512_vnni" if "avx512_vnni" in flags else "avx2"
    config = getattr(AutoQuantizationConfig, preset)(is_static=False, per_channel=False)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in QUANTIZED:
        ORTQuantizer.from_pretrained(args.src, file_name=name).quantize(config, args.out, file_suffix=None)
    for name in COPIED:
        if (args.src / name).is_file():
            shutil.copy2(args.src / name, args.out / name)
    (args.out / "bench-quantization.json").write_text(json.dumps({"preset": preset, "per_channel": False}))
    return 0


def ct2_convert(argv=None) -> int:
    """`ct2-transformers-converter --model M --quantization Q --output_dir O`, exact for trained tied-embedding Marians.

    transformers starts Marian's decoder from the embedding of `decoder_start_token_id` (= `<pad>`), times
    sqrt(d_model) with `scale_embedding`, plus position 0. CTranslate2's `MarianMTLoader` instead drops the
    `<pad>` row from the vocabulary and every embedding/output matrix and sets `start_from_zero_embedding`:
    exact for models converted from Marian C++ (the opus-mt family, and random fixtures, whose `<pad>` row is
    zero) but not for a model trained in transformers with tied embeddings, where the output layer's
    gradient makes the `<pad>` row non-zero (`assets/marian-en-zh-small`: |max| 0.10, norm 0.45). There every
    first step differed (forced log-prob of PyTorch's first token off by 3-11 nats) and no output matched.

    When that row is non-zero this keeps it: vocabulary and weights keep `<pad>` (15,123 rows), the decoder
    starts from the `<pad>` token's embedding (`decoder_start_token: <pad>`, `start_from_zero_embedding`
    false), and the output bias of `<pad>` is set to -1e9 so it is never generated, like transformers'
    `bad_words_ids=[[pad]]` and the stock converter's removed row. When the row is zero the stock loader runs
    unchanged. `bench-conversion.json` in the output says which.
    """
    parser = argparse.ArgumentParser(prog="python -m bench.peers ct2-convert")
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", default="float32")
    parser.add_argument("--output_dir", required=True, type=Path)
    args = parser.parse_args(argv)
    import torch
    from ctranslate2.converters import TransformersConverter
    from ctranslate2.converters import transformers as ct2t

    stock = ct2t._MODEL_LOADERS["MarianConfig"]
    note = {"loader": "ctranslate2 MarianMTLoader (stock)", "decoder_start": "zero embedding"}

    class LearnedStartMarianLoader(type(stock)):
        learned_start = False

        def get_model_spec(self, model):
            pad = model.config.pad_token_id
            row = model.model.decoder.embed_tokens.weight[pad]
            note["pad_row_abs_max"] = float(row.abs().max())
            self.learned_start = bool(row.any())
            if not self.learned_start:
                return super().get_model_spec(model)
            model.config.normalize_before = False
            model.config.normalize_embedding = False
            spec = ct2t.BartLoader.get_model_spec(self, model)  # the Marian settings, minus the <pad> row removal
            projection = spec.decoder.projection
            bias = torch.as_tensor(projection.bias).clone() if projection.has_bias() else torch.zeros(model.config.vocab_size)
            bias[pad] = -1e9
            projection.bias = bias
            note.update(loader="ctranslate2 MarianMTLoader, <pad> row kept (bench.peers ct2-convert)",
                        decoder_start="learned <pad> embedding, as transformers", pad_output_bias=-1e9)
            return spec

        def set_decoder(self, spec, decoder):
            super().set_decoder(spec, decoder)
            spec.start_from_zero_embedding = not self.learned_start

        def set_config(self, config, model, tokenizer):
            super().set_config(config, model, tokenizer)
            if self.learned_start:
                config.decoder_start_token = tokenizer.convert_ids_to_tokens(model.config.decoder_start_token_id)

        def get_vocabulary(self, model, tokenizer):
            if self.learned_start:
                return ct2t.BartLoader.get_vocabulary(self, model, tokenizer)
            return super().get_vocabulary(model, tokenizer)

    ct2t._MODEL_LOADERS["MarianConfig"] = LearnedStartMarianLoader()
    try:
        TransformersConverter(args.model).convert(str(args.output_dir), quantization=args.quantization, force=True)
    finally:
        ct2t._MODEL_LOADERS["MarianConfig"] = stock
    (args.output_dir / "bench-conversion.json").write_text(json.dumps(note))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        raise SystemExit(worker(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "quantize":
        raise SystemExit(quantize(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "ct2-convert":
        raise SystemExit(ct2_convert(sys.argv[2:]))
    raise SystemExit("usage: python -m bench.peers worker --peer NAME ... (driven by `python -m bench speed --peers`)")
