"""The Hugging Face peers: transformers' generate() in PyTorch, and Optimum's ORT models.

Both run the family's own `generate()` (greedy or beam search) over the family's tokenizer; only
the model under it differs. `quantize` makes Optimum's int8 export from its fp32 one.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from runtime.protocol import Output

from .model import PeerModel, dir_bytes, versions
from .specs import PEERS

EARLY_STOPPING = {"true": True, "false": False, "never": "never"}


def early_stopping_arg(value: str) -> bool | str:
    """--early-stopping: true, false or never (generate()'s three settings)."""
    try:
        return EARLY_STOPPING[value.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected one of: {', '.join(EARLY_STOPPING)}; got {value!r}") from None


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


class HFGenerate:
    """Shared by transformers and Optimum: the family's tokenizer + `generate` (greedy, or beam search).
    `forced_bos`: the target language's code, forced first as our backends force it (None: no codes)."""

    def __init__(self, model, tokenizer, decode: dict | None = None, forced_bos: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.kwargs = generate_kwargs(decode)
        if forced_bos is not None:
            self.kwargs["forced_bos_token_id"] = forced_bos

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


def load_transformers(model: PeerModel, model_dir: str, threads: int, decode: dict | None) -> tuple[HFGenerate, dict]:
    """generate() of the family's transformers class, PyTorch eager, over the source folder."""
    import torch
    import transformers

    tokenizer = model.tokenizer()
    torch.set_num_threads(threads)
    cls = getattr(transformers, model.family().architecture)
    module = cls.from_pretrained(model_dir).eval()
    info = {"runtime": f"transformers {versions('transformers')['transformers']} generate, PyTorch {torch.__version__} eager",
            "precision": "fp32", "files": ["model.safetensors"]}
    size = dir_bytes(Path(model_dir), "model.safetensors") or dir_bytes(Path(model_dir), "pytorch_model.bin")
    return HFGenerate(module, tokenizer, decode, model.forced_bos(tokenizer)), {**info, "size_bytes": size}


def load_optimum(name: str, model: PeerModel, model_dir: str, threads: int, decode: dict | None) -> tuple[HFGenerate, dict]:
    """Optimum's ORTModelForSeq2SeqLM over its own export (merged decoder with past), on ORT's CPU provider."""
    import onnxruntime as ort
    import torch
    from optimum.onnxruntime import ORTModelForSeq2SeqLM

    tokenizer = model.tokenizer()
    torch.set_num_threads(threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    module = ORTModelForSeq2SeqLM.from_pretrained(
        model_dir, use_merged=True, use_cache=True, session_options=options, provider="CPUExecutionProvider"
    )
    # Which graph files were really loaded (Optimum can load decoder_with_past silently).
    loaded = [Path(p).name for p in (module.encoder.path, module.decoder.path,
                                     getattr(module.decoder_with_past, "path", None)) if p is not None]
    v = versions("optimum-onnx", "optimum", "onnxruntime", "transformers")
    precision = "int8 (dynamic)" if PEERS[name].precision == "int8" else "fp32"
    info = {"runtime": f"Optimum ORT {v.get('optimum-onnx')} (onnxruntime {v.get('onnxruntime')}, transformers {v.get('transformers')})",
            "precision": precision, "files": loaded}
    size = sum((Path(model_dir) / f).stat().st_size for f in loaded)
    q = Path(model_dir) / "bench-quantization.json"
    if q.is_file():
        info["quantization"] = json.loads(q.read_text())
    return HFGenerate(module, tokenizer, decode, model.forced_bos(tokenizer)), {**info, "size_bytes": size}


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
