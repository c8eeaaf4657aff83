"""Attention rewrites of the exported graphs: same numbers (bit-identical outputs, tested), fewer nodes.

`fuse_attention`: each attention core the graph wrappers write (split heads, scale, scores, bias,
softmax, weighted sum, merge heads) becomes one ONNX Runtime `MultiHeadAttention` node.
`append_cache_in_attention`: the decoder's self-attention cache `present = Concat(past,
Transpose(Reshape(k)))` becomes MultiHeadAttention's own `past_*` inputs and `present_*` outputs.
`pack_qkv`: the three projections of one input that feed one attention become one MatMul by
[W_q | W_k | W_v] and a Split; each output column is the same dot product as before.
`share_cross_attention`: the decoder's cross-attention takes each sentence's keys and values once
for all of its beams (its inputs batched by sentence, `CROSS_BATCH`), not once per beam.

Two further folds are left out on purpose (the q/k/v biases into MultiHeadAttention's `bias`, and
each output projection's bias with the residual Add and LayerNorm into SkipLayerNormalization):
they remove the biased outputs of q_proj, k_proj, v_proj, out_proj and fc2, which
`service/locate.py` compares module by module. The nodes added carry the metadata of the nodes
they replace (`rewrite.copy_metadata`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from backends.manifest import CROSS_BATCH

from .rewrite import RewriteError, _readers, copy_metadata


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

    The exported core is Reshape + Transpose of q (b, t, h*d) into heads, Mul by the scaling (none
    where the family does not scale its scores: T5, `scale` 1),
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
        if (k_t is None and k_t_merged is None) or pv is None or pv.input[0] != sm.output[0]:
            continue
        if mul is not None:
            q_heads = next((i for i in mul.input if made_by(i, "Transpose", [0, 2, 1, 3])), None)
            scale = _scalar(graph, mul.input[1] if q_heads == mul.input[0] else mul.input[0], producers)
        else:  # unscaled scores (T5): the query's head split feeds the product itself
            q_heads = qk.input[0] if made_by(qk.input[0], "Transpose", [0, 2, 1, 3]) else None
            scale = 1.0
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


def pack_qkv(model: onnx.ModelProto, folder: Path | None = None) -> dict:
    """The q, k and v projections of one input into one attention: one MatMul and a Split.

    Where a MultiHeadAttention's query, key and value are each `Add(MatMul(x, W), b)` (or a bare
    MatMul) of the same x with weights that are initializers, the MatMuls become
    `MatMul(x, [W_q | W_k | W_v])` whose output a Split cuts back into the three products, under
    their old names: the bias Adds, their outputs (the modules' outputs for service/locate.py) and
    everything after are untouched. The packed weight replaces the three (no extra memory).
    `folder`: where a graph from `onnx_io.load_structure` keeps its weights (only the packed ones are read).
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
        packed = np.concatenate([numpy_helper.to_array(w, str(folder or '')) for w in weights], axis=1)
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




def _graph_inputs_behind(graph: onnx.GraphProto, name: str, producers: dict[str, onnx.NodeProto]) -> set[str]:
    """The graph inputs a value is computed from (initializers and constants are not inputs)."""
    inputs = {i.name for i in graph.input}
    found, stack, seen = set(), [name], set()
    while stack:
        value = stack.pop()
        if value in seen or not value:
            continue
        seen.add(value)
        if value in inputs:
            found.add(value)
        elif value in producers:
            stack.extend(producers[value].input)
    return found


def share_cross_attention(model: onnx.ModelProto) -> dict:
    """Each decoder cross-attention reads a sentence's keys and values once for all of its beams.

    Beam search runs n rows per sentence, and every row's cross-attention reads the same keys and
    values. Repeating them n times (as generate() and the fixed-batch graph do) makes each step
    read n copies and each cache drop copy them. Here the cross-attention inputs (`cross.*` and
    `encoder_attention_mask`) are batched by sentence (dimension `CROSS_BATCH`), and each
    MultiHeadAttention whose key and value are such inputs takes its query as (sentences, n, d),
    n = rows / sentences, with the padding bias broadcast over the n queries: every row attends
    to its own sentence's keys as before. With one row per sentence (greedy search, n = 1) the
    graph computes what it computed before; with n > 1, the same products grouped differently.

    Rewritten only where the sentence inputs feed nothing but those attentions' keys, values and
    bias: any other use would mix rows and sentences. Returns {"shared_cross": [attention names]}.
    """
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)
    names = {i.name for i in graph.input}
    sentence_inputs = {n for n in names if n.startswith("cross.")}
    if not sentence_inputs or "encoder_attention_mask" not in names:
        return {"shared_cross": []}
    sentence_inputs.add("encoder_attention_mask")
    mhas = [n for n in graph.node if n.op_type == "MultiHeadAttention" and n.domain == "com.microsoft"
            and len(n.input) == 6 and not n.input[3] and not n.input[4] and n.input[5]]
    def from_sentence_inputs(value: str) -> bool:
        behind = _graph_inputs_behind(graph, value, producers)
        return bool(behind) and behind <= sentence_inputs

    cross = [n for n in mhas if all(from_sentence_inputs(n.input[i]) for i in (1, 2, 5))]
    if not cross:
        return {"shared_cross": []}
    # Every value computed from the sentence inputs must end in those attentions' key, value or bias.
    allowed = {(n.name, i) for n in cross for i in (1, 2, 5)}
    outputs = {o.name for o in graph.output}
    stack, seen = list(sentence_inputs), set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        if value in outputs:
            return {"shared_cross": []}
        for reader in readers.get(value, []):
            slots = [i for i, x in enumerate(reader.input) if x == value]
            if all((reader.name, i) in allowed for i in slots):
                continue
            if reader.op_type == "MultiHeadAttention" or not _graph_inputs_behind(
                    graph, reader.output[0], producers) <= sentence_inputs:
                return {"shared_cross": []}
            stack.extend(reader.output)

    d_model = "share_cross.d_model"
    consts = {"share_cross.minus_one": [-1], "share_cross.one": [1]}
    graph.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items())
    first = cross[0]
    key_input = next(iter(_graph_inputs_behind(graph, first.input[1], producers)))
    # sentences and n, from the shapes of a cross key (its batch) and the first query (its rows)
    shape_nodes = [
        helper.make_node("Shape", [key_input], ["share_cross.sentences"], name="share_cross.sentences", start=0, end=1),
        helper.make_node("Shape", [first.input[0]], ["share_cross.rows"], name="share_cross.rows", start=0, end=1),
        helper.make_node("Shape", [first.input[0]], [d_model], name="share_cross.d_model", start=2, end=3),
        helper.make_node("Div", ["share_cross.rows", "share_cross.sentences"], ["share_cross.beams"], name="share_cross.beams"),
        helper.make_node("Concat", ["share_cross.sentences", "share_cross.minus_one", d_model], ["share_cross.grouped"],
                         name="share_cross.grouped", axis=0),
        helper.make_node("Concat", ["share_cross.minus_one", "share_cross.one", d_model], ["share_cross.per_row"],
                         name="share_cross.per_row", axis=0),
        helper.make_node("Concat", ["share_cross.one", "share_cross.one", "share_cross.beams", "share_cross.one"],
                         ["share_cross.bias_shape"], name="share_cross.bias_shape", axis=0),
    ]
    for node in shape_nodes:
        copy_metadata(node, first)
    graph.node.insert(list(graph.node).index(first), shape_nodes[-1])
    for node in reversed(shape_nodes[:-1]):
        graph.node.insert(list(graph.node).index(shape_nodes[-1]), node)
    done = []
    for mha in cross:
        query, out, bias = mha.input[0], mha.output[0], mha.input[5]
        grouped_q = helper.make_node("Reshape", [query, "share_cross.grouped"], [f"{mha.name}.grouped_query"],
                                     name=f"{mha.name}.grouped_query")
        grouped_bias = helper.make_node("Expand", [bias, "share_cross.bias_shape"], [f"{mha.name}.grouped_bias"],
                                        name=f"{mha.name}.grouped_bias")
        per_row = helper.make_node("Reshape", [f"{mha.name}.grouped_out", "share_cross.per_row"], [out],
                                   name=f"{mha.name}.per_row")
        mha.input[0], mha.input[5], mha.output[0] = grouped_q.output[0], grouped_bias.output[0], f"{mha.name}.grouped_out"
        at = list(graph.node).index(mha)
        for node in (grouped_q, grouped_bias, per_row):
            copy_metadata(node, mha)
        graph.node.insert(at + 1, per_row)
        graph.node.insert(at, grouped_bias)
        graph.node.insert(at, grouped_q)
        done.append(mha.name)
    for value in [*graph.input, *graph.value_info]:
        if value.name in sentence_inputs:
            value.type.tensor_type.shape.dim[0].dim_param = CROSS_BATCH
    # values computed from the sentence inputs alone (the bias) are per sentence too: their
    # recorded shapes would say rows
    for info in [v for v in graph.value_info if v.name in seen and v.name not in sentence_inputs]:
        graph.value_info.remove(info)
    _sort_topologically(graph)
    return {"shared_cross": done}


def fuse_attention_file(path: Path, num_heads: int) -> dict:
    """`fuse_attention`, then `append_cache_in_attention`, `pack_qkv` and `share_cross_attention`,
    on a graph file in place (external data kept, as `rewrite_file`)."""
    from .onnx_io import check, external_files, load_structure, save

    path = Path(path)
    external = bool(external_files(path))
    model = load_structure(path)
    report = fuse_attention(model, num_heads)
    report.update(append_cache_in_attention(model))
    report.update(pack_qkv(model, path.parent))
    report.update(share_cross_attention(model))
    if report["attention"] or report["cache"] or report["packed"] or report["shared_cross"]:
        save(model, path, external_data=external, source=path.parent)
        check(path)
    return report
