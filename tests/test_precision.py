"""fp16 that finds and survives overflow (export/fp16_guard.py, export/ranges.py).

The overflow fixtures (families/overflow.py: one decoder layer's feed-forward block scaled so fc1
peaks at 2e5 while fp32 decodes as before) are exported with the guard, the default: it keeps
that block in fp32, the sidecar names it, and fp16 is token-identical to generate() greedy and at
beam 4. The same fixture with `--fp16-keep none` (the converter's own block list) computes Inf in
that block, and the export fails naming the node and module, its folder kept as `.rejected`.
A hand-made graph shows the converter's two traps the guard's conversion avoids.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backends import SessionConfig, load_backends, load_manifest
from backends.manifest import ManifestError
from conftest import TRAIN_TSV, cached, dev_sentences
from export.fp16_guard import FP16_MAX, Fp16Keep, nodes_to_keep
from export.ranges import graph_ranges
from test_families import MAX_NEW, Generate, _peak

OVERFLOW = ["tiny-overflow", "nllb-tiny-overflow"]


# --- the option and the conversion, on a hand-made graph ------------------------------------------------


def test_fp16_keep_parses_auto_none_and_op_types_and_names_the_choices():
    assert Fp16Keep.parse("auto") == Fp16Keep() and Fp16Keep().threshold == FP16_MAX / 8
    assert Fp16Keep.parse("none").mode == "none"
    assert Fp16Keep.parse("Pow, LayerNormalization").ops == ("Pow", "LayerNormalization")
    for bad in ("", "Bogus", "auto,Pow", "pow"):
        with pytest.raises(ValueError, match="expected one of: auto, none, OP,OP"):
            Fp16Keep.parse(bad)
    with pytest.raises(ValueError, match="margin"):
        Fp16Keep(margin=0.5)


def _scaled_ffn(path: Path, scale: float) -> dict[str, np.ndarray]:
    """y = relu(x·W1·s + b)·W2/s + b: fp32 gives x's function, fc1 peaks past fp16's range (W1·s
    stays below the converter's 1e4 clip for weights, as a trained model's do). The exporter's habit
    of merging equal constants is copied: both Adds read the one zero bias."""
    rng = np.random.default_rng(0)
    w1 = (np.abs(rng.normal(size=(4, 4))) + 0.5).astype(np.float32)  # positive: every fc1 output is large
    w2 = rng.normal(size=(4, 4)).astype(np.float32)
    inits = [numpy_helper.from_array(w1 * scale, "w1"), numpy_helper.from_array(w2 / scale, "w2"),
             numpy_helper.from_array(np.zeros(4, np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="fc1_bias"),
             helper.make_node("Relu", ["hb"], ["r"], name="act"),
             helper.make_node("MatMul", ["r", "w2"], ["o"], name="fc2"),
             helper.make_node("Add", ["o", "b"], ["y"], name="fc2_bias")]
    graph = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    x = np.full((1, 4), 10.0, np.float32)
    h = x @ (w1 * scale)
    return {"x": x, "h": h, "hb": h, "r": np.maximum(h, 0), "o": np.maximum(h, 0) @ (w2 / scale),
            "y": np.maximum(h, 0) @ (w2 / scale), "expected": np.maximum(x @ w1, 0) @ w2}


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_the_guard_keeps_the_overflowing_block_in_fp32_and_its_fp16_graph_stays_finite(tmp_path):
    from export.fp16 import convert_to_fp16

    values = _scaled_ffn(tmp_path / "ffn.onnx", 2e3)
    feeds = {"x": values["x"]}
    ranges = graph_ranges(tmp_path / "ffn.onnx", feeds)
    assert ranges.max_abs["h"] == pytest.approx(float(np.abs(values["h"]).max()), rel=1e-6) and ranges.max_abs["h"] > FP16_MAX
    assert ranges.first_nonfinite is None
    kept = nodes_to_keep(tmp_path / "ffn.onnx", ranges, Fp16Keep().threshold)
    # every node that writes or reads fc1's output; fc2's bias Add sees only small values
    assert [k["node"] for k in kept] == ["fc1", "fc1_bias", "act", "fc2"]
    np.testing.assert_allclose(_run(tmp_path / "ffn.onnx", values["x"]), values["expected"], rtol=1e-4)

    convert_to_fp16(tmp_path / "ffn.onnx", tmp_path / "plain.onnx")
    # The graph's own types overflow at fc1 (ORT's CPU kernels, computing fp16 ops in fp32 between
    # casts, can hide it; a provider with fp16 kernels cannot): the check names the node.
    plain = graph_ranges(tmp_path / "plain.onnx", feeds).first_nonfinite
    assert plain is not None and (plain["node"], plain["what"]) == ("fc1", "Inf"), plain
    report = convert_to_fp16(tmp_path / "ffn.onnx", tmp_path / "guarded.onnx", keep_nodes=[k["node"] for k in kept])
    # the shared zero bias: one copy per precision, or the fp16 Add would get an fp32 input
    assert report["initializers_copied_for_fp32_nodes"] == 1 and report["kept_fp32_nodes"] == 4
    assert graph_ranges(tmp_path / "guarded.onnx", feeds).first_nonfinite is None
    np.testing.assert_allclose(_run(tmp_path / "guarded.onnx", values["x"]), values["expected"], rtol=2e-3, atol=1e-3)


# --- the overflow fixtures, exported ----------------------------------------------------------------------


def _make_overflow(name: str, fp16_keep: str, folder: Path) -> None:
    """The fixture (models/NAME), peaked as test_families' so fp32's ties do not decide a token,
    and its export (exports/NAME) with `fp16_keep`; a failed export's message in failure.txt."""
    import transformers

    from export.fixtures import FIXTURES, build
    from export.pipeline import ExportOptions, VerificationFailed, export

    model_dir = build(name, folder / "models" / name, corpus=TRAIN_TSV)
    base = FIXTURES[FIXTURES[name].base]
    architecture = getattr(base, "architecture", "MarianMTModel")
    model = getattr(transformers, architecture).from_pretrained(model_dir).eval()
    _peak(model)
    model.save_pretrained(model_dir)
    try:
        export(str(model_dir), ExportOptions(out=folder / "exports" / name, threads=1,
                                             fp16_keep=Fp16Keep.parse(fp16_keep)), log=lambda *a, **k: None)
    except VerificationFailed as e:
        (folder / "failure.txt").write_text(str(e), encoding="utf-8")


@pytest.fixture(scope="module", params=OVERFLOW)
def guarded(request) -> tuple[str, Path, Path]:
    name = request.param
    folder = cached(f"overflow-{name}", functools.partial(_make_overflow, name, "auto"), _peak)
    return name, folder / "models" / name, folder / "exports" / name


@pytest.mark.slow
def test_the_guard_keeps_the_scaled_block_in_fp32_and_the_sidecar_names_it(guarded):
    name, model_dir, export_dir = guarded
    manifest = load_manifest(export_dir)
    assert manifest.data["verification"]["passed"] and manifest.data["verification"]["fp16"]["nonfinite"] is None
    guard = manifest.data["fp16"]["guard"]
    assert guard["mode"] == "auto" and guard["threshold"] == FP16_MAX / 8
    last = manifest.data["model"]["decoder_layers"] - 1
    largest = guard["largest"]["decoder"]
    assert largest["max_abs"] > 1e5 and largest["module"] == f"layers.{last}.fc1"
    kept = {(k["module"], k["op"]) for k in guard["kept"]["decoder"]}
    assert {(f"layers.{last}.fc1", "MatMul"), (f"layers.{last}.fc1", "Add"), (f"layers.{last}.fc2", "MatMul")} <= kept
    assert all(m.startswith(f"layers.{last}.") for m, _ in kept)  # nothing else comes near the range
    assert guard["kept"]["encoder"] == []
    fp16_backend = load_backends(export_dir, names=("ort_fp16",), session=SessionConfig(threads=1))["ort_fp16"]
    assert fp16_backend.info["kept_in_float"].startswith(f"overflow guard: {len(guard['kept']['decoder'])} node(s) in fp32")


def _fp16_vs_generate(model_dir: Path, export_dir: Path, texts: list[str], options: dict) -> tuple[list, list, list]:
    backends = load_backends(export_dir, names=("pytorch", "ort_fp32_kv_cache", "ort_fp16"),
                             session=SessionConfig(threads=1))
    greedy = options["num_beams"] == 1
    expected = Generate(model_dir, backends["pytorch"])(texts, greedy=greedy, **({} if greedy else options))
    got = {n: [t.token_ids for t in backends[n].translate(texts, max_new_tokens=MAX_NEW, **options)]
           for n in ("ort_fp32_kv_cache", "ort_fp16")}
    return expected, got["ort_fp32_kv_cache"], got["ort_fp16"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["greedy", "beam 4"])
def test_guarded_fp16_is_token_identical_to_generate(guarded, mode):
    """Greedy: identical on both fixtures. Beam 4 on the NLLB fixture, whose random beams nearly tie:
    fp16 of the very same weights without the scaling already differs from generate() on a few
    sentences, so the guarded fp16 must agree on at least as many as that (the overflow costs nothing)."""
    name, model_dir, export_dir = guarded
    texts = dev_sentences(24)
    options = {"num_beams": 1 if mode == "greedy" else 4}
    expected, fp32, fp16 = _fp16_vs_generate(model_dir, export_dir, texts, options)
    assert fp32 == expected, f"{name}: ort_fp32_kv_cache ({mode}) differs from generate()"
    if mode == "greedy" or name == "tiny-overflow":
        assert fp16 == expected, f"{name}: ort_fp16 ({mode}) differs from generate()"
        return
    from test_families import _make_family

    plain = cached("family-nllb-tiny", functools.partial(_make_family, "nllb-tiny"), _peak)
    p_expected, _, p_fp16 = _fp16_vs_generate(plain / "models" / "nllb-tiny", plain / "exports" / "nllb-tiny", texts,
                                              options)
    same = sum(a == b for a, b in zip(fp16, expected))
    assert same >= sum(a == b for a, b in zip(p_fp16, p_expected)) and same >= len(texts) - 3, same


@pytest.mark.slow
def test_unguarded_fp16_overflows_and_the_export_fails_naming_the_node(tmp_path):
    name = "tiny-overflow"
    folder = cached(f"overflow-{name}-none", functools.partial(_make_overflow, name, "none"), _peak)
    failure = (folder / "failure.txt").read_text(encoding="utf-8")
    assert not (folder / "exports" / name).exists()
    assert "ort_fp16: decoder_fp16.onnx computes" in failure and "module layers.1.fc1" in failure, failure
    assert "--fp16-keep auto keeps overflowing nodes in fp32" in failure
    rejected = folder / "exports" / f"{name}.rejected"
    data = json.loads((rejected / "manifest.json").read_text(encoding="utf-8"))
    assert data["verification"]["fp32_passed"] and not data["verification"]["passed"]
    assert data["fp16"]["guard"]["mode"] == "none"
    with pytest.raises(ManifestError, match="failed its verification"):
        load_manifest(rejected)


def test_fp16_weights_copy_rounds_only_the_chosen_weights_and_still_loads(tiny_export_dir, tmp_path):
    """`bench fp16-weights`: the copy's chosen fp32 weights are their nearest fp16 values (stored as
    float32), the others and every other graph are the original's bytes, and the sidecar's hashes
    let the copy load and translate."""
    from bench.fp16_weights import round_to_fp16, round_weights

    big = np.array([1.0001, -3.14159, 70000.0, -1e9, 1e-8], dtype=np.float32)
    rounded = round_to_fp16(big)
    assert rounded[0] == np.float32(np.float16(1.0001)) != big[0]  # fp16's precision, as float32
    assert list(rounded[2:4]) == [70000.0, -1e9]  # outside fp16's range: left as they are
    assert rounded.dtype == np.float32

    out = tmp_path / "encoder-rounded"
    counts = round_weights(tiny_export_dir, out, "encoder")
    source, copy = load_manifest(tiny_export_dir), load_manifest(out)
    enc, dec = source.graph("encoder")["file"], source.graph("decoder")["file"]
    assert counts[enc] > 0 and counts[dec] == 0
    assert (out / dec).read_bytes() == (tiny_export_dir / dec).read_bytes()
    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(tiny_export_dir / enc).graph.initializer
              if t.data_type == TensorProto.FLOAT}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(out / enc).graph.initializer
             if t.data_type == TensorProto.FLOAT}
    assert before.keys() == after.keys()
    changed = 0
    for name, values in before.items():
        np.testing.assert_array_equal(after[name], round_to_fp16(values))
        changed += int((after[name] != values).sum())
    assert changed > 0  # random weights are not fp16 values already
    copy.verify_graph("encoder")  # the sidecar records the new file
    backend = load_backends(out, names=("ort_fp32_kv_cache",), session=SessionConfig(threads=1))["ort_fp32_kv_cache"]
    assert backend.translate(["Open the file."], num_beams=1, max_new_tokens=4)[0].token_ids

    with pytest.raises(ValueError, match="exists"):
        round_weights(tiny_export_dir, out, "all")
    with pytest.raises(ValueError, match="expected one of: all, encoder, decoder"):
        round_weights(tiny_export_dir, tmp_path / "other", "middle")
