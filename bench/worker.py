"""python -m bench.worker: one of our backends, alone in this process, through the measurement protocol.

Driven by `python -m bench speed`: one subprocess per backend, so each one's load time and peak
resident memory are its own (no other backend's sessions or torch in the same process). Decoding:
`--num-beams N` (default 1, greedy), and for beam search `--length-penalty` / `--early-stopping`
when given (otherwise the export's generation config decides), passed on to `Backend.translate`.
`--external-dir DIR`: the backend is an Optimum-layout export of the same model (backends/ort_external.py)
named `--backend`, checked against `--export` and run through the same decoding loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from runtime.memory import peak_rss_mb, reset_peak_rss, rss_mb
from runtime.protocol import BackendRuntime, Spec, measure

from .peers import early_stopping_arg


def size_on_disk(backend) -> tuple[int, list[str]]:
    """Bytes of the weights this backend reads: its graph files (+ external data), or PyTorch's weights."""
    manifest = backend.manifest
    source = backend.info.get("source")
    if source is not None:  # an external export: the graphs it runs, as its provenance lists them
        sizes = {}
        for graph in source["files"]:
            sizes[graph["file"]] = graph["bytes"]
            sizes.update((d["file"], d["bytes"]) for d in graph["external_data"])
        return sum(sizes.values()), list(sizes)
    if backend.name == "pytorch":
        from backends.pytorch import source_model_of

        source = Path(source_model_of(manifest))
        files = [f for f in ("model.safetensors", "pytorch_model.bin") if (source / f).is_file()][:1]
        return sum((source / f).stat().st_size for f in files), files
    files = []
    for name, graph in manifest.data["graphs"].items():
        if graph["file"] in backend.info.get("graph", "").replace(" ", "").split("+"):
            files += [graph["file"], *graph.get("external_data", [])]
    return sum(manifest.data["files"][f]["bytes"] for f in files), files


def _preimport(name: str) -> None:
    import onnxruntime  # noqa: F401

    import backends  # noqa: F401

    if name == "pytorch":
        import torch  # noqa: F401
        import transformers  # noqa: F401


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--export", required=True, type=Path)
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--num-beams", type=int, default=1, help="1: greedy search (the default)")
    parser.add_argument("--length-penalty", type=float, help="beam search; default: the export's generation config")
    parser.add_argument("--early-stopping", type=early_stopping_arg, help="beam search: true, false or never")
    parser.add_argument("--external-dir", type=Path, help="--backend names an Optimum-layout export of the same "
                        "model in this folder (backends/ort_external.py)")
    args = parser.parse_args(argv)
    reset_peak_rss()  # the peak reported is this runtime's own, whatever started this process
    decode = {"num_beams": args.num_beams}
    decode.update({k: v for k, v in (("length_penalty", args.length_penalty), ("early_stopping", args.early_stopping))
                   if v is not None})
    spec = Spec.load(args.spec)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(spec.threads)

    start = time.perf_counter()
    _preimport(args.backend)
    import_s = time.perf_counter() - start
    from backends import SessionConfig, load_backends

    rss_before = rss_mb()
    start = time.perf_counter()
    external = {args.backend: args.external_dir} if args.external_dir else None
    backend = load_backends(args.export, names=() if external else (args.backend,), external=external,
                            session=SessionConfig(threads=spec.threads))[args.backend]
    load_s = time.perf_counter() - start
    size, files = size_on_disk(backend)
    result = {
        "name": args.backend,
        "kind": "backend",
        "info": {**backend.info, "files": files},
        "import_s": import_s,
        "load_s": load_s,
        "rss_before_load_mb": rss_before,
        "rss_after_load_mb": rss_mb(),
        "size_bytes": size,
        "decoding": decode,
    }
    result.update(measure(BackendRuntime(backend, decode), spec, lambda m: print(f"[{args.backend}] {m}", file=sys.stderr, flush=True)))
    result["peak_rss_mb"] = peak_rss_mb()
    result["torch_in_process"] = "torch" in sys.modules  # the ORT backends must run without it
    args.out.write_text(json.dumps(result, ensure_ascii=False), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
