"""service/locate.py on the tiny model: per-module drift against PyTorch, located to the module.

A perturbed export (one bias of one module changed, its checksum updated) must be located to
exactly that module; unperturbed fp32 graphs stay under 1e-4 everywhere; fp16 and int8 map every
module and show their precision's error; a graph without exporter metadata gets a clear message.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from backends import SessionConfig, load_backends
from backends.manifest import sha256_file
from bench.__main__ import main as bench_main
from conftest import REPO
from service.locate import (
    JUMP_FACTOR,
    LocateError,
    _node_scope,
    choose_step,
    hf_module,
    locate,
    locate_for_ui,
    map_graph,
    module_order,
)

TEXT = "Click OK to save the document."
STEP = 3
FP32 = ("ort_fp32_single_step", "ort_fp32_kv_cache")


@pytest.fixture(scope="module")
def reference_ids(tiny_backends):
    return tiny_backends["pytorch"].translate([TEXT], max_new_tokens=12)[0].token_ids


def _perturbed_copy(export_dir, tmp_path, graph_file: str, module: str, delta: float):
    """A copy of the export whose `module` (an HF path) adds `delta` to one entry of its bias in
    `graph_file`; the sidecar's checksum is updated so the backends load it. Biases equal in value
    are one shared initializer in the exported graph, so the module's Add gets its own copy."""
    out = tmp_path / "export"
    shutil.copytree(export_dir, out)
    path = out / graph_file
    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    targets = []
    for node in model.graph.node:
        if node.op_type != "Add" or hf_module(*_node_scope(node)) != module:
            continue
        targets += [(node, k) for k, name in enumerate(node.input) if name in inits and len(inits[name].dims) == 1]
    assert len(targets) == 1, f"{module}: expected one bias Add in {graph_file}, found {len(targets)}"
    node, k = targets[0]
    bias = numpy_helper.to_array(inits[node.input[k]]).copy()
    bias[1] += np.asarray(delta, dtype=bias.dtype)
    name = f"{node.input[k]}.perturbed"
    model.graph.initializer.append(numpy_helper.from_array(bias, name))
    node.input[k] = name
    onnx.save(model, str(path))
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    manifest["files"][graph_file]["sha256"] = sha256_file(path)
    manifest["files"][graph_file]["bytes"] = path.stat().st_size
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    return out


def _with_reference(tiny_backends, export_dir, name):
    """The session's PyTorch reference next to `name` loaded from another (perturbed) export."""
    loaded = load_backends(export_dir, (name,), SessionConfig(threads=2))
    return {"pytorch": tiny_backends["pytorch"], name: loaded[name]}


@pytest.mark.parametrize("name", FP32)
def test_unperturbed_fp32_no_module_over_tolerance(tiny_backends, reference_ids, name):
    report = locate(tiny_backends, name, TEXT, STEP, reference_ids=reference_ids)
    assert report["first_over_tolerance"] is None
    assert report["tolerance"] == {"rule": "absolute", "metric": "max_abs_diff", "value": 1e-4}
    assert [row["module"] for row in report["layers"]] == module_order(2, 2)  # every module, in order
    assert report["unmapped"] == []
    assert max(row["max_abs_diff"] for row in report["layers"]) <= 1e-4
    assert all(not row["over"] for row in report["layers"])
    assert report["max_abs_dlogit"] <= 1e-4
    # Reading ORT's own optimized graph changes nothing; the copy for outputs ORT fused away, a little.
    assert report["reading_max_abs_dlogit"]["onnxruntime"] == 0.0
    assert report["reading_max_abs_dlogit"].get("exported", 0.0) <= 1e-5
    assert {row["read_from"] for row in report["layers"]} <= {"onnxruntime", "exported"}
    for row in report["layers"]:
        assert (row["ort_op_types"] is None) == (row["read_from"] == "exported"), row["module"]
    rows = {row["module"]: row for row in report["layers"]}
    assert rows["decoder.layers.1.fc1"]["op_types"] == ["MatMul", "Add"]
    assert "LayerNormalization" in rows["encoder.layers.0.final_layer_norm"]["op_types"]
    # In the KV-cache graphs the attention core runs as one fused operator (export/attention.fuse_attention),
    # and locate names it; the single-step graph is HF's own forward, Softmax and all.
    fused = name == "ort_fp32_kv_cache"
    assert ("MultiHeadAttention" in rows["decoder.layers.0.encoder_attn"]["op_types"]) == fused
    assert ("Softmax" in rows["decoder.layers.0.encoder_attn"]["op_types"]) == (not fused)
    assert rows["lm_head"]["op_types"] == ["MatMul"]
    assert report["step"] == STEP and report["step_rule"] == "given"
    assert report["reference_token"]["id"] == reference_ids[STEP] == report["backend_argmax"]["id"]


@pytest.mark.parametrize(
    "name, graph_file, module",
    [
        ("ort_fp32_kv_cache", "decoder.onnx", "decoder.layers.1.fc1"),
        ("ort_fp32_kv_cache", "decoder.onnx", "decoder.layers.0.fc2"),
        ("ort_fp32_kv_cache", "encoder.onnx", "encoder.layers.1.self_attn.v_proj"),
        ("ort_fp32_single_step", "full.onnx", "decoder.layers.0.encoder_attn.q_proj"),
    ],
)
def test_perturbed_bias_is_located_to_its_module(tiny_backends, tiny_export_dir, reference_ids, tmp_path, name,
                                                 graph_file, module):
    export = _perturbed_copy(tiny_export_dir, tmp_path, graph_file, module, 0.05)
    report = locate(_with_reference(tiny_backends, export, name), name, TEXT, STEP, reference_ids=reference_ids)
    first = report["first_over_tolerance"]
    assert first is not None and first["module"] == module
    assert first["max_abs_diff"] == pytest.approx(0.05, rel=1e-3)  # the bias entry itself, nothing else yet
    before = report["layers"][: [r["module"] for r in report["layers"]].index(module)]
    assert before and max(r["max_abs_diff"] for r in before) <= 1e-4
    assert report["summary"].startswith(f"{name} at step {STEP} (given): first over tolerance is {module}")


def test_fp16_shows_its_rounding_and_finds_an_injected_jump(tiny_backends, tiny_export_dir, reference_ids, tmp_path):
    report = locate(tiny_backends, "ort_fp16", TEXT, STEP, reference_ids=reference_ids)
    assert report["tolerance"]["rule"] == "jump" and report["tolerance"]["metric"] == "rel_error"
    assert report["unmapped"] == []
    rel = [row["rel_error"] for row in report["layers"]]
    # fp16 rounding everywhere (unit roundoff 4.9e-4), growing slowly: no module stands out.
    assert 1e-5 < min(rel) and max(rel) < 5e-3
    assert {row["dtype"] for row in report["layers"]} == {"float16"}
    assert report["first_over_tolerance"] is None
    assert "no module's relative error jumps" in report["summary"]
    assert report["largest_jump"]["ratio"] <= JUMP_FACTOR
    # One module made 5% off inside the fp16 graph: the first jump is exactly there.
    export = _perturbed_copy(tiny_export_dir, tmp_path, "decoder_fp16.onnx", "decoder.layers.1.fc2", 0.5)
    report = locate(_with_reference(tiny_backends, export, "ort_fp16"), "ort_fp16", TEXT, STEP,
                    reference_ids=reference_ids)
    first = report["first_over_tolerance"]
    assert first["module"] == "decoder.layers.1.fc2"
    assert first["rel_error"] > JUMP_FACTOR * max(r["rel_error"] for r in report["layers"][: report["layers"].index(first)])


def test_int8_maps_every_module_after_quantization(tiny_backends, reference_ids):
    report = locate(tiny_backends, "ort_int8", TEXT, STEP, reference_ids=reference_ids)
    assert report["unmapped"] == []
    rows = {row["module"]: row for row in report["layers"]}
    # The quantizer's nodes carry the replaced MatMul's metadata (export/rewrite.copy_scope_metadata).
    assert "MatMulInteger" in rows["lm_head"]["op_types"]
    assert "MatMulInteger" in rows["decoder.layers.1.fc2"]["op_types"]
    assert "Gather" in rows["encoder.embed_tokens"]["op_types"] and "Cast" in rows["encoder.embed_tokens"]["op_types"]
    rel = [row["rel_error"] for row in report["layers"]]
    assert 1e-4 < min(rel) and max(rel) < 0.1  # int8 rounding: about 1%
    assert report["tolerance"]["floor"] == pytest.approx(1 / 127)


def test_exporter_metadata_survives_every_rewrite(tiny_export_dir):
    """Every node of every graph says which module it came from, except the int8 quantizer's
    shared activation quantization (one DynamicQuantizeLinear for q, k and v) and the fp16
    converter's casts at graph inputs and outputs."""
    allowed = {"full": set(), "encoder": set(), "decoder": set(), "encoder_fp16": {"Cast", "Identity"},
               "decoder_fp16": {"Cast", "Identity"}, "encoder_int8": {"DynamicQuantizeLinear"},
               "decoder_int8": {"DynamicQuantizeLinear"}}
    for graph, ops in allowed.items():
        model = onnx.load(str(tiny_export_dir / f"{graph}.onnx"))
        missing = {n.op_type for n in model.graph.node if _node_scope(n) == (None, None)}
        assert missing <= ops, graph


def test_graph_without_metadata_gets_a_clear_message(tiny_backends, tiny_export_dir, reference_ids, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(tiny_export_dir, out)
    path = out / "decoder.onnx"
    model = onnx.load(str(path))
    for node in model.graph.node:
        del node.metadata_props[:]
    onnx.save(model, str(path))
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    manifest["files"]["decoder.onnx"]["sha256"] = sha256_file(path)
    (out / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    backends = _with_reference(tiny_backends, out, "ort_fp32_kv_cache")
    with pytest.raises(LocateError, match=r"cannot map decoder\.onnx to the model's modules: none of its \d+ nodes"):
        locate(backends, "ort_fp32_kv_cache", TEXT, STEP, reference_ids=reference_ids)
    answer = locate_for_ui(backends, "ort_fp32_kv_cache", TEXT, reference_ids, step=STEP)
    assert set(answer) == {"backend", "text", "error"} and "re-export" in answer["error"]


def test_torchscript_style_node_names_map_like_metadata(tiny_export_dir):
    """An export without dynamo metadata but with TorchScript's scoped node names
    (/model/decoder/layers.0/fc1/MatMul) maps to the same values."""
    model = onnx.load(str(tiny_export_dir / "full.onnx"))
    modules = module_order(2, 2)
    expected = map_graph(model, modules, "full.onnx").values
    for i, node in enumerate(model.graph.node):
        scopes = {p.key: p.value for p in node.metadata_props}.get("pkg.torch.onnx.name_scopes")
        deepest = [s for s in ast.literal_eval(scopes)[:-1] if s][-1:] if scopes else []
        path = deepest[0].replace(".", "/") if deepest else "model"
        node.name = f"/{path}/{node.op_type}_{i}"
        del node.metadata_props[:]
    assert map_graph(model, modules, "full.onnx").values == expected


def test_choose_step():
    assert choose_step([5, 6, 7, 8], [5, 6, 9, 8], None) == (2, "first diverging step")
    assert choose_step([5, 6, 7, 0], [5, 6, 7, 9, 9, 0], None) == (3, "first diverging step")
    assert choose_step([5, 6, 0], [5, 6, 0, 4], None) == (2, "first diverging step")  # clamped to the reference
    assert choose_step([5, 6, 0], [5, 6, 0], None, drift=[0.1, 0.5, 0.2]) == (1, "largest teacher-forced |Δlogit|")
    assert choose_step([5, 6, 0], None, "max", drift=[0.3, 0.1, 0.2]) == (0, "largest teacher-forced |Δlogit|")
    assert choose_step([5, 6, 0], [7], 1) == (1, "given")
    with pytest.raises(LocateError, match=r"step must be in 0\.\.2"):
        choose_step([5, 6, 0], None, 3)
    with pytest.raises(LocateError, match="step must be an integer, 'max' or None"):
        choose_step([5, 6, 0], None, "first")


def test_ui_function_picks_the_first_diverging_step(tiny_backends, reference_ids):
    backend_ids = [*reference_ids[:2], reference_ids[2] + 1, *reference_ids[3:]]
    report = locate_for_ui(tiny_backends, "ort_fp32_kv_cache", TEXT, reference_ids, backend_ids)
    assert (report["step"], report["step_rule"]) == (2, "first diverging step")
    assert report["first_over_tolerance"] is None
    assert locate_for_ui(tiny_backends, "pytorch", TEXT, reference_ids, backend_ids)["error"].startswith(
        "'pytorch' runs no ONNX graph"
    )


def test_cli_writes_the_report(tiny_export_dir, tmp_path, capsys):
    out = tmp_path / "locate.json"
    rc = bench_main(["locate", str(tiny_export_dir), "--backend", "ort_fp32_kv_cache", "--text", TEXT,
                     "--step", "1", "--json", str(out), "--threads", "2", "--max-new-tokens", "8"])
    assert rc == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert {"backend", "text", "step", "tolerance", "layers", "first_over_tolerance"} <= set(report)
    assert set(report["layers"][0]) >= {"module", "max_abs_diff", "rel_error", "op_types"}
    assert report["step"] == 1 and report["first_over_tolerance"] is None
    printed = capsys.readouterr().out
    assert "| decoder.layers.1.fc1 |" in printed and "no module over max |Δ| 0.0001" in printed
    assert bench_main(["locate", str(tiny_export_dir), "--backend", "ort_fp32_kv_cache", "--text", TEXT,
                       "--step", "first"]) == 2


def test_render_marks_the_first_module_over(tiny_backends, tiny_export_dir, reference_ids, tmp_path):
    from ui.locate_render import locate_figure, locate_html

    export = _perturbed_copy(tiny_export_dir, tmp_path, "decoder.onnx", "decoder.layers.1.fc1", 0.05)
    report = locate(_with_reference(tiny_backends, export, "ort_fp32_kv_cache"), "ort_fp32_kv_cache", TEXT, STEP,
                    reference_ids=reference_ids)
    fig = locate_figure(report)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    labels = ax.get_legend_handles_labels()[1]
    assert "tolerance 0.0001" in labels and "first over: decoder.layers.1.fc1" in labels
    page = locate_html(report)
    assert page.count('<tr class="first">') == 1 and "decoder.layers.1.fc1</td>" in page
    assert locate_figure({"backend": "x", "text": "", "error": "no"}) is None
    assert "locate-error" in locate_html({"backend": "x", "text": "", "error": "cannot map"})


def test_request_layer_import_stays_torch_free():
    code = "import sys, service.locate, ui.locate_render; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
