"""Load and save ONNX graphs with or without external data, one way for every step that writes one.

A protobuf cannot exceed 2 GB, so a graph whose weights are larger (NLLB-600M: 2.46 GB in fp32)
keeps them in one external data file next to it, `<graph file>.data`, which the sidecar lists and
checksums with the graph. Every step that rewrites a graph (export/rewrite.py, fp16, int8) saves
through `save`, which writes that file whenever the source graph had one.
"""

from __future__ import annotations

from pathlib import Path

import onnx


def data_file(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".data")


def external_files(path: Path) -> list[str]:
    """The external data files a graph refers to (names relative to its folder), without loading them."""
    model = onnx.load(str(path), load_external_data=False)
    found = []
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), None)
            if location and location not in found:
                found.append(location)
    return found


def save(model: onnx.ModelProto, path: Path, external_data: bool) -> None:
    """Write `model` to `path`; its weights to `<path>.data` when `external_data` (any previous data
    files of this graph are removed first: onnx appends to an existing data file)."""
    path = Path(path)
    stale = external_files(path) if path.is_file() else []
    for name in {*stale, data_file(path).name}:
        (path.parent / name).unlink(missing_ok=True)
    if external_data:
        onnx.save_model(
            model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
            location=data_file(path).name, size_threshold=1024,
        )
    else:
        onnx.save(model, str(path))


def check(path: Path) -> None:
    """onnx's checker on the file (by path, so graphs over 2 GB with external data are checked too)."""
    onnx.checker.check_model(str(path))
