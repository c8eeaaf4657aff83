"""An export's copy whose fp32 graphs carry fp16-rounded weights, computed in fp32.

`python -m bench fp16-weights EXPORT --out DIR [--part all|encoder|decoder|large|small|all-but-output]`
copies EXPORT to DIR and rounds the chosen float32 weights of its fp32 KV-cache graphs (`encoder`,
`decoder`) to the nearest fp16 value, stored back as float32; every product and sum still runs in
fp32. `python -m bench quality --model DIR --backends pytorch,ort_fp32_kv_cache` then says how
much of the fp16 export's disagreement with PyTorch the weights' rounding alone explains, apart
from fp16 arithmetic. Values outside fp16's range (masks' large negatives) are left as they are.
The sidecar's file hashes are updated so the copy loads; every other graph is the original's.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np

from backends.manifest import MANIFEST_NAME, load_manifest, sha256_file

PARTS = ("all", "encoder", "decoder", "large", "small", "all-but-output")
# A weight of at least this many values is a "large" one: the products' matrices and the embeddings.
LARGE = 65_536
OUTPUT_LAYER = "lm_head"


def round_to_fp16(values: np.ndarray) -> np.ndarray:
    """Each value as the nearest fp16 one, as float32; those fp16 cannot hold stay as they are."""
    rounded = values.astype(np.float16).astype(np.float32)
    outside = np.abs(values) > np.finfo(np.float16).max
    rounded[outside] = values[outside]
    return rounded


def _chosen(graph: str, name: str, size: int, part: str) -> bool:
    if part in ("encoder", "decoder"):
        return graph == part
    if part == "large":
        return size >= LARGE
    if part == "small":
        return size < LARGE
    if part == "all-but-output":
        return not name.startswith(OUTPUT_LAYER)
    return True


def round_weights(export_dir: str | Path, out: str | Path, part: str = "all") -> dict[str, int]:
    """Copy `export_dir` to `out` (which must not exist) with `part` of its fp32 graphs' weights
    rounded; returns values rounded per graph file."""
    import onnx
    from onnx import numpy_helper

    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}; expected one of: {', '.join(PARTS)}")
    src, out = Path(export_dir), Path(out)
    manifest = load_manifest(src)
    if out.exists():
        raise ValueError(f"{out} exists: name a new folder for the copy")
    files = {graph: manifest.graph(graph) for graph in ("encoder", "decoder")}  # ManifestError names what it has
    for graph in files.values():
        if graph.get("external_data"):  # the sidecar lists each graph's external data files
            raise ValueError(f"{src / graph['file']} keeps its weights in external data files (a model past "
                             "2 GB): this copy is made for graphs that hold their weights")
    shutil.copytree(src, out)
    counts: dict[str, int] = {}
    sidecar = copy.deepcopy(manifest.data)
    for graph, entry in files.items():
        name = entry["file"]
        model = onnx.load(out / name)
        counts[name] = 0
        for tensor in model.graph.initializer:
            if tensor.data_type != onnx.TensorProto.FLOAT:
                continue
            values = numpy_helper.to_array(tensor)
            if _chosen(graph, tensor.name, values.size, part):
                tensor.CopyFrom(numpy_helper.from_array(round_to_fp16(values), tensor.name))
                counts[name] += int(values.size)
        onnx.save(model, out / name)
        sidecar["files"][name] = {"sha256": sha256_file(out / name), "bytes": (out / name).stat().st_size}
    (out / MANIFEST_NAME).write_text(json.dumps(sidecar, indent=1, ensure_ascii=False), encoding="utf-8")
    return counts
