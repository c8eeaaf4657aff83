"""Re-score the int8 output layer's top candidates exactly: the alternative to keeping it in fp32.

The output layer is the largest weight of a decoder step and the node whose int8 error flips the
most argmaxes, yet only its few best logits decide the next token (greedy: the best; beam search:
the 2 x beams best per row). So the int8 MatMul still scores the whole vocabulary, and the K best of
its logits are then recomputed in fp32 from the same hidden state and the fp32 rows of those K
tokens, and written back in place:

    logits = MatMul_int8(h, W)                      # (b, 1, V)
    _, top = TopK(logits, K)                        # (b, 1, K)
    exact = Gather(W_rows, top) @ h                 # (b, 1, K): K x d multiply-adds per row
    logits = ScatterElements(logits, top, exact)    # the K best exact, the rest int8

A token outside the int8 top K cannot win unless its exact logit beats all K exact ones, which the
int8 error (a small fraction of the gap to the K-th logit) does not allow for a K well above the
beam width. The cost is one TopK over the vocabulary and K x d multiply-adds per row, plus one
fp32 copy of the table in the graph, stored (V, d) so that a candidate's weights are one contiguous
row: gathering K columns of the (d, V) table an fp32 embedding may already read is slower than the
whole re-scoring otherwise costs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from .onnx_io import transpose_to_file
from .rewrite import RewriteError, copy_metadata

DEFAULT_TOP = 16


def output_layer(model: onnx.ModelProto, output: str = "logits") -> onnx.NodeProto:
    """The MatMul that computes the graph's `output` (directly, or before a logits-bias Add)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name for i in model.graph.initializer}
    node = producers.get(output)
    if node is not None and node.op_type == "Add":
        node = next((producers[i] for i in node.input if i in producers and producers[i].op_type == "MatMul"), None)
    if node is None or node.op_type != "MatMul" or node.input[1] not in inits:
        raise RewriteError(f"no MatMul with a constant weight computes {output!r}")
    return node


def rescore_top(model: onnx.ModelProto, source: onnx.ModelProto, k: int = DEFAULT_TOP,
                folder: Path | None = None) -> dict:
    """Rewrite `model` (the int8 graph of `source`) in place; `source` holds the fp32 weight, inline
    or in a data file in `folder`. An external weight's (V, d) copy is written block by block to a
    scratch file there (`onnx_io.scratch_name` of the returned "table"), which the caller removes
    once the graph is saved."""
    if k < 1:
        raise ValueError(f"re-scoring needs at least 1 candidate, got {k}")
    fp32 = output_layer(source)
    hidden, weight, out = fp32.input[0], fp32.input[1], fp32.output[0]
    graph = model.graph
    if any(n.op_type == "MatMul" and n.input[1] == weight for n in graph.node):
        return {"rescored": False, "why": "the output layer is already fp32"}
    producers = {o: n for n in graph.node for o in n.output}
    if out not in producers:
        raise RewriteError(f"the int8 graph has no {out!r} to re-score")
    table = next(i for i in source.graph.initializer if i.name == weight)
    rows = f"{weight}.rows_fp32"
    if uses_external_data(table):
        graph.initializer.append(transpose_to_file(table, folder or Path("."), rows))  # (V, d)
    else:
        w = numpy_helper.to_array(table)  # (d, V)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T), rows))  # (V, d)
    graph.initializer.extend([
        numpy_helper.from_array(np.array([k], dtype=np.int64), f"{out}.k"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{out}.last"),
    ])
    approx = f"{out}.int8"
    last = producers[out]
    last.output[list(last.output).index(out)] = approx
    nodes = [
        helper.make_node("TopK", [approx, f"{out}.k"], [f"{out}.top_values", f"{out}.top"], name=f"{out}.topk",
                         axis=-1),
        helper.make_node("Gather", [rows, f"{out}.top"], [f"{out}.rows"], name=f"{out}.rows", axis=0),  # (b, t, K, d)
        helper.make_node("Unsqueeze", [hidden, f"{out}.last"], [f"{out}.h"], name=f"{out}.h"),  # (b, t, d, 1)
        helper.make_node("MatMul", [f"{out}.rows", f"{out}.h"], [f"{out}.exact1"], name=f"{out}.exact"),  # (b, t, K, 1)
        helper.make_node("Squeeze", [f"{out}.exact1", f"{out}.last"], [f"{out}.exact"], name=f"{out}.squeeze"),
        helper.make_node("ScatterElements", [approx, f"{out}.top", f"{out}.exact"], [out], name=f"{out}.rescored",
                         axis=-1),
    ]
    at = list(graph.node).index(last) + 1
    for i, node in enumerate(nodes):
        copy_metadata(node, last)
        graph.node.insert(at + i, node)
    return {"rescored": True, "top": k, "node": fp32.name, "table": rows}
