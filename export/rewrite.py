"""Graph rewrites applied to the exported fp32 graphs before fp16/int8 conversion.

`pre_transpose_tied_embedding`: Marian ties the output projection to the token embedding, and
the dynamo exporter writes that as one initializer `W` (V, d) read twice: by the embedding
`Gather(W, ids)` and by the output layer `MatMul(h, Transpose(W))`. ONNX Runtime folds the
Transpose at session start into a second, transposed copy (133 MB at opus-mt-en-zh's size, per
session), and the int8 quantizer skips the output layer because its weight is not an
initializer. Storing the weight once, already transposed (d, V), fixes both: the MatMul reads it
directly (and gets quantized), and the embedding becomes `Transpose(Gather(W_t, ids, axis=1))`,
which copies the same numbers. Values are bit-identical; only where they live changes.

`fuse_attention`: each attention core our wrappers export (`export/wrappers._attend`: split
heads, scale, scores, bias, softmax, weighted sum, merge heads) becomes one ONNX Runtime
`MultiHeadAttention` node. Same numbers (bit-identical outputs, checked in the tests); measured on
the opus-mt-sized export, a batch-1 decoder step 0.97x (fp32) and 0.93x (int8) the time, batch 4
and 32 level.

`append_cache_in_attention`: the decoder's self-attention cache, `present = Concat(past,
Transpose(Reshape(k)))` per key and value, becomes MultiHeadAttention's own `past_key` /
`past_value` inputs and `present_key` / `present_value` outputs: the kernel splits the new heads
and appends them as it reads them. `pack_qkv`: the three projections of one input that feed one
attention (MatMul by W_q, W_k, W_v) become one MatMul by [W_q | W_k | W_v] and a Split; each output
column is the same dot product as before, so the numbers are bit-identical (tests); one kernel
call instead of three (the packed MatMul and Split carry the attention's metadata). Both cut nodes per
decoder step (opus-mt-en-zh's 206 -> 164, the embedded model's 110 -> 89). Bought, end to end
(`translate()` with 40 forced tokens, the export before and after alternated in one process, 2
threads, AMD EPYC, paired medians): opus-mt size batch 1 fp32 1.01x (level: its weight products
are 94% of the step), int8 0.945x (faster in 14 of 16); the embedded model batch 1 fp32 0.99x,
int8 0.94x, batch 32 fp32 0.98x. Two further folds were measured on the decoder step and left
out: the q/k/v biases into MultiHeadAttention's `bias` input, and each output projection's bias
with the residual Add and LayerNorm into SkipLayerNormalization (opus-mt-en-zh's 206 -> 110 nodes):
0.89x against these two's 0.94x on the embedded model's step, level at opus-mt size, and they
remove the biased outputs of q_proj, k_proj, v_proj, out_proj and fc2, which `service/locate.py`
compares module by module.

Every node a rewrite adds carries the metadata of the node it stands for (`copy_metadata`): the
dynamo exporter records on each node the module it came from (`namespace`,
`pkg.torch.onnx.name_scopes`, `pkg.torch.onnx.class_hierarchy`), and `service/locate.py` maps
graph values back to the model's modules with it. `copy_scope_metadata` does the same for the
nodes ONNX Runtime's quantizer writes. Metadata only: no number changes.
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


def pre_transpose_tied_embedding(model: onnx.ModelProto) -> dict:
    """Rewrite in place; returns what changed (empty `weights` when there was nothing to do)."""
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

        w = numpy_helper.to_array(inits[weight])  # (V, d)
        t_name = f"{weight}.T"
        graph.initializer.remove(inits[weight])
        graph.initializer.append(numpy_helper.from_array(w.T.copy(), t_name))  # (d, V)

        for mm in users:  # MatMul(h, Transpose(W)) -> MatMul(h, W_t)
            mm.input[1] = t_name
        graph.node.remove(tr)

        for g in others:  # Gather(W, ids) (*ids, d) -> Transpose(Gather(W_t, ids, axis=1)) (d, *ids)
            axis = next((a.i for a in g.attribute if a.name == "axis"), 0)
            if axis != 0:
                raise RewriteError(f"embedding Gather {g.name!r} uses axis {axis}, expected 0")
            rank = _rank(graph, g.input[1])
            if rank is None:
                raise RewriteError(f"cannot tell the rank of {g.input[1]!r}, the ids of Gather {g.name!r}")
            out = g.output[0]
            g.input[0] = t_name
            del g.attribute[:]
            g.attribute.append(helper.make_attribute("axis", 1))
            g.output[0] = f"{out}.by_column"
            at = list(graph.node).index(g) + 1
            to_rows = helper.make_node(
                "Transpose", [g.output[0]], [out], name=f"{g.name}.to_rows", perm=[*range(1, rank + 1), 0]
            )
            copy_metadata(to_rows, g)  # still the embedding module's output
            graph.node.insert(at, to_rows)
        done.append({"weight": weight, "stored_as": t_name, "shape": list(w.T.shape),
                     "matmuls": [u.name for u in users], "gathers": [g.name for g in others]})
    return {"weights": done}


def rewrite_file(path: Path) -> dict:
    """Rewrite a graph file in place; a graph with external data keeps it (export/onnx_io.py)."""
    from .onnx_io import check, external_files, save

    external = bool(external_files(path))
    model = onnx.load(str(path))
    report = pre_transpose_tied_embedding(model)
    if report["weights"]:
        save(model, path, external_data=external)
        check(path)
    return report


def _symmetric_int8(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    # One scale per slice along `axis`, as ORT's per-channel weight quantization: max |w| -> 127.
    reduce = 1 - axis
    scale = np.abs(w).max(axis=reduce) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(w / np.expand_dims(scale, reduce)), -127, 127).astype(np.int8)
    return q, scale


def quantize_gathers(model: onnx.ModelProto) -> dict:
    """After ORT's dynamic quantization (MatMul only): make every embedding Gather read int8.

    Where the same weight feeds the output MatMul, ORT stored it per output channel as
    `<W>_quantized` / `_scale` / `_zero_point`; the Gather then reads those, so the embedding and
    the output layer use one set of int8 numbers (tied, as in the fp32 model). A weight only
    gathered (the encoder's embedding) is quantized here the same way, one scale per gathered
    row or column. The fp32 table is then dropped: 133 MB less per graph at opus-mt-en-zh's size.
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
        if any(n.op_type != "Gather" for n in readers[weight]):
            continue  # still read as fp32 elsewhere: keep it
        axis = next((a.i for a in g.attribute if a.name == "axis"), 0)
        qn, sn, zn = f"{weight}_quantized", f"{weight}_scale", f"{weight}_zero_point"
        source = "matmul"
        if qn not in inits:
            q, s = _symmetric_int8(numpy_helper.to_array(inits[weight]), axis)
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


def _attr(node: onnx.NodeProto, name: str, default=None):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _scalar(graph: onnx.GraphProto, name: str, producers: dict[str, onnx.NodeProto]) -> float | None:
    """The value of a one-element float32 or float16 constant (initializer or Constant node), else None."""
    node = producers.get(name)
    tensor = next((i for i in graph.initializer if i.name == name), None)
    if tensor is None and node is not None and node.op_type == "Constant":
        tensor = _attr(node, "value")
    if tensor is None:
        return None
    a = numpy_helper.to_array(tensor)
    return float(a.reshape(-1)[0]) if a.size == 1 and a.dtype in _FLOAT_DTYPES else None


_FLOAT_DTYPES = (np.float32, np.float16)


def fuse_attention(model: onnx.ModelProto, num_heads: int) -> dict:
    """Each attention core `export/wrappers._attend` wrote, as one ONNX Runtime `MultiHeadAttention`.

    The exported core is Reshape + Transpose of q (b, t, h*d) into heads, Mul by the scaling,
    MatMul with Transpose(k), Add of the padding bias where there is one, Softmax, MatMul with v,
    Transpose + Reshape back to (b, t, h*d): eight to ten nodes, each writing a (b, h, t, s) or
    (b, h, t, d) tensor that the next reads back. `com.microsoft.MultiHeadAttention` takes q as
    (b, t, h*d) with the scaling as its `scale`, k and v as (b, s, h*d) where the heads are split
    only for this attention (the encoder's self-attention) or as (b, h, s, d) where the split tensor
    is needed anyway (the decoder's cache: its Concat still writes `present.*`; the cross-attention
    keys and values, graph inputs), and the bias as its `attention_bias` (b, 1, t, s): ORT computes
    the same products, softmax and sums in one kernel. The nodes it replaces are removed when
    nothing else reads them. The new node carries the Softmax's metadata (service/locate.py).

    Returns {"attention": [one entry per fused core]}; a graph without the pattern is left as is.
    """
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)
    outputs = {o.name for o in graph.output}

    def only_reader(name: str, op: str) -> onnx.NodeProto | None:
        users = readers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op and name not in outputs else None

    def made_by(name: str, op: str, perm: list[int] | None = None) -> onnx.NodeProto | None:
        node = producers.get(name)
        if node is None or node.op_type != op or (perm is not None and list(_attr(node, "perm", [])) != perm):
            return None
        return node

    def unsplit(heads4: str, reader: onnx.NodeProto) -> str | None:
        """(b, s, h*d) behind Transpose(Reshape(x)) when that split is read by `reader` alone."""
        tr = made_by(heads4, "Transpose", [0, 2, 1, 3])
        if tr is None or [u.name for u in readers.get(heads4, [])] != [reader.name] or heads4 in outputs:
            return None
        rs = made_by(tr.input[0], "Reshape")
        if rs is None or len(readers.get(rs.output[0], [])) != 1:
            return None
        return rs.input[0]

    fused = []
    for sm in [n for n in graph.node if n.op_type == "Softmax"]:
        if _attr(sm, "axis", -1) not in (-1, 3):
            continue
        scores, bias = sm.input[0], None
        add = made_by(scores, "Add")
        if add is not None:
            left, right = (made_by(i, "MatMul") for i in add.input)
            if left is None and right is None:
                continue
            qk = left if left is not None else right
            bias = add.input[1] if left is not None else add.input[0]
        else:
            qk = made_by(scores, "MatMul")
        if qk is None:
            continue
        k_t = made_by(qk.input[1], "Transpose", [0, 1, 3, 2])
        # The exporter may have merged the head split into it: Transpose(Reshape(k), [0, 2, 3, 1]).
        k_t_merged = made_by(qk.input[1], "Transpose", [0, 2, 3, 1]) if k_t is None else None
        mul = made_by(qk.input[0], "Mul")
        pv = only_reader(sm.output[0], "MatMul")
        if (k_t is None and k_t_merged is None) or mul is None or pv is None or pv.input[0] != sm.output[0]:
            continue
        q_heads = next((i for i in mul.input if made_by(i, "Transpose", [0, 2, 1, 3])), None)
        scale = _scalar(graph, mul.input[1] if q_heads == mul.input[0] else mul.input[0], producers)
        q_split = made_by(q_heads, "Transpose", [0, 2, 1, 3]) if q_heads else None
        q_reshape = made_by(q_split.input[0], "Reshape") if q_split is not None else None
        merge_t = only_reader(pv.output[0], "Transpose")
        merge = only_reader(merge_t.output[0], "Reshape") if merge_t is not None else None
        if scale is None or q_reshape is None or merge is None or list(_attr(merge_t, "perm", [])) != [0, 2, 1, 3]:
            continue
        v4 = pv.input[1]
        v3 = unsplit(v4, pv)
        if k_t is not None:
            k4 = k_t.input[0]
            k3 = unsplit(k4, k_t)
        else:
            k_split = made_by(k_t_merged.input[0], "Reshape")
            k4, k3 = None, k_split.input[0] if k_split is not None and len(readers[k_split.output[0]]) == 1 else None
        # MultiHeadAttention takes both as (b, s, h*d) or both as (b, h, s, d).
        if k3 is not None and v3 is not None:
            key, value = k3, v3
        elif k4 is not None:
            key, value = k4, v4
        else:
            continue
        inputs = [q_reshape.input[0], key, value] + (["", "", bias] if bias is not None else [])
        mha = helper.make_node(
            "MultiHeadAttention", inputs, [merge.output[0]], name=f"{sm.name}.MultiHeadAttention",
            domain="com.microsoft", num_heads=num_heads, scale=scale,
        )
        copy_metadata(mha, sm)
        graph.node.insert(list(graph.node).index(merge), mha)
        merge.output[0] = f"{merge.output[0]}.unfused"  # the old chain is now dead: removed below
        fused.append({"softmax": sm.name, "key": "(b, s, h*d)" if key == k3 else "(b, h, s, d)",
                      "bias": bias is not None, "scale": scale})
    if fused:
        _remove_dead_nodes(graph)
        if not any(op.domain == "com.microsoft" for op in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {"attention": fused, "num_heads": num_heads}


def _sort_topologically(graph: onnx.GraphProto) -> None:
    """Move each node that reads a value produced later to just after that value's producer;
    every other node keeps its place."""
    made = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    ordered, waiting = [], []
    for node in graph.node:
        waiting.append(node)
        progress = True
        while progress:  # emit whatever has become computable, in the original order
            progress = False
            for n in list(waiting):
                if all(i in made for i in n.input):
                    ordered.append(n)
                    waiting.remove(n)
                    made.update(n.output)
                    progress = True
    if waiting:
        raise RewriteError(f"no order computes node {waiting[0].name!r}: an input is never produced")
    del graph.node[:]
    graph.node.extend(ordered)


def _remove_dead_nodes(graph: onnx.GraphProto) -> None:
    """Drop nodes none of whose outputs is read or a graph output, until none is left, then the
    initializers nothing reads any more (the shape constants of the removed Reshapes) and the
    recorded types of values nothing computes any more."""
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if not any(o in read for o in n.output if o)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    for init in [i for i in graph.initializer if i.name not in read]:
        graph.initializer.remove(init)
    made = {o for n in graph.node for o in n.output}
    for info in [v for v in graph.value_info if v.name not in made]:
        graph.value_info.remove(info)


def append_cache_in_attention(model: onnx.ModelProto) -> dict:
    """Each self-attention cache Concat before a fused MultiHeadAttention, done by the node itself.

    The exported decoder step writes, per key and value, `present = Concat(past, Transpose(Reshape(
    new)), axis=2)` (b, h, p + 1, d) and the attention reads `present`. MultiHeadAttention takes the
    new key and value as (b, t, h*d) with `past_key` / `past_value` (b, h, p, d) and returns the
    concatenation as its `present_key` / `present_value` outputs, which keep the Concat's names:
    graph outputs and every other reader (the fp16 graph's Cast to fp32) are unchanged.
    Returns {"cache": [one entry per attention]}; the Reshape, Transpose and Concat are removed.
    """
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)

    def appended(name: str) -> tuple[str, str, onnx.NodeProto] | None:
        """(past, new (b, t, h*d)) behind a cache Concat, and the Concat; None for any other shape."""
        cat = producers.get(name)
        if cat is None or cat.op_type != "Concat" or len(cat.input) != 2 or _attr(cat, "axis") not in (2, -2):
            return None
        tr = producers.get(cat.input[1])
        if tr is None or tr.op_type != "Transpose" or list(_attr(tr, "perm", [])) != [0, 2, 1, 3]:
            return None
        rs = producers.get(tr.input[0])
        if rs is None or rs.op_type != "Reshape" or len(readers.get(tr.output[0], [])) != 1:
            return None
        return cat.input[0], rs.input[0], cat

    done = []
    for mha in [n for n in graph.node if n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft"]:
        if len(mha.output) > 1 or len(mha.input) < 3 or len(mha.input) > 6 or (len(mha.input) > 3 and mha.input[3]):
            continue  # already has a cache or a bias input: not the shape fuse_attention writes
        key, value = appended(mha.input[1]), appended(mha.input[2])
        if key is None or value is None:
            continue
        inputs = [*mha.input, *[""] * (6 - len(mha.input))]
        inputs[1], inputs[2] = key[1], value[1]
        del mha.input[:]
        mha.input.extend([*inputs, key[0], value[0]])
        mha.output.extend([key[2].output[0], value[2].output[0]])
        for cat in (key[2], value[2]):
            cat.output[0] = f"{cat.output[0]}.unappended"  # dead now: removed below
        done.append({"attention": mha.name, "past": [key[0], value[0]], "present": list(mha.output[1:])})
    if done:
        _remove_dead_nodes(graph)
        _sort_topologically(graph)  # readers of `present` (the fp16 graph's Casts) may sit before the attention
    return {"cache": done}


def pack_qkv(model: onnx.ModelProto) -> dict:
    """The q, k and v projections of one input into one attention: one MatMul and a Split.

    Where a MultiHeadAttention's query, key and value are each `Add(MatMul(x, W), b)` (or a bare
    MatMul) of the same x with weights that are initializers, the MatMuls become
    `MatMul(x, [W_q | W_k | W_v])` whose output a Split cuts back into the three products, under
    their old names: the bias Adds, their outputs (the modules' outputs for service/locate.py) and
    everything after are untouched. The packed weight replaces the three (no extra memory).
    Returns {"packed": [one entry per attention]}.
    """
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)
    inits = {i.name: i for i in graph.initializer}

    def projection(name: str) -> onnx.NodeProto | None:
        node = producers.get(name)
        if node is not None and node.op_type == "Add":
            node = next((producers.get(i) for i in node.input if producers.get(i) is not None
                         and producers[i].op_type == "MatMul"), None)
        if node is None or node.op_type != "MatMul" or node.input[1] not in inits or len(readers[node.output[0]]) != 1:
            return None
        return node if len(inits[node.input[1]].dims) == 2 else None

    done = []
    for mha in [n for n in graph.node if n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft"]:
        mms = [projection(mha.input[i]) for i in range(3)]
        if any(m is None for m in mms) or len({m.input[0] for m in mms}) != 1 or len({m.name for m in mms}) != 3:
            continue
        weights = [inits[m.input[1]] for m in mms]
        if len({w.data_type for w in weights}) != 1 or len({w.dims[0] for w in weights}) != 1:
            continue
        if any(len(readers[w.name]) != 1 for w in weights):
            continue  # a weight read elsewhere too stays where it is
        packed = np.concatenate([numpy_helper.to_array(w) for w in weights], axis=1)
        base = f"{mha.name}.qkv"
        graph.initializer.append(numpy_helper.from_array(packed, f"{base}.weight"))
        graph.initializer.append(numpy_helper.from_array(np.array([w.dims[1] for w in weights], np.int64), f"{base}.sizes"))
        matmul = helper.make_node("MatMul", [mms[0].input[0], f"{base}.weight"], [base], name=f"{base}.MatMul")
        split = helper.make_node("Split", [base, f"{base}.sizes"], [m.output[0] for m in mms], name=f"{base}.Split", axis=-1)
        for node in (matmul, split):
            copy_metadata(node, mha)  # the code around the projections, as the attention itself
        at = min(list(graph.node).index(m) for m in mms)
        for m in mms:
            m.output[0] = f"{m.output[0]}.unpacked"  # dead now: removed below, with its weight
        graph.node.insert(at, split)
        graph.node.insert(at, matmul)
        done.append({"attention": mha.name, "weights": [w.name for w in weights], "shape": list(packed.shape)})
    if done:
        _remove_dead_nodes(graph)
    return {"packed": done}


def fuse_attention_file(path: Path, num_heads: int) -> dict:
    """`fuse_attention`, then `append_cache_in_attention` and `pack_qkv`, on a graph file in place
    (external data kept, as `rewrite_file`)."""
    from .onnx_io import check, external_files, save

    external = bool(external_files(path))
    model = onnx.load(str(path))
    report = fuse_attention(model, num_heads)
    report.update(append_cache_in_attention(model))
    report.update(pack_qkv(model))
    if report["attention"] or report["cache"] or report["packed"]:
        save(model, path, external_data=external)
        check(path)
    return report
