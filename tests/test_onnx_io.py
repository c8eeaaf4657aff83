"""export/onnx_io.py: graphs rewritten with their weights on disk, copied and converted file to file."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export import onnx_io


def _graph_file(folder, weights: dict[str, np.ndarray]):
    """A graph that reads each weight (MatMul by a (1, rows) input), saved with external data."""
    nodes, inputs, outputs = [], [], []
    for i, (name, w) in enumerate(weights.items()):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, w.shape[0]]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, w.shape[1]]))
        nodes.append(helper.make_node("MatMul", [f"x{i}", name], [f"y{i}"], name=f"mm{i}"))
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(w, n) for n, w in weights.items()])
    path = folder / "g.onnx"
    onnx_io.save(helper.make_model(graph), path, external_data=True)
    return path


def _weights(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_a_transpose_written_block_by_block_is_the_transpose(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((371, 5)).astype(np.float32)  # over SIZE_THRESHOLD: external
    path = _graph_file(tmp_path, {"other": np.ones((3, 300), np.float32), "w": w})
    monkeypatch.setattr(onnx_io, "CHUNK_BYTES", 3 * 5 * 4)  # three rows a block: 124 blocks, the last short
    model = onnx_io.load_structure(path)
    table = next(t for t in model.graph.initializer if t.name == "w")
    t = onnx_io.transpose_to_file(table, tmp_path, "w.T")
    assert list(t.dims) == [5, 371]
    assert np.array_equal(numpy_helper.to_array(t, str(tmp_path)), w.T)


def test_streamed_save_in_place_copies_converts_and_drops_stale_data(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    weights = {"a": rng.standard_normal((16, 40)).astype(np.float32) * 3e4,  # past fp16's clamp
               "b": rng.standard_normal((40, 8)).astype(np.float32)}
    path = _graph_file(tmp_path, weights)
    monkeypatch.setattr(onnx_io, "CHUNK_BYTES", 256)  # many chunks per tensor
    model = onnx_io.load_structure(path)
    assert all(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)
    a = next(t for t in model.graph.initializer if t.name == "a")
    a.data_type = TensorProto.FLOAT16  # retyped by a converter, its bytes still fp32 on disk

    from export.fp16 import _fp16_bytes
    from onnxconverter_common.float16 import convert_np_to_float16

    onnx_io.save(model, path, external_data=True, source=tmp_path, convert={"a": _fp16_bytes})
    saved = _weights(path)
    assert saved["a"].dtype == np.float16
    assert np.array_equal(saved["a"].view(np.uint16), convert_np_to_float16(weights["a"], 1e-7, 1e4).view(np.uint16))
    assert np.abs(saved["a"]).max() == np.float16(1e4)  # the converter's clamp, applied file to file
    assert np.array_equal(saved["b"], weights["b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx", "g.onnx.data"]  # no partial files left
    assert (tmp_path / "g.onnx.data").stat().st_size == 16 * 40 * 2 + 40 * 8 * 4
