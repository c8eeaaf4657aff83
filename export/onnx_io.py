"""Load and save ONNX graphs with or without external data, one way for every step that writes one.

A protobuf cannot exceed 2 GB, so a graph whose weights are larger (NLLB-600M: 2.46 GB in fp32)
keeps them in one external data file next to it, `<graph file>.data`, which the sidecar lists and
checksums with the graph. Every step that rewrites a graph (export/rewrite.py, fp16, int8) saves
through `save`, which writes that file whenever the source graph had one.

Streaming: a step that rewrites structure loads the graph without its weights (`load_structure`),
reads only the tensors it changes (`read_array(tensor, folder)`), and `save(...,
source=folder)` copies every other weight file to file, so no step holds a graph's weights in memory.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

# Tensors smaller than this stay inside the graph file, as onnx.save_model's size_threshold.
SIZE_THRESHOLD = 1024
# Bytes per read when a weight is copied or converted file to file.
CHUNK_BYTES = 64 << 20


def data_file(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".data")


def external_files(path: Path) -> list[str]:
    """The external data files a graph refers to (names relative to its folder), without loading them."""
    return external_locations(onnx.load(str(path), load_external_data=False))


def external_locations(model: onnx.ModelProto) -> list[str]:
    """The external data files a loaded structure refers to, in first-use order."""
    found = []
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), None)
            if location and location not in found:
                found.append(location)
    return found


def initializer_bytes(model: onnx.ModelProto) -> dict[str, int]:
    """Bytes of a graph's weights by element type ("float32", "float16", "int8", ...), from their
    shapes: external tensors are not read."""
    totals: dict[str, int] = {}
    for tensor in model.graph.initializer:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        totals[dtype.name] = totals.get(dtype.name, 0) + int(np.prod(tensor.dims, dtype=np.int64)) * dtype.itemsize
    return totals


def gathered_tables(model: onnx.ModelProto, folder: Path | None = None) -> dict[str, int]:
    """sha256 of the bytes -> bytes, for each 2-D weight that a Gather reads and that
    backends/shared_tables.py would share (its `MIN_BYTES` or more): a backend whose graphs gather
    the same table holds it once, so the memory estimate counts it once (`backends.memory_needs`).
    External tables are read a block at a time."""
    import hashlib

    from backends.shared_tables import MIN_BYTES

    gathered = {n.input[0] for n in model.graph.node if n.op_type == "Gather"}
    found = {}
    for tensor in model.graph.initializer:
        if tensor.name not in gathered or len(tensor.dims) != 2:
            continue
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
        size = int(np.prod(tensor.dims, dtype=np.int64)) * dtype.itemsize
        if size < MIN_BYTES:
            continue
        digest = hashlib.sha256(f"{dtype.str}{list(tensor.dims)}".encode())
        for block in read_row_blocks(tensor, folder):
            digest.update(np.ascontiguousarray(block).tobytes())
        found[digest.hexdigest()] = size
    return found


def _fp16_readers(model: onnx.ModelProto) -> list[tuple[int, set[str]]]:
    """(bytes, op types reading it) of each fp16 weight."""
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    return [(int(np.prod(t.dims, dtype=np.int64)) * 2, readers.get(t.name, set()))
            for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]


def widened_fp16_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the fp16 weights that a node other than a Gather reads: ONNX Runtime's CPU kernels
    compute those in fp32, so a CPU session holds an fp32 copy of each (twice these bytes). A table
    only gathered from stays fp16."""
    return sum(size for size, ops in _fp16_readers(model) if ops - {"Gather"})


def replaced_fp16_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the fp16 weights that only such nodes read: once ORT has folded their widening
    Cast, nothing needs the fp16 original and the session drops it. A tied table, also gathered
    from, is held twice: fp16 for the Gather, fp32 for the MatMul."""
    return sum(size for size, ops in _fp16_readers(model) if ops and "Gather" not in ops)


def load_structure(path: Path) -> onnx.ModelProto:
    """The graph with its external weights left on disk (read one with `read_array(tensor, folder)`)."""
    return onnx.load(str(path), load_external_data=False)


def _external(tensor: onnx.TensorProto) -> tuple[ExternalDataInfo, np.dtype, int]:
    """An external tensor's data-file entry, element type and element count, its length checked."""
    info = ExternalDataInfo(tensor)
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    count = int(np.prod(tensor.dims, dtype=np.int64))
    if info.length and info.length != count * dtype.itemsize:
        raise ValueError(f"{tensor.name}: {info.length} bytes of external data for shape {list(tensor.dims)}")
    return info, dtype, count


def read_array(tensor: onnx.TensorProto, folder: Path) -> np.ndarray:
    """A tensor's values, an external one read from its data file in `folder` without touching the
    tensor (`numpy_helper.to_array` would load the bytes into it and keep them there)."""
    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    info, dtype, count = _external(tensor)
    with open(Path(folder) / info.location, "rb") as src:
        src.seek(info.offset or 0)
        array = np.fromfile(src, dtype=dtype, count=count)
    if array.size != count:
        raise OSError(f"{info.location} ends before tensor {tensor.name!r} does")
    return array.reshape(tuple(int(d) for d in tensor.dims))


def read_row_blocks(tensor: onnx.TensorProto, folder: Path | None = None) -> Iterator[np.ndarray]:
    """A 2-D tensor's rows, CHUNK_BYTES at a time: from its data file in `folder` when external."""
    rows, cols = (int(d) for d in tensor.dims)
    if not uses_external_data(tensor):
        whole = numpy_helper.to_array(tensor)
        block = max(1, CHUNK_BYTES // max(1, cols * whole.itemsize))
        for start in range(0, rows, block):
            yield whole[start:start + block]
        return
    info, dtype, _ = _external(tensor)
    block = max(1, CHUNK_BYTES // max(1, cols * dtype.itemsize))
    with open(Path(folder or ".") / info.location, "rb") as src:
        src.seek(info.offset or 0)
        for start in range(0, rows, block):
            n = min(block, rows - start)
            part = np.fromfile(src, dtype=dtype, count=n * cols)
            if part.size != n * cols:
                raise OSError(f"{info.location} ends before tensor {tensor.name!r} does")
            yield part.reshape(n, cols)


def _initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every initializer of `graph` and of its subgraphs, in the order onnx.save_model writes them."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _initializers(sub)


def _point_to(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make `tensor` external at `location`, bytes [offset, offset + length), as onnx.save_model records it."""
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        tensor.external_data.add(key=key, value=value)


def _copy_range(src, dst, offset: int, length: int, convert: Callable[[bytes], bytes] | None) -> None:
    """Append `length` bytes of `src` from `offset` to `dst`, through `convert` chunk by chunk."""
    src.seek(offset)
    left = length
    while left:
        chunk = src.read(min(CHUNK_BYTES, left))
        if not chunk:
            raise OSError(f"{src.name} ends {left} bytes before the tensor it should hold")
        left -= len(chunk)
        dst.write(convert(chunk) if convert else chunk)


def _save_streamed(model: onnx.ModelProto, path: Path, source: Path | None,
                   convert: Mapping[str, Callable[[bytes], bytes]]) -> None:
    """Write the weights to `<path>.data` one tensor at a time (external ones copied from `source`),
    then the graph; both under temporary names first, since `source` may be the file replaced."""
    data = data_file(path)
    data_tmp, graph_tmp = data.with_name(data.name + ".partial"), path.with_name(path.name + ".partial")
    handles: dict[str, object] = {}
    try:
        with open(data_tmp, "wb") as out:
            for tensor in _initializers(model.graph):
                offset = out.tell()
                if uses_external_data(tensor):
                    if source is None:
                        raise ValueError(f"tensor {tensor.name!r} is external and no source folder was given")
                    info = ExternalDataInfo(tensor)
                    src = handles.get(info.location)
                    if src is None:
                        src = handles[info.location] = open(Path(source) / info.location, "rb")
                    _copy_range(src, out, info.offset or 0, info.length, convert.get(tensor.name))
                elif tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= SIZE_THRESHOLD:
                    out.write(tensor.raw_data)
                else:
                    continue
                _point_to(tensor, data.name, offset, out.tell() - offset)
        graph_tmp.write_bytes(model.SerializeToString())
    except BaseException:
        data_tmp.unlink(missing_ok=True)
        graph_tmp.unlink(missing_ok=True)
        raise
    finally:
        for handle in handles.values():
            handle.close()
    os.replace(data_tmp, data)
    os.replace(graph_tmp, path)


def save(model: onnx.ModelProto, path: Path, external_data: bool, source: Path | None = None,
         convert: Mapping[str, Callable[[bytes], bytes]] | None = None) -> None:
    """Write `model` to `path`; its weights to `<path>.data` when `external_data` (any previous data
    files of this graph are removed: onnx appends to an existing data file).

    `source`: the folder the model's external tensors live in (a graph from `load_structure`); they
    are copied file to file, through `convert[name]` where given (bytes in, bytes out, chunk by
    chunk: an elementwise conversion such as fp32 -> fp16)."""
    path = Path(path)
    convert = convert or {}
    stale = external_files(path) if path.is_file() else []
    if not external_data:
        if source is not None:
            from onnx.external_data_helper import load_external_data_for_model

            load_external_data_for_model(model, str(source))
        for name in {*stale, data_file(path).name}:
            (path.parent / name).unlink(missing_ok=True)
        onnx.save(model, str(path))
        return
    _save_streamed(model, path, source, convert)
    for name in set(stale) - {data_file(path).name}:
        (path.parent / name).unlink(missing_ok=True)


def scratch_name(tensor_name: str) -> str:
    """A file name for a tensor written on its own before it is copied into a graph's data file."""
    return ".scratch-" + re.sub(r"[^A-Za-z0-9._-]", "_", tensor_name)


def transpose_to_file(tensor: onnx.TensorProto, folder: Path, name: str) -> onnx.TensorProto:
    """The transpose of a 2-D external tensor of `folder`, written block by block to a scratch file
    there (`scratch_name(name)`), as an external tensor named `name`; the caller removes the file
    once the graph is saved. Rows are read a block at a time and written as column segments, so
    neither the tensor nor its transpose is ever in memory whole."""
    rows, cols = (int(d) for d in tensor.dims)
    info, dtype, _ = _external(tensor)
    item = dtype.itemsize
    block = max(1, CHUNK_BYTES // (cols * item))
    scratch = Path(folder) / scratch_name(name)
    try:
        with open(Path(folder) / info.location, "rb") as src, open(scratch, "wb") as out:
            out.truncate(rows * cols * item)
            for start in range(0, rows, block):
                n = min(block, rows - start)
                src.seek((info.offset or 0) + start * cols * item)
                part = np.frombuffer(src.read(n * cols * item), dtype=dtype).reshape(n, cols)
                for c, column in enumerate(np.ascontiguousarray(part.T)):  # row c of the transpose, from `start`
                    out.seek((c * rows + start) * item)
                    out.write(column.tobytes())
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
    result = onnx.TensorProto(name=name, data_type=tensor.data_type, dims=[cols, rows])
    _point_to(result, scratch.name, 0, rows * cols * item)
    return result


def check(path: Path) -> None:
    """onnx's checker on the file (by path, so graphs over 2 GB with external data are checked too)."""
    onnx.checker.check_model(str(path))
