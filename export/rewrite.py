"""Graph rewrites of the exported fp32 graphs that move weights, not numbers.

`pre_transpose_tied_embedding`: a tied output layer is exported as one initializer `W` (V, d) read
by the embedding `Gather(W, ids)` and by the output layer `MatMul(h, Transpose(W))`. ONNX Runtime
would fold the Transpose into a second, transposed copy per session, and the int8 quantizer skips
a MatMul whose weight is not an initializer; the rewrite stores that copy `W_t` (d, V) in the
graph for the MatMul, bit-identical values. The Gather keeps reading rows of `W`: a column of `W_t`
is d numbers a cache line apart. At run time `W` is the encoder's embedding table, held once
(`backends/shared_tables.py`), and ORT frees `W_t` once it has packed it for the MatMul.

`quantize_gathers`: after ORT's dynamic quantization, every embedding Gather reads int8 numbers
(the output layer's own, where the table is tied).

The attention rewrites are in `attention.py`. Every node a rewrite adds carries the metadata of
the node it stands for (`copy_metadata`): the dynamo exporter records on each node the module it
came from, and `service/locate.py` maps graph values back to the model's modules with it;
`copy_scope_metadata` does the same for the nodes ONNX Runtime's quantizer writes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper


class RewriteError(RuntimeError):
    pass


def _rank(graph: onnx.GraphProto, name: str) -> int | None:
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.name == name and vi.type.tensor_type.HasField("shape"):
            return len(vi.type.tensor_type.shape.dim)
    return None


def _readers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """tensor name -> the nodes that read it"""
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            out.setdefault(name, []).append(node)
    return out


def copy_metadata(node: onnx.NodeProto, source: onnx.NodeProto) -> None:
    """Give `node` the metadata of `source`, the node it replaces or helps (nothing if it has some)."""
    if not node.metadata_props:
        node.metadata_props.extend(source.metadata_props)


def copy_scope_metadata(source: onnx.ModelProto, model: onnx.ModelProto) -> int:
    """Metadata for the nodes a tool wrote into `model`, a rewrite of `source` (ORT's quantizer).

    A node without metadata that produces a value `source` also produces (the quantizer's last Mul
    writes the replaced MatMul's output name) takes that producer's metadata; then, walking back,
    a node without metadata whose outputs are read only by nodes of one module (the MatMulInteger
    and Cast before that Mul) takes theirs. A node feeding several modules (one activation
    quantized once for q, k and v) stays without. Returns how many nodes got metadata.
    """
    producers = {o: n for n in source.graph.node if n.metadata_props for o in n.output}
    copied = 0
    for node in model.graph.node:
        origin = next((producers[o] for o in node.output if o in producers), None)
        if origin is not None and not node.metadata_props:
            copy_metadata(node, origin)
            copied += 1
    readers = _readers(model.graph)
    outputs = {o.name for o in model.graph.output}
    for node in reversed(model.graph.node):  # topological order reversed: readers first
        if node.metadata_props or any(o in outputs for o in node.output):
            continue
        users = [u for o in node.output for u in readers.get(o, [])]
        scopes = {tuple((p.key, p.value) for p in u.metadata_props if p.key == "namespace") for u in users}
        if users and all(u.metadata_props for u in users) and len(scopes) == 1 and scopes != {()}:
            copy_metadata(node, users[0])
            copied += 1
    return copied


def pre_transpose_tied_embedding(model: onnx.ModelProto, folder: Path | None = None) -> dict:
    """Rewrite in place; returns what changed (empty `weights` when there was nothing to do).

    `folder`: where a graph from `onnx_io.load_structure` keeps its weights; an external table is
    transposed file to file into a scratch file there (`onnx_io.transpose_to_file`)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers = _readers(graph)

    done = []
    for tr in [n for n in graph.node if n.op_type == "Transpose"]:
        weight = tr.input[0]
        perm = next((list(a.ints) for a in tr.attribute if a.name == "perm"), None)
        if weight not in inits or len(inits[weight].dims) != 2 or perm != [1, 0]:
            continue
        users = consumers.get(tr.output[0], [])
        if not users or any(u.op_type != "MatMul" or list(u.input).index(tr.output[0]) != 1 for u in users):
            continue
        others = [n for n in consumers.get(weight, []) if n is not tr]
        if any(n.op_type != "Gather" for n in others):
            continue  # some other reader needs (V, d): leave the graph alone

        t_name = f"{weight}.T"
        if folder is not None and inits[weight].data_location == onnx.TensorProto.EXTERNAL:
            from .onnx_io import transpose_to_file

            transposed = transpose_to_file(inits[weight], folder, t_name)  # (d, V)
        else:
            transposed = numpy_helper.from_array(numpy_helper.to_array(inits[weight]).T.copy(), t_name)  # (d, V)
        graph.initializer.append(transposed)
        if not others:  # W was only the MatMul's
            graph.initializer.remove(inits.pop(weight))
        for mm in users:  # MatMul(h, Transpose(W)) -> MatMul(h, W_t)
            mm.input[1] = t_name
        graph.node.remove(tr)
        done.append({"weight": weight, "transposed": t_name, "shape": [int(d) for d in transposed.dims],
                     "matmuls": [u.name for u in users], "gathers": [g.name for g in others]})
    return {"weights": done}


def rewrite_file(path: Path) -> dict:
    """Rewrite a graph file in place; a graph with external data keeps it (export/onnx_io.py)."""
    from .onnx_io import check, external_files, load_structure, save, scratch_name

    path = Path(path)
    external = bool(external_files(path))
    model = load_structure(path)
    try:
        report = pre_transpose_tied_embedding(model, path.parent)
        if report["weights"]:
            save(model, path, external_data=external, source=path.parent)
            check(path)
    finally:  # the transposed tables' scratch files, copied into the data file by now
        for tensor in model.graph.initializer:
            (path.parent / scratch_name(tensor.name)).unlink(missing_ok=True)
    return report


def _symmetric_int8(tensor: onnx.TensorProto, axis: int, folder: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """One scale per slice along `axis`, as ORT's per-channel weight quantization: max |w| -> 127.
    Two passes over the rows a block at a time (the scales, then the int8 numbers), so the fp32
    table is never in memory whole."""
    from .onnx_io import read_row_blocks

    rows, cols = (int(d) for d in tensor.dims)
    top = np.zeros(rows if axis == 0 else cols, np.float32)
    start = 0
    for part in read_row_blocks(tensor, folder):
        if axis == 0:
            top[start:start + len(part)] = np.abs(part).max(axis=1)
        else:
            np.maximum(top, np.abs(part).max(axis=0), out=top)
        start += len(part)
    scale = top / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.empty((rows, cols), np.int8)
    start = 0
    for part in read_row_blocks(tensor, folder):
        n = len(part)
        q[start:start + n] = np.clip(np.rint(part / (scale[start:start + n, None] if axis == 0 else scale[None, :])),
                                     -127, 127).astype(np.int8)
        start += n
    return q, scale


def quantize_gathers(model: onnx.ModelProto, keep: set[str] = frozenset(), folder: Path | None = None) -> dict:
    """After ORT's dynamic quantization (MatMul only): make every embedding Gather read int8,
    except those named in `keep`.

    Where the same weight feeds the output MatMul, ORT stored it per output channel as
    `<W>_quantized` / `_scale` / `_zero_point` (of `<W>.T` after `pre_transpose_tied_embedding`:
    the Gather then reads a transposed copy of those int8 numbers, one row per id); the embedding
    and the output layer use one set of int8 numbers (tied, as in the fp32 model). A weight only
    gathered (the encoder's embedding) is quantized here the same way, one scale per gathered
    row or column. The fp32 table is then dropped: it is the largest weight of the graph. `folder`:
    where an external table's data file is.
    Gather(W, ids, axis) becomes (Cast(Gather(Wq, ids, axis)) - Gather(z, ids)) * Gather(s, ids).
    """
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers = _readers(graph)

    done = []
    for g in [n for n in graph.node if n.op_type == "Gather"]:
        weight = g.input[0]
        if weight not in inits or len(inits[weight].dims) != 2:
            continue
        if g.name in keep or any(n.op_type != "Gather" for n in readers[weight]):
            continue  # asked to stay fp32, or still read as fp32 elsewhere: keep it
        axis = next((a.i for a in g.attribute if a.name == "axis"), 0)
        qn, sn, zn = f"{weight}_quantized", f"{weight}_scale", f"{weight}_zero_point"
        source = "matmul"
        tq = f"{weight}.T_quantized"  # the output layer's per-channel numbers of W_t (pre_transpose_tied_embedding)
        if qn not in inits and axis == 0 and tq in inits:
            rows = numpy_helper.to_array(inits[tq], str(folder or "")).T  # (V, d): one row per id, copied once below
            graph.initializer.append(numpy_helper.from_array(rows, qn))
            inits[qn] = graph.initializer[-1]
            sn, zn = f"{weight}.T_scale", f"{weight}.T_zero_point"
        elif qn not in inits:
            q, s = _symmetric_int8(inits[weight], axis, folder)
            graph.initializer.extend([
                numpy_helper.from_array(q, qn),
                numpy_helper.from_array(s, sn),
                numpy_helper.from_array(np.zeros_like(s, dtype=np.int8), zn),
            ])
            inits.update({i.name: i for i in graph.initializer[-3:]})
            source = "gather"
        if list(inits[sn].dims) != [inits[weight].dims[axis]]:
            raise RewriteError(f"{sn} has shape {list(inits[sn].dims)}; expected one scale per index on axis {axis}")

        ids, out = g.input[1], g.output[0]
        base = g.name or out  # an unnamed Gather: name the new nodes after its output
        rank = _rank(graph, ids)
        if rank is None:
            raise RewriteError(f"cannot tell the rank of {ids!r}, the ids of Gather {g.name!r}")
        nodes = [
            helper.make_node("Gather", [qn, ids], [f"{base}.q"], name=f"{base}.q", axis=axis),  # int8
            helper.make_node("Cast", [f"{base}.q"], [f"{base}.qf"], name=f"{base}.qf", to=onnx.TensorProto.FLOAT),
            helper.make_node("Gather", [zn, ids], [f"{base}.z"], name=f"{base}.z", axis=0),  # (*ids)
            helper.make_node("Cast", [f"{base}.z"], [f"{base}.zf"], name=f"{base}.zf", to=onnx.TensorProto.FLOAT),
            helper.make_node("Gather", [sn, ids], [f"{base}.s"], name=f"{base}.s", axis=0),  # (*ids)
        ]
        z, s = f"{base}.zf", f"{base}.s"
        if axis == 0:  # rows: (*ids, d); per-index numbers broadcast along the last axis
            last = helper.make_tensor(f"{base}.last", onnx.TensorProto.INT64, [1], [-1])
            graph.initializer.append(last)
            nodes += [
                helper.make_node("Unsqueeze", [z, last.name], [f"{base}.zu"], name=f"{base}.zu"),
                helper.make_node("Unsqueeze", [s, last.name], [f"{base}.su"], name=f"{base}.su"),
            ]
            z, s = f"{base}.zu", f"{base}.su"
        elif axis != 1:
            raise RewriteError(f"Gather {g.name!r} on a 2-D weight uses axis {axis}")
        nodes += [
            helper.make_node("Sub", [f"{base}.qf", z], [f"{base}.centred"], name=f"{base}.centred"),
            helper.make_node("Mul", [f"{base}.centred", s], [out], name=f"{base}.dequantized"),
        ]
        at = list(graph.node).index(g)
        graph.node.remove(g)
        for i, node in enumerate(nodes):
            copy_metadata(node, g)
            graph.node.insert(at + i, node)
        readers[weight].remove(g)
        if not readers[weight]:
            graph.initializer.remove(inits.pop(weight))
        done.append({"weight": weight, "axis": axis, "int8_from": source})
    return {"gathers": done}
