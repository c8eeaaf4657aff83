"""int8 by measured sensitivity: the ranking, the nodes kept in fp32, the option and the sidecar.

On the tiny fixture's fp32 graphs (4 calibration sentences); the export with --int8-keep is `slow`.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import onnx
import pytest

from backends import load_manifest
from backends.tokenizer import TokenizerWrapper
from export import int8_choice, quantize
from export.int8_sensitivity import calibration, measure

from conftest import cached, dev_sentences, quiet

QUANTIZED = {"MatMulInteger", "DynamicQuantizeMatMul"}


def _calibration(export_dir, n=4):
    manifest = load_manifest(export_dir)
    batch = TokenizerWrapper(export_dir).encode(dev_sentences(n), manifest.max_source_tokens)
    return manifest, calibration(batch.input_ids, batch.attention_mask, manifest.data["special_tokens"],
                                 manifest.data["generation"], max_new_tokens=12)


@pytest.fixture(scope="module")
def tiny_ranking(tiny_export_dir):
    manifest, calib = _calibration(tiny_export_dir)
    return measure(tiny_export_dir, manifest.data["model"], calib, threads=1, log=quiet)


def test_ranking_covers_every_quantized_node_and_is_deterministic(tiny_export_dir, tiny_ranking):
    manifest, calib = _calibration(tiny_export_dir)
    again = measure(tiny_export_dir, manifest.data["model"], calib, threads=1, log=quiet)
    assert [s.record() for s in again["ranking"]] == [s.record() for s in tiny_ranking["ranking"]]
    nodes = {(s.item.graph, s.item.op) for s in tiny_ranking["ranking"]}
    assert nodes == {("encoder", "MatMul"), ("encoder", "Gather"), ("decoder", "MatMul"), ("decoder", "Gather")}
    decoder = onnx.load(str(tiny_export_dir / "decoder.onnx"), load_external_data=False)
    constant_matmuls = [i for i in quantize.quantizable("decoder", decoder) if i.op == "MatMul"]
    assert len([s for s in tiny_ranking["ranking"] if s.item.graph == "decoder" and s.item.op == "MatMul"]) \
        == len(constant_matmuls) > 0
    removed = [s.margin_error_removed for s in tiny_ranking["ranking"]]
    assert removed == sorted(removed, reverse=True)
    assert tiny_ranking["baseline"]["margin_error"] > 0  # int8 moves the logits: there is something to rank


def test_keep_n_leaves_exactly_those_matmuls_in_fp32(tiny_export_dir, tiny_ranking, tmp_path):
    kept = [s.item for s in tiny_ranking["ranking"] if s.item.op == "MatMul" and s.item.graph == "decoder"][:2]
    dst = tmp_path / "decoder_int8.onnx"
    quantize.quantize_int8(tiny_export_dir / "decoder.onnx", dst, keep={i.node for i in kept})
    graph = onnx.load(str(dst)).graph
    inits = {i.name: i for i in graph.initializer}
    float_matmuls = {n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits}
    assert float_matmuls == {i.node for i in kept}
    for i in kept:  # its weight is still the fp32 one
        assert inits[i.weight].data_type == onnx.TensorProto.FLOAT
    all_int8 = tmp_path / "all.onnx"
    quantize.quantize_int8(tiny_export_dir / "decoder.onnx", all_int8)
    count = sum(n.op_type in QUANTIZED for n in onnx.load(str(all_int8)).graph.node)
    assert sum(n.op_type in QUANTIZED for n in graph.node) == count - len(kept)


def test_keep_n_plus_rescore_keeps_the_n_most_sensitive_but_the_output_layer_and_rescores_it(
        tiny_export_dir, tiny_ranking, monkeypatch):
    """`--int8-keep N+rescore`, the curve's "N + re-score" rows as an export choice: the output layer
    stays int8 with its best logits re-scored, and N nodes from the rest of the ranking are kept."""
    from export.int8_rescore import DEFAULT_TOP, output_layer

    head = output_layer(onnx.load(str(tiny_export_dir / "decoder.onnx"), load_external_data=False)).name
    ranking = tiny_ranking["ranking"]
    # The output layer first, so that "the N most sensitive" and "N but the output layer" differ here.
    first = [s for s in ranking if s.item.graph == "decoder" and s.item.node == head]
    assert first, "the tiny decoder's output layer is quantized, so it is ranked"
    measured = {**tiny_ranking, "ranking": first + [s for s in ranking if s not in first]}
    monkeypatch.setattr(int8_choice.int8_sensitivity, "measure", lambda *a, **k: measured)
    others = [s.item.node for s in measured["ranking"][1:]]
    choice = int8_choice.choose(tiny_export_dir, {}, None, "3+rescore", log=quiet)
    assert choice["option"] == "3+rescore" and choice["rescore"] == DEFAULT_TOP
    assert [k["node"] for k in choice["kept"]] == others[:3] and head not in others[:3]
    assert "re-scored" in choice["rule"]
    plain = int8_choice.choose(tiny_export_dir, {}, None, 3, log=quiet)
    assert plain["rescore"] == 0 and plain["kept"][0]["node"] == head


def test_keep_a_gather_leaves_that_embedding_in_fp32(tiny_export_dir, tmp_path):
    encoder = onnx.load(str(tiny_export_dir / "encoder.onnx"), load_external_data=False)
    (gather,) = [i for i in quantize.quantizable("encoder", encoder) if i.op == "Gather"]
    dst = tmp_path / "encoder_int8.onnx"
    quantize.quantize_int8(tiny_export_dir / "encoder.onnx", dst, keep={gather.node})
    graph = onnx.load(str(dst)).graph
    inits = {i.name: i for i in graph.initializer}
    (node,) = [n for n in graph.node if n.name == gather.node]
    assert node.op_type == "Gather" and inits[node.input[0]].data_type == onnx.TensorProto.FLOAT
    assert any(n.op_type in QUANTIZED for n in graph.node)


@pytest.mark.parametrize("axis", [0, 1])
def test_an_embedding_quantized_row_block_by_row_block_equals_the_whole_table_at_once(axis, tmp_path, monkeypatch):
    """rewrite._symmetric_int8 reads the fp32 table a few rows at a time, from its data file when
    external: its scales and int8 numbers are those of the whole table quantized at once."""
    from onnx import numpy_helper

    from export import onnx_io, rewrite

    w = np.random.default_rng(0).standard_normal((37, 11)).astype(np.float32) * 3
    w[5] = 0.0
    w[:, 2] = 0.0  # a zero slice on either axis gets scale 1
    reduce = 1 - axis
    scale = np.abs(w).max(axis=reduce) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(w / np.expand_dims(scale, reduce)), -127, 127).astype(np.int8)

    monkeypatch.setattr(onnx_io, "CHUNK_BYTES", 3 * 11 * 4)  # three rows a block: 13 blocks
    inline = numpy_helper.from_array(w, "w")
    (tmp_path / "w.data").write_bytes(b"\0" * 8 + w.tobytes())
    external = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[37, 11])
    onnx_io._point_to(external, "w.data", 8, w.nbytes)
    for tensor, folder in ((inline, None), (external, tmp_path)):
        got_q, got_scale = rewrite._symmetric_int8(tensor, axis, folder)
        assert got_q.tobytes() == q.tobytes() and got_scale.tobytes() == scale.tobytes()
        assert got_q.dtype == np.int8 and got_scale.dtype == np.float32


def test_unknown_node_to_keep_is_refused(tiny_export_dir, tmp_path):
    with pytest.raises(ValueError, match="no node"):
        quantize.quantize_int8(tiny_export_dir / "decoder.onnx", tmp_path / "x.onnx", keep={"no_such_node"})


@pytest.mark.parametrize("value", ["most", "-1", "2.5", "", "rescore", "+rescore", "2+rescale"])
def test_bad_int8_keep_is_refused_naming_the_choices(value, tmp_path, capsys):
    from export.__main__ import main
    from export.pipeline import ExportOptions

    assert int8_choice.CHOICES == "auto, none, a count N >= 0, or N+rescore"
    with pytest.raises(ValueError, match="expected one of: auto, none, a count N >= 0, or N\\+rescore"):
        ExportOptions(out=tmp_path / "x", int8_keep=value)
    assert main(["nowhere", "--out", str(tmp_path / "x"), "--int8-keep", value]) == 2
    assert f"expected one of: {int8_choice.CHOICES}" in capsys.readouterr().err


def test_int8_keep_values_are_normalised_once():
    from export.pipeline import ExportOptions

    values = ("AUTO", " none", "3", 2, "32 + ReScore", "04+rescore")
    assert [ExportOptions(out="x", int8_keep=v).int8_keep for v in values] == \
        ["auto", "none", "3", "2", "32+rescore", "4+rescore"]


def _make_kept(tiny_model_dir, folder):
    from export.pipeline import ExportOptions, export

    export(str(tiny_model_dir), ExportOptions(out=folder / "tiny", threads=1, int8_keep="2", verify=False), log=quiet)


@pytest.mark.slow
def test_export_with_int8_keep_records_the_kept_nodes(tiny_model_dir):
    out = cached("tiny-int8-keep2", functools.partial(_make_kept, tiny_model_dir)) / "tiny"
    manifest = load_manifest(out)
    section = manifest.data["int8"]
    assert section["keep_option"] == "2"
    kept = section["kept_in_fp32"]
    assert len(kept) == 2
    ranking = section["sensitivity"]["ranking"]
    assert [k["node"] for k in kept] == [r["node"] for r in ranking[:2]]
    for k in kept:
        assert k["why"] and "margin_error_removed" in k and "flips_removed" in k
        graph = onnx.load(str(manifest.graph_path(f"{k['graph']}_int8"))).graph
        (node,) = [n for n in graph.node if n.name == k["node"]]
        assert node.op_type == k["op"]  # still the fp32 MatMul / Gather, not a quantized one
        inits = {i.name: i for i in graph.initializer}
        assert inits[k["weight"]].data_type == onnx.TensorProto.FLOAT
    json.dumps(section)  # the sidecar holds plain JSON
    assert np.isfinite(section["sensitivity"]["all_int8"]["margin_error"])


def test_rescored_output_layer_gives_exact_top_logits(tiny_export_dir, tmp_path):
    """Every other node kept in fp32, so the hidden state is fp32's: the K best logits of the int8
    output layer, re-scored, are fp32's own; the rest stay int8 (different)."""
    from export.int8_rescore import output_layer
    from export.int8_sensitivity import _engine

    manifest, calib = _calibration(tiny_export_dir)
    decoder = onnx.load(str(tiny_export_dir / "decoder.onnx"), load_external_data=False)
    head = output_layer(decoder).name
    others = {i.node for i in quantize.quantizable("decoder", decoder) if i.node != head}
    dst = tmp_path / "decoder_int8.onnx"
    report = quantize.quantize_int8(tiny_export_dir / "decoder.onnx", dst, keep=others, rescore=4)
    assert report["output_layer_rescored"]["top"] == 4
    shape, enc = manifest.data["model"], tiny_export_dir / "encoder.onnx"
    exact, rescored = _engine(enc, tiny_export_dir / "decoder.onnx", shape, 1), _engine(enc, dst, shape, 1)
    ids = np.full((calib.input_ids.shape[0], 1), calib.prefix[0], dtype=np.int64)
    a = exact.step(exact.encode(calib.input_ids, calib.attention_mask), ids).copy()
    b = rescored.step(rescored.encode(calib.input_ids, calib.attention_mask), ids).copy()
    top = np.argsort(-b, axis=1)[:, :4]
    np.testing.assert_allclose(np.take_along_axis(b, top, 1), np.take_along_axis(a, top, 1), rtol=0, atol=1e-5)
    assert np.array_equal(a.argmax(1), b.argmax(1))
    assert np.abs(a - b).max() > 1e-3  # the other logits are the int8 layer's


def test_int8_curve_every_node_kept_is_pytorch_again(tiny_export_dir, tmp_path):
    """bench quality --int8-curve on 6 sentences: with every node kept in fp32 the int8 graphs are the
    fp32 ones, identical to PyTorch; N = 0 (the ratios' base) is added; the table has every row."""
    from bench.int8_curve import run, table
    from corpus import dev_pairs

    decoder = onnx.load(str(tiny_export_dir / "decoder.onnx"), load_external_data=False)
    encoder = onnx.load(str(tiny_export_dir / "encoder.onnx"), load_external_data=False)
    every = len(quantize.quantizable("encoder", encoder)) + len(quantize.quantizable("decoder", decoder))
    results = run(tiny_export_dir, dev_pairs(6), tmp_path, (every,), max_new_tokens=12, speed_sentences=2, rounds=1,
                  log=quiet)
    rows = {row["kept"]: row for row in results["rows"]}
    assert list(rows) == ["0", str(every)]
    for b in results["beams"]:
        assert rows[str(every)][f"beams{b}"]["identical"] == 6
    assert rows["0"]["ratio_to_keep0"] == 1.0 and rows[str(every)]["ms_per_token_batch1"] > 0
    assert len(table(results).splitlines()) == 2 + len(rows)
