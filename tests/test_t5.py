"""The T5 family (families/t5.py, export/t5_wrappers.py): `t5-tiny` (original T5: ReLU, the output
layer tied to the embedding and rescaled), `madlad-tiny` (MADLAD-400's structure: gated-GELU,
d_kv apart from d_model / heads, an untied output layer, `<2xx>` target tokens before the source)
and `mt5-tiny` (mT5's class and model_type: gated-GELU, untied),
through the whole export and every backend, against transformers' own generate() fed by the HF
tokenizer itself (so the target token's placement is checked, not assumed).

Cost: four fixture builds (~15-40 CPU-s each) and four exports (~60-75 CPU-s each), cached across runs.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from backends import SessionConfig, load_backends, load_manifest
from conftest import REPO, TRAIN_TSV, cached, dev_sentences

pytestmark = pytest.mark.slow

FP32 = ("pytorch", "ort_fp32_single_step", "ort_fp32_kv_cache")
MAX_NEW = 30
FIXTURES = ("t5-tiny", "madlad-tiny", "mt5-tiny")


def _make(name: str, folder: Path) -> None:
    from export.fixtures import build
    from export.pipeline import ExportOptions, export

    model_dir = build(name, folder / "models" / name, corpus=TRAIN_TSV)
    export(str(model_dir), ExportOptions(out=folder / "exports" / name, threads=1), log=lambda *a, **k: None)


def _folders(name: str) -> tuple[Path, Path]:
    folder = cached(f"t5-family-{name}", functools.partial(_make, name))
    return folder / "models" / name, folder / "exports" / name


@pytest.fixture(scope="module", params=FIXTURES)
def t5_folders(request) -> tuple[Path, Path]:
    return _folders(request.param)


@pytest.fixture(scope="module")
def madlad() -> tuple[Path, Path]:
    return _folders("madlad-tiny")


def _generate(model_dir: Path, texts: list[str], prefix: str, **options) -> list[list[int]]:
    """transformers' generate() on the HF tokenizer's own ids for `prefix + text`."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    tokenizer = transformers.T5Tokenizer.from_pretrained(model_dir)
    architecture = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(model_dir).eval()
    batch = tokenizer([prefix + t for t in texts], padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**batch, do_sample=False, max_new_tokens=MAX_NEW, **options)
    eos = model.config.eos_token_id
    rows = []
    for row in out.tolist():
        ids = row[1:]  # the decoder start (pad) excluded, as our token_ids
        rows.append(ids[: ids.index(eos) + 1] if eos in ids else ids)
    return rows


def test_export_verifies_within_1e4_with_fused_attention(t5_folders):
    _, export_dir = t5_folders
    manifest = load_manifest(export_dir)
    v = manifest.data["verification"]
    assert v["fp32_passed"] and v["failures"] == []
    cases = {c["case"]: c for c in v["logits"]}
    assert any("padded batch" in name for name in cases) and any("450 tokens" in name for name in cases)
    for case in cases.values():
        for graph in ("full", "kv_cache"):
            assert case["max_abs_logit_diff"][graph] <= 1e-4, (case["case"], graph)
    for name in ("ort_fp32_single_step", "ort_fp32_kv_cache"):
        assert v["greedy"]["backends"][name]["identical_ids"] == v["greedy"]["sentences"] == 16, name
    # Unscaled attention (T5) fuses too: one MultiHeadAttention of scale 1 per attention, in every KV-cache graph.
    layers = {"encoder": manifest.data["model"]["encoder_layers"], "decoder": 2 * manifest.data["model"]["decoder_layers"]}
    for name in ("encoder", "decoder", "encoder_fp16", "decoder_fp16", "encoder_int8", "decoder_int8"):
        nodes = onnx.load(str(manifest.graph_path(name)), load_external_data=False).graph.node
        fused = [n for n in nodes if n.op_type == "MultiHeadAttention"]
        assert len(fused) == layers[name.split("_")[0]] and not any(n.op_type == "Softmax" for n in nodes), name
        assert all(onnx.helper.get_attribute_value(a) == 1.0 for n in fused for a in n.attribute if a.name == "scale")


def test_the_sidecar_records_t5s_shape_ids_and_languages(t5_folders):
    model_dir, export_dir = t5_folders
    m = load_manifest(export_dir)
    assert m.family == ("mt5" if export_dir.name == "mt5-tiny" else "t5")
    assert m.data["family"]["positions"] == "relative" and m.data["family"]["pre_norm"]
    # T5's ids: the decoder starts from pad 0, eos 1; MADLAD's: from 0 (unk), pad 1 (<s>), eos 2
    expected = (0, 1, 2) if export_dir.name.startswith("madlad") else (0, 0, 1)
    assert (m.special.decoder_start, m.special.pad, m.special.eos) == expected
    assert m.generation.forced_bos_token_id is None  # a target token goes before the source, nothing is forced
    model = m.data["model"]
    if export_dir.name == "t5-tiny":
        assert (model["activation_function"], model["output_scaled"], model["head_dim"]) == ("relu", True, 8)
        assert m.languages is None
    elif export_dir.name == "mt5-tiny":  # T5 v1.1's structure under its own class: untied, never rescaled
        assert (m.architecture, model["activation_function"], model["output_scaled"]) == (
            "MT5ForConditionalGeneration", "gated-gelu", False)
        assert m.languages is None
    else:
        assert (model["activation_function"], model["output_scaled"], model["head_dim"]) == ("gated-gelu", False, 16)
        assert m.languages["tgt_lang"] == "zh" and m.languages["src_lang"] is None
        assert set(m.languages["codes"]) == {"zh", "en", "de", "fr", "ja", "es"}


@pytest.mark.parametrize("mode", ["greedy", "beams"])
def test_fp32_backends_are_token_identical_to_generate(t5_folders, mode):
    model_dir, export_dir = t5_folders
    texts = dev_sentences(8)
    options = {"num_beams": 1} if mode == "greedy" else {"num_beams": 4}
    prefix = "<2zh> " if export_dir.name == "madlad-tiny" else ""
    expected = _generate(model_dir, texts, prefix, **options)
    backends = load_backends(export_dir, names=FP32, session=SessionConfig(threads=1))
    for name in FP32:
        got = [t.token_ids for t in backends[name].translate(texts, max_new_tokens=MAX_NEW, **options)]
        assert got == expected, f"{name} ({mode}) differs from generate()"


def test_low_precision_backends_translate(t5_folders):
    _, export_dir = t5_folders
    backends = load_backends(export_dir, names=("ort_fp16", "ort_int8"), session=SessionConfig(threads=1))
    for name, backend in backends.items():
        (result,) = backend.translate(["Click OK to save the document."], max_new_tokens=8)
        assert 1 <= len(result.token_ids) <= 8, name


def test_madlad_target_token_goes_before_the_source_and_can_be_overridden(madlad):
    model_dir, export_dir = madlad
    backends = load_backends(export_dir, names=("pytorch", "ort_fp32_kv_cache"), tgt_lang="de",
                             session=SessionConfig(threads=1))
    tok = backends["pytorch"].tokenizer
    ids = tok.encode(["Hello world."], 64).input_ids[0].tolist()
    assert tok.pieces(ids[:1]) == ["<2de>"] and ids[-1] == 2  # MADLAD's eos
    texts = dev_sentences(3)
    expected = _generate(model_dir, texts, "<2de> ", num_beams=1)
    assert expected != _generate(model_dir, texts, "<2zh> ", num_beams=1)  # the token changes the output
    for name, backend in backends.items():
        got = [t.token_ids for t in backend.translate(texts, max_new_tokens=MAX_NEW, num_beams=1)]
        assert got == expected, name


def test_unknown_target_languages_are_refused_with_the_known_ones(madlad, tmp_path, capsys):
    from export.pipeline import ExportOptions, export
    from export.source import SourceError

    model_dir, export_dir = madlad
    with pytest.raises(ValueError, match=r"unknown target language 'klingon'; the tokenizer knows: de, en, es, fr, ja, zh"):
        load_backends(export_dir, names=("ort_fp32_kv_cache",), tgt_lang="klingon")
    with pytest.raises(ValueError, match=r"reads the source language from the text itself; --src-lang does not apply"):
        load_backends(export_dir, names=("ort_fp32_kv_cache",), src_lang="en")
    with pytest.raises(SourceError, match=r"unknown target language 'klingon'; the tokenizer knows: de, en"):
        export(str(model_dir), ExportOptions(out=tmp_path / "x", tgt_lang="klingon", verify=False),
               log=lambda *a, **k: None)
    assert not (tmp_path / "x").exists()
    import app

    assert app.main(["--model", str(export_dir), "--tgt-lang", "klingon", "--backends", "ort_fp32_kv_cache"]) == 2
    assert "unknown target language 'klingon'; the tokenizer knows: de, en, es, fr, ja, zh" in capsys.readouterr().err


def test_a_t5_without_target_tokens_refuses_a_target_language(tmp_path):
    from export.pipeline import ExportOptions, export
    from export.source import SourceError

    model_dir, export_dir = _folders("t5-tiny")
    with pytest.raises(SourceError, match=r"no target-language tokens \(<2xx>\); --tgt-lang does not apply"):
        export(str(model_dir), ExportOptions(out=tmp_path / "x", tgt_lang="zh", verify=False), log=lambda *a, **k: None)
    with pytest.raises(ValueError, match="has no language codes"):
        load_backends(export_dir, names=("ort_fp32_kv_cache",), tgt_lang="zh")


def test_locate_names_t5_blocks(madlad):
    from service.locate import locate
    from service.locate_graph import module_order

    _, export_dir = madlad
    report = locate(export_dir, "ort_fp32_kv_cache", "Click OK to save the document.", 2, threads=1)
    manifest = load_manifest(export_dir)
    modules = [row["module"] for row in report["layers"]]
    assert modules == module_order(2, 2, manifest.data["family"]) and report["unmapped"] == []
    assert "decoder.block.1.layer.2.DenseReluDense" in modules and "decoder.block.0.layer.1.EncDecAttention.k" in modules
    assert report["first_over_tolerance"] is None and report["max_abs_dlogit"] <= 1e-4
    rows = {row["module"]: row for row in report["layers"]}
    assert "MultiHeadAttention" in rows["decoder.block.0.layer.1.EncDecAttention"]["op_types"]


def test_ort_path_imports_no_torch(madlad):
    _, export_dir = madlad
    code = (
        "import sys; from backends import load_backends; "
        f"b = load_backends({str(export_dir)!r}, names=('ort_fp32_single_step', 'ort_fp32_kv_cache', "
        "'ort_fp16', 'ort_int8')); "
        "[x.translate(['Hello world.'], max_new_tokens=4) for x in b.values()]; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("False"), out.stdout + out.stderr


def test_the_fp16_guard_keeps_t5s_overflowing_feed_forward_in_fp32():
    """`madlad-tiny-overflow`: the last decoder block's gated feed-forward peaks past fp16's range
    (its linear branch scaled up, `wo` down: fp32 decodes as before), T5's known overflow. The guard
    keeps exactly that block's nodes in fp32 and the fp16 backend stays identical to generate()."""
    model_dir, export_dir = _folders("madlad-tiny-overflow")
    manifest = load_manifest(export_dir)
    assert manifest.data["verification"]["passed"] and manifest.data["verification"]["fp16"]["nonfinite"] is None
    guard = manifest.data["fp16"]["guard"]
    largest = guard["largest"]["decoder"]
    assert largest["max_abs"] > 1e5 and largest["module"].startswith("block.1.layer.2.DenseReluDense")
    kept = {(k["module"], k["op"]) for k in guard["kept"]["decoder"]}
    assert ("block.1.layer.2.DenseReluDense.wi_1", "MatMul") in kept and ("block.1.layer.2.DenseReluDense.wo", "MatMul") in kept
    assert all(m.startswith("block.1.layer.2.DenseReluDense") for m, _ in kept) and guard["kept"]["encoder"] == []
    texts = dev_sentences(8)
    expected = _generate(model_dir, texts, "<2zh> ", num_beams=1)
    backend = load_backends(export_dir, names=("ort_fp16",), session=SessionConfig(threads=1))["ort_fp16"]
    assert [t.token_ids for t in backend.translate(texts, max_new_tokens=MAX_NEW, num_beams=1)] == expected
