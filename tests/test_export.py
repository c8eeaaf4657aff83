"""The export pipeline: sidecar contents, graph properties, verification numbers and errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from backends.manifest import GRAPH_NAMES, ManifestError, load_manifest, sha256_file
from export import verify
from export.__main__ import main as export_main
from export.source import SourceError, check_local_folder


def test_manifest_lists_five_graphs_and_every_file_with_its_checksum(tiny_export_dir):
    manifest = load_manifest(tiny_export_dir)
    assert tuple(manifest.data["graphs"]) == GRAPH_NAMES
    files = manifest.data["files"]
    for name in GRAPH_NAMES:
        assert manifest.graph(name)["file"] in files
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        assert name in files
    for name, entry in files.items():
        assert sha256_file(tiny_export_dir / name) == entry["sha256"]
    assert manifest.data["opset"] >= 17
    versions = manifest.data["versions"]
    for package in ("torch", "transformers", "onnx", "onnxruntime", "onnxconverter-common"):
        assert versions[package]


def test_manifest_special_ids_and_limits_match_the_model(tiny_export_dir, tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    manifest = load_manifest(tiny_export_dir)
    special = manifest.data["special_tokens"]
    assert special["pad"] == config["pad_token_id"] == config["vocab_size"] - 1
    assert special["decoder_start"] == config["decoder_start_token_id"]
    assert special["eos"] == 0 and special["unk"] == 1
    assert special["bad_words_ids"] == [[special["pad"]]]
    assert manifest.max_source_tokens == 512
    assert manifest.max_new_tokens == 511
    model = manifest.data["model"]
    assert (model["decoder_layers"], model["decoder_attention_heads"], model["d_model"]) == (2, 4, 32)


def test_verification_covers_long_and_padded_inputs_within_tolerance(tiny_export_dir):
    result = load_manifest(tiny_export_dir).data["verification"]
    assert result["fp32_passed"] and result["failures"] == []
    cases = result["logits"]
    assert max(max(c["source_lengths"]) for c in cases) >= 400
    assert any(c["batch"] > 1 and len(set(c["source_lengths"])) > 1 for c in cases)
    assert len({max(c["source_lengths"]) for c in cases}) >= 3
    # PyTorch's own spread (one row alone and in the padded batch) is far below 1e-4 at this size, so
    # the fixed tolerance holds; it was measured, not assumed.
    assert 0 <= result["pytorch_spread"] < 1e-5 and result["fp32_tolerance"] == 1e-4
    for case in cases:
        assert case["max_abs_logit_diff"]["full"] <= 1e-4
        assert case["max_abs_logit_diff"]["kv_cache"] <= 1e-4
        assert case["max_abs_encoder_hidden_diff"]["kv_cache"] <= 1e-4
        # fp16 and int8 are reported; a working conversion is close but not exact.
        assert 0 < case["max_abs_logit_diff"]["kv_cache_fp16"] < 0.1
        assert 0 < case["max_abs_logit_diff"]["kv_cache_int8"] < 1.0
    greedy = result["greedy"]
    for name in ("ort_fp32_single_step", "ort_fp32_kv_cache"):
        assert greedy["backends"][name]["identical_ids"] == greedy["sentences"]
    assert 0 <= greedy["backends"]["ort_fp16"]["token_agreement"] <= 1
    assert result["int8"]["greedy"] == greedy["backends"]["ort_int8"]
    # Each engine's check has its own peak RSS, in the order it ran: the PyTorch reference first.
    phases = list(result["peak_rss_mb"])
    engines = ("ort_fp32_single_step", "ort_fp32_kv_cache", "ort_fp16", "ort_int8")
    assert phases[:2] == ["finite ort_fp16", "finite ort_int8"] and phases[2] == "logits pytorch"
    assert {f"logits {n}" for n in engines} | {f"greedy {n}" for n in ("pytorch", *engines)} <= set(phases), phases
    assert all(mb > 50 for mb in result["peak_rss_mb"].values()), result["peak_rss_mb"]


def test_graphs_have_no_dropout_and_dynamic_axes(tiny_export_dir):
    manifest = load_manifest(tiny_export_dir)
    for name in GRAPH_NAMES:
        graph = onnx.load(str(manifest.graph_path(name)))
        assert "Dropout" not in {n.op_type for n in graph.graph.node}
    session = ort.InferenceSession(str(manifest.graph_path("decoder")), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert isinstance(shapes["past.0.key"][0], str) and isinstance(shapes["past.0.key"][2], str)
    assert isinstance(shapes["encoder_attention_mask"][1], str)
    full = ort.InferenceSession(str(manifest.graph_path("full")), providers=["CPUExecutionProvider"])
    assert all(isinstance(d, str) for d in full.get_inputs()[2].shape)  # batch, tgt_len


def test_fp16_graphs_compute_in_fp16_with_fp32_io(tiny_export_dir):
    manifest = load_manifest(tiny_export_dir)
    graph = onnx.load(str(manifest.graph_path("decoder_fp16")))
    initializer_types = {t.data_type for t in graph.graph.initializer if len(t.dims) == 2}
    assert onnx.TensorProto.FLOAT16 in initializer_types
    assert {i.type.tensor_type.elem_type for i in graph.graph.output} == {onnx.TensorProto.FLOAT}


def test_int8_graphs_hold_quantized_matmuls(tiny_export_dir):
    manifest = load_manifest(tiny_export_dir)
    fp32_bytes = manifest.data["files"]["decoder.onnx"]["bytes"]
    graph = onnx.load(str(manifest.graph_path("decoder_int8")))
    ops = {n.op_type for n in graph.graph.node}
    assert ops & {"MatMulInteger", "DynamicQuantizeMatMul"}
    assert {t.data_type for t in graph.graph.initializer} & {onnx.TensorProto.INT8}
    assert manifest.data["files"]["decoder_int8.onnx"]["bytes"] < fp32_bytes


def test_int8_weights_fit_the_u8s8_kernels_of_every_x86_cpu(tiny_export_dir):
    """Without VNNI, ONNX Runtime multiplies u8 activations by s8 weights with an instruction that
    adds each pair of products in int16: |w| <= 64 keeps 2 * 255 * 64 within it on any CPU."""
    manifest = load_manifest(tiny_export_dir)
    assert "7-bit" in manifest.data["int8"]["weight_type"]
    for name in ("encoder_int8", "decoder_int8"):
        graph = onnx.load(str(manifest.graph_path(name))).graph
        inits = {i.name: i for i in graph.initializer}
        weights = [inits[n.input[1]] for n in graph.node
                   if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") and n.input[1] in inits]
        assert weights, name
        for w in weights:
            values = onnx.numpy_helper.to_array(w).astype(np.int32)
            assert values.min() >= -64 and values.max() <= 64, (name, w.name, int(values.min()), int(values.max()))


def _float_tables_read_by(graph: onnx.GraphProto, op_type: str) -> list[str]:
    inits = {i.name: i for i in graph.initializer}
    return [n.input[i] for n in graph.node if n.op_type == op_type for i in range(len(n.input))
            if n.input[i] in inits and len(inits[n.input[i]].dims) == 2
            and inits[n.input[i]].data_type == onnx.TensorProto.FLOAT]


def test_tied_output_layer_reads_a_transposed_copy_and_the_embedding_gathers_rows(tiny_export_dir):
    """The output MatMul reads its own (d, V) copy (nothing left for ORT to fold into one per session);
    the embedding Gather reads rows of the (V, d) table, the same numbers transposed, which is the
    encoder's table byte for byte (held once at run time)."""
    manifest = load_manifest(tiny_export_dir)
    vocab, d = manifest.data["model"]["vocab_size"], manifest.data["model"]["d_model"]
    encoder = onnx.load(str(manifest.graph_path("encoder"))).graph
    encoder_tables = [numpy_helper.to_array(i) for i in encoder.initializer if list(i.dims) == [vocab, d]]
    for name in ("full", "decoder"):
        graph = onnx.load(str(manifest.graph_path(name))).graph
        inits = {i.name: i for i in graph.initializer}
        transposed = [n for n in graph.node if n.op_type == "Transpose" and n.input[0] in inits]
        assert transposed == [], name  # nothing left for ORT to fold into a second copy
        matmul_tables = {n.input[1] for n in graph.node if n.op_type == "MatMul" and n.input[1] in inits
                         and list(inits[n.input[1]].dims) == [d, vocab]}
        gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits
                   and list(inits[n.input[0]].dims) == [vocab, d]]
        assert len(matmul_tables) == 1 and gathers, name
        assert all(next((a.i for a in g.attribute if a.name == "axis"), 0) == 0 for g in gathers), name
        rows = numpy_helper.to_array(inits[gathers[-1].input[0]])
        assert np.array_equal(numpy_helper.to_array(inits[matmul_tables.pop()]), rows.T), name
        assert any(np.array_equal(rows, t) for t in encoder_tables), name
        assert manifest.data["rewrites"][name]["weights"], name


def test_int8_graphs_read_int8_embeddings_and_output_layer(tiny_export_dir):
    manifest = load_manifest(tiny_export_dir)
    vocab, d = manifest.data["model"]["vocab_size"], manifest.data["model"]["d_model"]
    table_shape = sorted([d, vocab])  # (V, d) or (d, V); not the (1, V) final_logits_bias
    for name in ("encoder_int8", "decoder_int8"):
        graph = onnx.load(str(manifest.graph_path(name))).graph
        assert _float_tables_read_by(graph, "Gather") == [], name
        tables = [i for i in graph.initializer if sorted(i.dims) == table_shape]
        assert tables and {t.data_type for t in tables} == {onnx.TensorProto.INT8}, name
    decoder = onnx.load(str(manifest.graph_path("decoder_int8"))).graph
    inits = {i.name: i for i in decoder.initializer}
    gathered = next(n.input[0] for n in decoder.node if n.op_type == "Gather" and n.input[0] in inits
                    and list(inits[n.input[0]].dims) == [vocab, d])
    multiplied = next(n.input[1] for n in decoder.node if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul")
                      and n.input[1] in inits and list(inits[n.input[1]].dims) == [d, vocab])
    # the embedding and the output layer share their int8 numbers, one transposed from the other
    assert np.array_equal(numpy_helper.to_array(inits[gathered]), numpy_helper.to_array(inits[multiplied]).T)


def test_rewrites_keep_every_output_bit_identical(tmp_path):
    """A tied table read by a Gather and a MatMul(Transpose): same numbers after the rewrite."""
    from onnx import TensorProto, helper, numpy_helper

    from export.rewrite import pre_transpose_tied_embedding

    rng = np.random.default_rng(0)
    w = rng.standard_normal((50, 8)).astype(np.float32)  # (V, d)
    nodes = [
        helper.make_node("Gather", ["w", "ids"], ["emb"], axis=0),  # (b, t, d)
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["emb", "wt"], ["logits"]),  # (b, t, V)
    ]
    graph = helper.make_graph(
        nodes, "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "t"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", 50])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    ids = rng.integers(0, 50, (3, 4))
    before = ort.InferenceSession(model.SerializeToString()).run(None, {"ids": ids})[0]
    report = pre_transpose_tied_embedding(model)
    onnx.checker.check_model(model)
    after = ort.InferenceSession(model.SerializeToString()).run(None, {"ids": ids})[0]
    assert report["weights"][0]["gathers"] and report["weights"][0]["matmuls"]
    assert np.array_equal(before, after)
    assert np.allclose(after, w[ids] @ w.T, atol=1e-5)


def _ops(path) -> list[str]:
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_every_attention_core_is_one_multi_head_attention(tiny_export_dir):
    """No Softmax left in the KV-cache graphs of any precision: each layer's attention is one
    MultiHeadAttention (encoder: self-attention per layer; decoder: self and cross per layer)."""
    manifest = load_manifest(tiny_export_dir)
    layers = manifest.data["model"]["decoder_layers"], manifest.data["model"]["encoder_layers"]
    for name in ("encoder", "encoder_fp16", "encoder_int8", "decoder", "decoder_fp16", "decoder_int8"):
        ops = _ops(manifest.graph_path(name))
        expected = layers[1] if name.startswith("encoder") else 2 * layers[0]
        assert ops.count("MultiHeadAttention") == expected and "Softmax" not in ops, name
    assert "Softmax" in _ops(manifest.graph_path("full"))  # the naive migration stays HF's own graph
    fused = manifest.data["rewrites"]
    assert [a["key"] for a in fused["encoder"]["attention"]] == ["(b, s, h*d)"] * layers[1]  # split only for it
    assert [a["key"] for a in fused["decoder"]["attention"]] == ["(b, h, s, d)"] * (2 * layers[0])  # cache, inputs
    assert [a["bias"] for a in fused["decoder"]["attention"]] == [False, True] * layers[0]  # padding: cross only


def _run_graph(model, feeds):
    """Every output of an in-memory graph, in a session made as the backends make theirs."""
    from backends.ort_session import SessionConfig, disabled_optimizers, session_options

    settings = SessionConfig(threads=2)
    session = ort.InferenceSession(model.SerializeToString(), session_options(settings), providers=["CPUExecutionProvider"],
                                   disabled_optimizers=disabled_optimizers(settings))
    return session.run(None, feeds)


def _padded_source(config, rng, b: int = 3, s: int = 7):
    """(ids, mask) of b source rows, two of them padded."""
    mask = np.ones((b, s), dtype=np.int64)
    mask[1, 4:], mask[2, 2:] = 0, 0
    return np.where(mask == 1, rng.integers(4, config.vocab_size - 1, (b, s)), config.pad_token_id), mask


@pytest.mark.slow
def test_fused_attention_computes_the_very_numbers_of_the_exported_core(tiny_model_dir, tmp_path):
    """The encoder and decoder as the exporter writes them, then fused: every output bit-identical,
    with padded source rows and a non-empty past."""
    import copy

    from export import graphs
    from export.attention import fuse_attention
    from export.source import load_source

    model, _, _, family, _ = load_source(str(tiny_model_dir))
    config = model.config
    specs = graphs.graph_specs(config)
    rng = np.random.default_rng(0)
    b = 3
    ids, mask = _padded_source(config, rng, b)
    results = {}
    for name, heads in (("encoder", config.encoder_attention_heads), ("decoder", config.decoder_attention_heads)):
        exported = onnx.load(str(graphs.export_graph(model, family, config, specs[name], tmp_path, graphs.DEFAULT_OPSET)))
        fused = copy.deepcopy(exported)
        report = fuse_attention(fused, heads)
        assert len(report["attention"]) == _ops_count(exported, "Softmax") > 0 and _ops_count(fused, "Softmax") == 0
        if name == "encoder":
            feeds = {"input_ids": ids, "attention_mask": mask}
        else:
            h, d = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads
            feeds = {"input_ids": ids[:, :1], "encoder_attention_mask": mask}
            cross = results["encoder"][1:]
            for i, inp in enumerate(x.name for x in exported.graph.input if x.name.startswith("cross")):
                feeds[inp] = cross[i]
            for inp in (x.name for x in exported.graph.input if x.name.startswith("past")):
                feeds[inp] = rng.standard_normal((b, h, 5, d)).astype(np.float32)
        before, after = _run_graph(exported, feeds), _run_graph(fused, feeds)
        results[name] = before
        for x, y in zip(before, after, strict=True):
            assert x.shape == y.shape and np.array_equal(x, y), name



@pytest.mark.slow
def test_cache_in_attention_and_packed_qkv_compute_the_very_numbers(tiny_model_dir, tmp_path):
    """After fuse_attention: the decoder's cache appended by MultiHeadAttention itself and every
    attention's q/k/v as one MatMul + Split. Non-zero biases (the tiny model's are zero), padded
    source rows, an empty and a non-empty past; every output bit-identical, nodes really gone."""
    import copy

    import torch

    from export import graphs
    from export.attention import append_cache_in_attention, fuse_attention, pack_qkv
    from export.source import load_source

    model, _, _, family, _ = load_source(str(tiny_model_dir))
    config = model.config
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    specs = graphs.graph_specs(config)
    rng = np.random.default_rng(1)
    b = 3
    ids, mask = _padded_source(config, rng, b)
    layers = {"encoder": config.encoder_layers, "decoder": config.decoder_layers}
    cross = None
    for name, heads in (("encoder", config.encoder_attention_heads), ("decoder", config.decoder_attention_heads)):
        fused = onnx.load(str(graphs.export_graph(model, family, config, specs[name], tmp_path, graphs.DEFAULT_OPSET)))
        fuse_attention(fused, heads)
        rewritten = copy.deepcopy(fused)
        cache, packed = append_cache_in_attention(rewritten)["cache"], pack_qkv(rewritten)["packed"]
        # the encoder has no cache; every self-attention (not the cross-attention) has one input to pack
        assert len(cache) == (layers["decoder"] if name == "decoder" else 0)
        assert len(packed) == layers[name]
        assert _ops_count(rewritten, "Concat") == _ops_count(fused, "Concat") - 2 * len(cache)
        assert _ops_count(rewritten, "MatMul") == _ops_count(fused, "MatMul") - 2 * len(packed)
        assert _ops_count(rewritten, "Split") == len(packed)
        with_cache = [n for n in rewritten.graph.node if n.op_type == "MultiHeadAttention" and len(n.output) == 3]
        assert len(with_cache) == len(cache) and all(n.input[6].startswith("past") for n in with_cache)
        assert {n.output[1] for n in with_cache} | {n.output[2] for n in with_cache} == {
            o.name for o in rewritten.graph.output if o.name.startswith("present")}
        if name == "encoder":
            feeds = [{"input_ids": ids, "attention_mask": mask}]
        else:
            h, d = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads
            feeds = []
            for past in (0, 5):
                f = {"input_ids": ids[:, :1], "encoder_attention_mask": mask}
                f.update(zip((x.name for x in fused.graph.input if x.name.startswith("cross")), cross))
                f.update({x.name: rng.standard_normal((b, h, past, d)).astype(np.float32)
                          for x in fused.graph.input if x.name.startswith("past")})
                feeds.append(f)
        for f in feeds:
            before, after = _run_graph(fused, f), _run_graph(rewritten, f)
            for x, y in zip(before, after, strict=True):
                assert x.shape == y.shape and np.array_equal(x, y), name
            assert max(float(np.abs(x).max()) for x in before[1:]) > 0
        if name == "encoder":
            cross = before[1:]

@pytest.mark.slow
def test_shared_cross_attention_reads_each_sentence_once_for_all_its_beams(tiny_model_dir, tmp_path):
    """After the other rewrites: the decoder's cross-attention inputs batched by sentence. With one
    row per sentence every output is bit-identical; with three beams per sentence (rows in beam
    order, each beam its own token and past) it matches the unshared graph fed the keys, values
    and mask repeated per beam, and a beam given another sentence's row would not."""
    import copy

    from backends.manifest import CROSS_BATCH
    from export import graphs
    from export.attention import append_cache_in_attention, fuse_attention, pack_qkv, share_cross_attention
    from export.source import load_source

    model, _, _, family, _ = load_source(str(tiny_model_dir))
    config = model.config
    specs = graphs.graph_specs(config)
    rng = np.random.default_rng(2)
    b, n = 3, 3
    ids, mask = _padded_source(config, rng, b)
    encoder = onnx.load(str(graphs.export_graph(model, family, config, specs["encoder"], tmp_path, graphs.DEFAULT_OPSET)))
    cross = _run_graph(encoder, {"input_ids": ids, "attention_mask": mask})[1:]
    before = onnx.load(str(graphs.export_graph(model, family, config, specs["decoder"], tmp_path, graphs.DEFAULT_OPSET)))
    fuse_attention(before, config.decoder_attention_heads)
    append_cache_in_attention(before)
    pack_qkv(before)
    after = copy.deepcopy(before)
    shared = share_cross_attention(after)["shared_cross"]
    assert len(shared) == config.decoder_layers
    batch_dims = {i.name: i.type.tensor_type.shape.dim[0].dim_param for i in after.graph.input}
    assert {k for k, v in batch_dims.items() if v == CROSS_BATCH} == {
        i.name for i in after.graph.input if i.name.startswith("cross") or i.name == "encoder_attention_mask"}
    cross_names = [x.name for x in before.graph.input if x.name.startswith("cross")]
    h, d = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads

    def feeds(rows, sentence_of_row, tokens, past_len, per_row):
        f = {"input_ids": tokens}
        pick = sentence_of_row if per_row else np.arange(b)
        f["encoder_attention_mask"] = mask[pick]
        f.update({name: c[pick] for name, c in zip(cross_names, cross)})
        f.update({x.name: past_rng.standard_normal((rows, h, past_len, d)).astype(np.float32)
                  for x in before.graph.input if x.name.startswith("past")})
        return f

    past_rng = np.random.default_rng(3)
    one = feeds(b, np.arange(b), ids[:, :1], 4, per_row=True)
    for x, y in zip(_run_graph(before, one), _run_graph(after, one), strict=True):
        assert x.shape == y.shape and np.array_equal(x, y)
    rows = np.repeat(np.arange(b), n)  # beam order: [s0 x n, s1 x n, ...]
    tokens = rng.integers(4, config.vocab_size - 1, (b * n, 1))
    past_rng = np.random.default_rng(4)
    repeated = feeds(b * n, rows, tokens, 5, per_row=True)
    past_rng = np.random.default_rng(4)
    grouped = feeds(b * n, rows, tokens, 5, per_row=False)
    expected, got = _run_graph(before, repeated), _run_graph(after, grouped)
    for x, y in zip(expected, got, strict=True):
        assert x.shape == y.shape
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5)
    # the check can fail: rows that attend another sentence's source give other logits
    past_rng = np.random.default_rng(4)
    wrong = feeds(b * n, np.tile(np.arange(b), n), tokens, 5, per_row=True)
    assert np.abs(_run_graph(before, wrong)[0] - got[0]).max() > 1e-3


def _ops_count(model, op: str) -> int:
    return sum(n.op_type == op for n in model.graph.node)


def test_existing_output_needs_force(tiny_model_dir, tiny_export_dir, capsys):
    code = export_main([str(tiny_model_dir), "--out", str(tiny_export_dir), "--no-verify"])
    assert code == 2
    assert "--force" in capsys.readouterr().err


def test_unsupported_architecture_names_the_supported_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "fsmt", "architectures": ["FSMTForConditionalGeneration"]}))
    with pytest.raises(SourceError, match="supported: MarianMTModel"):
        check_local_folder(tmp_path)


def test_missing_files_are_named(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "target.spm").unlink()
    (broken / "model.safetensors").unlink()
    with pytest.raises(SourceError, match=r"model.safetensors or pytorch_model.bin, target.spm"):
        check_local_folder(broken)
    code = export_main([str(broken), "--out", str(tmp_path / "out")])
    assert code == 2 and not (tmp_path / "out").exists()


def test_folder_without_manifest_is_not_an_export(tiny_export_dir, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(tiny_export_dir, partial)
    (partial / "manifest.json").unlink()
    with pytest.raises(ManifestError, match="not a finished export"):
        load_manifest(partial)


def test_failed_fp32_verification_is_refused(tiny_export_dir, tmp_path):
    rejected = tmp_path / "rejected"
    shutil.copytree(tiny_export_dir, rejected)
    path = rejected / "manifest.json"
    data = json.loads(path.read_text())
    data["verification"]["fp32_passed"] = False
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="failed its verification"):
        load_manifest(rejected)


def test_judge_reports_every_fp32_failure_with_numbers():
    logits = {
        "cases": [
            {"case": "source 450 tokens", "max_abs_logit_diff": {"full": 3e-4, "kv_cache": 5e-5, "kv_cache_fp16": 0.5}},
            {"case": "padded batch", "max_abs_logit_diff": {"full": 1e-6, "kv_cache": 2e-3, "kv_cache_fp16": 0.5}},
        ]
    }
    greedy = {
        "sentences": 4,
        "backends": {
            "ort_fp32_single_step": {"identical_ids": 4, "first_mismatch": None},
            "ort_fp32_kv_cache": {"identical_ids": 3, "first_mismatch": {"sentence": "x"}},
            "ort_fp16": {"identical_ids": 1, "first_mismatch": {"sentence": "y"}},
        },
    }
    failures = verify.judge(logits, greedy)
    assert len(failures) == 3
    assert "full, source 450 tokens: max |Δlogit| 0.0003" in failures[0]
    assert "kv_cache, padded batch: max |Δlogit| 0.002" in failures[1]
    assert failures[2].startswith("ort_fp32_kv_cache: greedy ids identical on 3/4")
    assert verify.judge({"cases": [{"case": "c", "max_abs_logit_diff": {"full": np.float32(1e-5)}}]}, None) == []


def test_fp32_tolerance_follows_pytorchs_own_spread_never_below_1e4():
    logits = {"cases": [{"case": "source 27 tokens", "max_abs_logit_diff": {"kv_cache": 2.59e-4}}]}
    failures = verify.judge(logits, None)  # no spread measured: the fixed 1e-4
    assert failures == ["kv_cache, source 27 tokens: max |Δlogit| 0.000259 > 0.0001"]
    assert verify.judge({**logits, "pytorch_spread": 2.56e-4}, None) == []  # within twice PyTorch's spread
    failures = verify.judge({**logits, "pytorch_spread": 1.0e-4}, None)
    assert failures == ["kv_cache, source 27 tokens: max |Δlogit| 0.000259 > 0.0002 (PyTorch's own spread 0.0001)"]
    assert verify.fp32_tolerance(1e-7) == 1e-4


def test_the_padded_batch_repeats_the_first_case_so_pytorchs_spread_is_measured(tiny_model_dir):
    from transformers import MarianMTModel, MarianTokenizer

    tokenizer = MarianTokenizer.from_pretrained(tiny_model_dir)
    model = MarianMTModel.from_pretrained(tiny_model_dir).eval()
    cases = verify.build_cases(tokenizer, verify.read_dev_sentences(None, 64), model.config)
    references = [verify._torch_reference(model, case) for case in cases]
    spread = verify.pytorch_spread(cases, references)
    assert 0 <= spread < 1e-5
    # The same row with other decoder ids is refused rather than measured as rounding.
    cases[-1].decoder_ids[0, 1] = (cases[0].decoder_ids[0, 1] + 1) % model.config.vocab_size
    with pytest.raises(ValueError, match="must repeat the first case"):
        verify.pytorch_spread(cases, references)


def _translation(ids: list[int], text: str):
    from backends import Translation

    return Translation(text=text, token_ids=ids, tokens=[], timings_ms={}, scores=[], stop_reason="eos")


def test_token_parity_counts_ids_text_and_positional_agreement():
    from backends.divergence import token_parity

    sentences = ["a", "b", "c"]
    reference = [_translation([5, 6, 0], "x"), _translation([7, 0], "y"), _translation([8, 9, 10, 0], "z")]
    outputs = [_translation([5, 6, 0], "x"), _translation([7, 3, 0], "y"), _translation([8, 4, 10, 0], "w")]
    report = token_parity(sentences, reference, outputs)
    assert report["identical_ids"] == 1 and report["identical_text"] == 2
    assert report["token_agreement"] == 7 / 9  # position by position over the reference's 9 tokens
    assert report["first_mismatch"] == {"sentence": "b", "reference": [7, 0], "backend": [7, 3, 0]}
    assert report["mismatched_sentences"] == ["b", "c"]
    with pytest.raises(ValueError, match="3 sentences, 3 reference and 2 backend outputs"):
        token_parity(sentences, reference, outputs[:2])


def test_parity_report_runs_every_backend_in_batches_with_the_decode_options():
    from backends.divergence import parity_report

    class Fake:
        def __init__(self, shift):
            self.shift, self.calls = shift, []

        def translate(self, texts, **decode):
            self.calls.append((len(texts), decode))
            return [_translation([len(t) + self.shift, 0], t) for t in texts]

    backends = {"ref": Fake(0), "same": Fake(0), "off": Fake(1)}
    report = parity_report(backends, ["a", "bb", "ccc", "dddd", "e"], "ref", 2, max_new_tokens=7, top_k=3)
    for fake in backends.values():
        assert fake.calls == [(2, {"max_new_tokens": 7, "top_k": 3})] * 2 + [(1, {"max_new_tokens": 7, "top_k": 3})]
    assert (report["sentences"], report["batch_size"], report["max_new_tokens"], report["top_k"]) == (5, 2, 7, 3)
    assert set(report["backends"]) == {"same", "off"}
    assert report["backends"]["same"]["identical_ids"] == 5
    assert report["backends"]["off"]["identical_ids"] == 0 and report["backends"]["off"]["token_agreement"] == 0.5
    assert parity_report(backends, ["a", "bb"], "ref")["batch_size"] == 2  # None: one batch
    with pytest.raises(ValueError, match="reference backend 'pytorch' is not loaded; loaded: ref, same, off"):
        parity_report(backends, ["a"], "pytorch")


def test_parity_report_times_decoding_without_a_low_memory_engines_graph_reopening(monkeypatch):
    """The export's verification times each backend to pick the app's default: the seconds a
    low-memory engine spends reopening its graphs are reported apart, not counted as decoding."""
    from backends import divergence

    now = [0.0]
    monkeypatch.setattr(divergence.time, "perf_counter", lambda: now[0])

    class Engine:
        open_seconds = 0.0

    class Fake:
        def __init__(self, decode_s, open_s):
            self.model, self.decode_s, self.open_s = Engine(), decode_s, open_s

        def translate(self, texts, **decode):
            now[0] += self.open_s + self.decode_s
            self.model.open_seconds += self.open_s
            return [_translation([len(t), 0], t) for t in texts]

    backends = {"ref": Fake(0.5, 0.0), "swapping": Fake(0.25, 2.0)}
    report = divergence.parity_report(backends, ["a", "bb"], "ref", 1)
    assert report["reference_seconds"] == 1.0
    assert report["backends"]["swapping"]["seconds"] == 0.5  # two calls, each reopening its graphs
    assert report["backends"]["swapping"]["graph_open_seconds"] == 4.0
    assert "graph_open_seconds" not in divergence.parity_report({"ref": Fake(0.5, 0.0), "b": Fake(0.5, 0.0)},
                                                                ["a"], "ref")["backends"]["b"]


@pytest.mark.slow
def test_export_verification_and_bench_parity_report_the_same_comparison(tiny_export_dir):
    from bench import parity
    from conftest import dev_sentences

    sentences = dev_sentences(4)
    exported = verify.greedy_parity(tiny_export_dir, sentences, 12, threads=2)
    bench = parity.run(tiny_export_dir, sentences, 12, batch_size=4, threads=2)
    assert bench["export"] == str(tiny_export_dir)
    for report in (exported, bench):
        for entry in report["backends"].values():
            entry.pop("seconds")
            entry.pop("graph_open_seconds", None)  # the export's verification loads low-memory engines
    assert {k: v for k, v in bench.items() if k not in ("export", "reference_seconds")} == {
        k: v for k, v in exported.items() if k != "reference_seconds"
    }
    assert exported["backends"]["ort_fp32_kv_cache"]["identical_ids"] == 4


def test_fixture_tokenizer_comes_from_the_training_writer(tiny_model_dir):
    import sentencepiece as spm
    from transformers import MarianTokenizer

    from conftest import EMBEDDED_MODEL
    from corpus import dev_pairs
    from export.fixtures import FIXTURES
    from train.tokenizer import build_vocab, check_tokenizer

    vocab = json.loads((tiny_model_dir / "vocab.json").read_text(encoding="utf-8"))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert len(vocab) == config["vocab_size"] == FIXTURES["tiny"].vocab_size == 1302
    assert (vocab["</s>"], vocab["<unk>"], vocab["<pad>"]) == (0, 1, 1301)
    assert [k for k in vocab if k.startswith("<unused_")] == ["<unused_1298>", "<unused_1299>", "<unused_1300>"]
    # The spm conventions of the shipped model: <unk> = 0 and </s> = 1 in both spm models.
    for name in ("source.spm", "target.spm"):
        for folder in (tiny_model_dir, EMBEDDED_MODEL):
            sp = spm.SentencePieceProcessor(model_file=str(folder / name))
            assert (sp.unk_id(), sp.eos_id(), sp.id_to_piece(1)) == (0, 1, "</s>"), folder / name
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "MarianTokenizer" and config["added_tokens_decoder"]["1301"]["content"] == "<pad>"
    check_tokenizer(MarianTokenizer.from_pretrained(str(tiny_model_dir)), [p.zh for p in dev_pairs(50)])
    with pytest.raises(ValueError, match="1299 pieces do not fit a vocabulary of 1000"):
        build_vocab(tiny_model_dir / "source.spm", tiny_model_dir / "target.spm", 1000)


@pytest.mark.slow
def test_verification_holds_one_engine_at_a_time(tiny_model_dir, tiny_export_dir, monkeypatch):
    """At NLLB-600M's size, PyTorch and four ORT engines at once were ~10 GB of weights: every engine
    (the logits' step models and each backend's) is built only once the one before it is gone, and
    the numbers are those recorded at export."""
    import gc
    import weakref

    from backends import ort_kv_cache, ort_single_step, pytorch
    from export.source import load_source

    live, alive_at_start = weakref.WeakSet(), []

    def track(cls):
        init = cls.__init__

        def wrapped(self, *args, **kwargs):
            gc.collect()
            alive_at_start.append(len(live))
            init(self, *args, **kwargs)
            live.add(self)

        monkeypatch.setattr(cls, "__init__", wrapped)

    for cls in (ort_single_step.FullGraphStepModel, ort_kv_cache.KVCacheStepModel, pytorch.TorchStepModel):
        track(cls)
    # Within a low-memory KV engine, its encoder's session and its decoder's never coexist either.
    graph_sessions, open_at_start = weakref.WeakSet(), []
    create = ort_kv_cache.create_session

    def create_alone(path, config, *args, **kwargs):
        if config.low_memory and not isinstance(path, bytes):  # bytes: beam search's tiny gather graphs
            gc.collect()
            open_at_start.append(len(graph_sessions))
            session = create(path, config, *args, **kwargs)
            graph_sessions.add(session)
            return session
        return create(path, config, *args, **kwargs)

    monkeypatch.setattr(ort_kv_cache, "create_session", create_alone)
    model, tokenizer, *_ = load_source(str(tiny_model_dir))
    recorded = load_manifest(tiny_export_dir).data["verification"]
    sentences = verify.read_dev_sentences(None, 64)
    greedy = verify.read_dev_sentences(None, 16)
    result = verify.run(model, tokenizer, tiny_export_dir, sentences, greedy, 48, 2)
    beams = 5 if result["model_decoding"] else 0
    assert len(alive_at_start) == 4 + 5 + beams and max(alive_at_start) == 0, alive_at_start
    assert len(open_at_start) >= 4 and max(open_at_start) == 0, open_at_start
    assert result["logits"] == recorded["logits"]
    for key in ("greedy", "model_decoding"):
        for report in (result[key], recorded[key]):
            for entry in (report or {"backends": {}})["backends"].values():
                entry.pop("seconds")
                entry.pop("graph_open_seconds", None)
            (report or {}).pop("reference_seconds", None)
        assert result[key] == recorded[key], key


@pytest.mark.slow
def test_an_export_may_leave_out_the_single_step_graph_and_says_so(tiny_model_dir, tmp_path):
    """`--no-single-step` (for models whose full graph would repeat billions of weights): no full.onnx,
    the sidecar names what was left out, verification checks the rest, and the single-step backend is
    refused by name while the others load."""
    from backends import memory_needs, runnable_backends, try_load_backends
    from bench.data import default_backends
    from export.__main__ import main

    out = tmp_path / "kv-only"
    assert main([str(tiny_model_dir), "--out", str(out), "--no-single-step", "--threads", "2",
                 "--verify-sentences", "4", "--verify-max-new-tokens", "12"]) == 0
    manifest = load_manifest(out)
    assert not (out / "full.onnx").exists() and "full" not in manifest.data["graphs"]
    assert "--no-single-step" in manifest.graphs_left_out["full"]
    assert tuple(manifest.data["graphs"]) == GRAPH_NAMES[1:]
    verification = manifest.data["verification"]
    assert verification["passed"] and all("full" not in case["max_abs_logit_diff"] for case in verification["logits"])
    assert "ort_fp32_single_step" not in verification["greedy"]["backends"]
    assert set(verification["greedy"]["backends"]) == set(runnable_backends(manifest)) - {"pytorch"}
    assert "ort_fp32_single_step" not in runnable_backends(manifest) and "ort_int8" in runnable_backends(manifest)
    assert "ort_fp32_single_step" not in memory_needs(out)
    names, skipped = default_backends(manifest)  # what the benchmarks run by default
    assert names == list(runnable_backends(manifest)) and list(skipped) == ["ort_fp32_single_step"]
    assert "left out at export (--no-single-step)" in skipped["ort_fp32_single_step"]
    with pytest.raises(ManifestError, match="left out at export"):
        manifest.graph("full")
    loaded, failed = try_load_backends(out, ("ort_fp32_single_step", "ort_fp32_kv_cache"))
    assert list(loaded) == ["ort_fp32_kv_cache"]
    assert "left out at export (--no-single-step)" in failed["ort_fp32_single_step"]
    assert "this export runs: pytorch, ort_fp32_kv_cache" in failed["ort_fp32_single_step"]
    assert loaded["ort_fp32_kv_cache"].translate(["Hello."], max_new_tokens=8)[0]


_HEAP_PROBE = """
import ctypes, json, sys
import runtime.memory as memory
if sys.argv[1] == "fixed":
    assert memory.map_large_blocks()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
mb = 2**20
first = libc.malloc(16 * mb); libc.memset(first, 1, 16 * mb); libc.free(first)
block = libc.malloc(8 * mb); libc.memset(block, 1, 8 * mb)
after = libc.malloc(64)  # keeps the block off the heap's top, where free would trim it anyway
held = memory.rss_mb()
libc.free(block)
print(json.dumps(held - memory.rss_mb()))
"""


@pytest.mark.parametrize("mode", ["dynamic", "fixed"])
def test_the_exports_process_returns_a_freed_large_block_at_once(mode):
    """glibc raises its mmap threshold to the largest block freed, so the next large block comes from
    the heap and stays resident when freed; `map_large_blocks` (called by `python -m export`) keeps
    such blocks mapped alone. "dynamic" is glibc's default, which shows the probe can fail."""
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True,
                         cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    returned_mb = json.loads(out.stdout)
    if mode == "fixed":
        assert returned_mb > 7, returned_mb  # the 8 MiB block left the process when freed
    else:
        assert returned_mb < 1, returned_mb


def test_a_table_the_encoder_and_decoder_both_gather_is_held_and_counted_once(embedded_export_dir):
    """The decoder gathers rows of the encoder's own (V, d) table (format v8): loaded together the
    two sessions get one array, and the memory estimate counts its bytes once, not per file."""
    from backends import memory_needs
    from backends.shared_tables import SharedTables

    manifest = load_manifest(embedded_export_dir)
    model = manifest.data["model"]
    table = model["vocab_size"] * model["d_model"] * 4
    encoder, decoder = (manifest.graph(g)["gathered_tables"] for g in ("encoder", "decoder"))
    both = set(encoder) & set(decoder)
    assert [encoder[digest] for digest in both] == [table]
    tables = SharedTables()
    enc = tables.for_graph(manifest.graph_path("encoder"))
    dec = tables.for_graph(manifest.graph_path("decoder"))
    assert any(a is b for a in enc.values() for b in dec.values())
    files = manifest.data["files"]
    pair = files["encoder.onnx"]["bytes"] + files["decoder.onnx"]["bytes"]
    assert memory_needs(embedded_export_dir, ("ort_fp32_kv_cache",))["ort_fp32_kv_cache"] == pair - table
