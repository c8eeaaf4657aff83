"""Model families beyond Marian (issue 15): M2M100/NLLB-200 and mBART-50, through the whole export
and every backend, against transformers' own generate().

Fixtures are built here from the corpus (`export.fixtures`: random weights, a sentencepiece model
trained on data/, the family's language codes and transformers 5 tokenizer class), then *peaked*:
random tiny weights give every token nearly the same log-prob, so generate()'s float32 sums tie and
`torch.topk` breaks ties its own way, and every hypothesis runs to the length cap. A spread of
per-token offsets with eos just below the best token (as tests/test_beam.py's `peaked`) makes the
search, not tie-breaking, decide: mBART through its `final_logits_bias`; NLLB, which has no
logits bias, through the decoder's final LayerNorm (its bias β, through the tied output layer W,
adds W β to every step's logits).
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from backends import SessionConfig, load_backends, load_manifest, memory_needs
from backends.manifest import ManifestError
from conftest import REPO, TRAIN_TSV, cached, dev_sentences

FP32 = ("pytorch", "ort_fp32_single_step", "ort_fp32_kv_cache")
MAX_NEW = 40
# (fixture, family, tokenizer class, source code, target code)
CASES = {
    "nllb-tiny": ("m2m_100", "NllbTokenizer", "eng_Latn", "zho_Hans"),
    "mbart50-tiny": ("mbart", "MBart50Tokenizer", "en_XX", "zh_CN"),
}


def _peak(model) -> None:
    """Spread the logits (std ~3) with eos 0.3 below the best token; see the module docstring."""
    import torch

    generator = torch.Generator().manual_seed(0)
    eos = model.config.eos_token_id
    with torch.no_grad():
        if hasattr(model, "final_logits_bias"):
            bias = torch.randn(model.final_logits_bias.shape, generator=generator) * 3  # (1, V)
            bias[0, eos] = bias.max() - 0.3
            model.final_logits_bias.copy_(bias)
            return
        norm = model.model.decoder.layer_norm
        w = model.lm_head.weight.double()  # (V, d), tied to the embedding
        beta = torch.randn(w.shape[1], generator=generator, dtype=torch.float64)
        beta *= 3 / float((w @ beta).std())
        others = torch.ones(w.shape[0], dtype=torch.bool)
        others[eos] = False
        for _ in range(50):  # lift eos along its own row until it sits 0.3 below the best other token
            logits = w @ beta
            gap = float(logits[others].max() - 0.3 - logits[eos])
            if abs(gap) < 1e-6:
                break
            beta += gap / float(w[eos] @ w[eos]) * w[eos]
        norm.bias.copy_(beta.float())
        norm.weight.mul_(10.0)  # keep the input's share of the logits visible next to the offsets


def _make_family(name: str, folder: Path) -> None:
    """The peaked fixture (models/NAME) and its verified export (exports/NAME)."""
    import transformers

    from export.fixtures import FIXTURES, build
    from export.pipeline import ExportOptions, export

    model_dir = build(name, folder / "models" / name, corpus=TRAIN_TSV)
    model = getattr(transformers, FIXTURES[name].architecture).from_pretrained(model_dir).eval()
    _peak(model)
    model.save_pretrained(model_dir)
    export(str(model_dir), ExportOptions(out=folder / "exports" / name, threads=1), log=lambda *a, **k: None)


@pytest.fixture(scope="module", params=list(CASES))
def family_folders(request) -> tuple[Path, Path]:
    """(model, export) of one family, built once (conftest's cache)."""
    name = request.param
    folder = cached(f"family-{name}", functools.partial(_make_family, name), _peak)
    return folder / "models" / name, folder / "exports" / name


@pytest.fixture(scope="module")
def family_model_dir(family_folders) -> Path:
    return family_folders[0]


@pytest.fixture(scope="module")
def family_export_dir(family_folders) -> Path:
    return family_folders[1]


@pytest.fixture(scope="module")
def family_backends(family_export_dir):
    return load_backends(family_export_dir, session=SessionConfig(threads=1))


class Generate:
    """transformers' generate() on the fixture, with our tokenizer's exact input ids and the
    sidecar's forced first token (the target language's code)."""

    def __init__(self, model_dir: Path, backend):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(1)
        manifest = backend.manifest
        self.model = getattr(transformers, manifest.architecture).from_pretrained(model_dir).eval()
        self.backend = backend
        self.eos = manifest.special.eos

    def __call__(self, texts: list[str], greedy: bool, **options) -> list[list[int]]:
        import torch

        manifest = self.backend.manifest
        batch = self.backend.tokenizer.encode(texts, manifest.max_source_tokens)
        extra = {"num_beams": 1, "forced_eos_token_id": None} if greedy else {}
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=torch.from_numpy(batch.input_ids),
                attention_mask=torch.from_numpy(batch.attention_mask),
                do_sample=False,
                forced_bos_token_id=manifest.generation.forced_bos_token_id,
                max_new_tokens=MAX_NEW,
                **extra,
                **options,
            )
        rows = []
        for row in out.tolist():
            ids = row[1:]  # the decoder start excluded, as our token_ids
            rows.append(ids[: ids.index(self.eos) + 1] if self.eos in ids else ids)
        return rows


@pytest.fixture(scope="module")
def generate(family_model_dir, family_backends):
    return Generate(family_model_dir, family_backends["pytorch"])


# --- the export and its sidecar --------------------------------------------------------------------


def test_export_verifies_every_fp32_graph_within_1e4(family_export_dir):
    v = load_manifest(family_export_dir).data["verification"]
    assert v["fp32_passed"] and v["failures"] == []
    cases = {c["case"]: c for c in v["logits"]}
    assert any("padded batch" in name for name in cases) and any("450 tokens" in name for name in cases)
    for case in cases.values():
        for graph in ("full", "kv_cache"):
            assert case["max_abs_logit_diff"][graph] <= 1e-4, (case["case"], graph)
    for label in ("greedy", "model_decoding"):
        for name in ("ort_fp32_single_step", "ort_fp32_kv_cache"):
            r = v[label]["backends"][name]
            assert r["identical_ids"] == v[label]["sentences"] == 16, (label, name)
    # ...with each family's attention cores fused (export/attention.fuse_attention), in every KV-cache graph.
    manifest = load_manifest(family_export_dir)
    layers = {"encoder": manifest.data["model"]["encoder_layers"], "decoder": 2 * manifest.data["model"]["decoder_layers"]}
    for name in ("encoder", "decoder", "encoder_fp16", "decoder_fp16", "encoder_int8", "decoder_int8"):
        ops = [n.op_type for n in onnx.load(str(manifest.graph_path(name)), load_external_data=False).graph.node]
        assert ops.count("MultiHeadAttention") == layers[name.split("_")[0]] and "Softmax" not in ops, name


def test_the_sidecar_records_family_tokenizer_languages_and_forced_bos(family_export_dir, family_backends):
    family, tokenizer_class, src, tgt = CASES[family_export_dir.name]
    m = load_manifest(family_export_dir)
    assert m.family == family and m.data["family"]["pre_norm"] is True
    assert m.tokenizer_class == tokenizer_class and "tokenizer.json" in m.tokenizer_files
    assert (m.languages["src_lang"], m.languages["tgt_lang"]) == (src, tgt)
    tok = family_backends["pytorch"].tokenizer._tok
    assert m.generation.forced_bos_token_id == m.languages["codes"][tgt] == tok.convert_tokens_to_ids(tgt)
    assert (m.special.decoder_start, m.special.eos, m.special.pad) == (2, 2, 1)
    beams = {"m2m_100": 4, "mbart": 5}[family]  # the fixture's generation config (mBART-50's own: 5)
    assert m.generation.num_beams == beams
    if family == "mbart":
        assert m.generation.early_stopping is True and m.generation.forced_eos_token_id == 2
    # the source starts with its language code, ends with eos
    ids = family_backends["ort_fp32_kv_cache"].tokenizer.encode(["Hello world."], 64).input_ids[0].tolist()
    assert ids[0] == tok.convert_tokens_to_ids(src) and ids[-1] == 2
    # A batch is tokenized in one call: each row as the text alone would be
    texts = ["Hello world.", "Mixed 中文 and English 🙂", "!!!", "A much longer sentence, with commas; and more."]
    batch = family_backends["ort_fp32_kv_cache"].tokenizer.encode(texts, 64)
    for row, length, text in zip(batch.input_ids.tolist(), batch.lengths, texts):
        assert row[:length] == tok(text).input_ids and set(row[length:]) <= {m.special.pad}, text


# --- every fp32 backend against generate() ---------------------------------------------------------


@pytest.mark.parametrize("mode", ["greedy", "beams"])
def test_fp32_backends_are_token_identical_to_generate(family_backends, generate, mode):
    texts = dev_sentences(10)
    greedy = mode == "greedy"
    expected = generate(texts, greedy=greedy)
    forced = family_backends["pytorch"].manifest.generation.forced_bos_token_id
    assert all(ids[0] == forced for ids in expected)
    if not greedy:  # eos is a candidate at every step, so beams finish (greedy takes the best token)
        assert min(len(ids) for ids in expected) < MAX_NEW, "every hypothesis ran to the cap: not peaked"
    for name in FP32:
        options = {"num_beams": 1} if greedy else {}
        got = [t.token_ids for t in family_backends[name].translate(texts, max_new_tokens=MAX_NEW, **options)]
        assert got == expected, f"{name} ({mode}) differs from generate()"


def test_a_target_language_override_forces_its_code(family_export_dir, family_model_dir):
    family, _, src, _ = CASES[family_export_dir.name]
    other = {"m2m_100": "fra_Latn", "mbart": "fr_XX"}[family]
    backends = load_backends(family_export_dir, names=("pytorch", "ort_fp32_kv_cache"), tgt_lang=other,
                             session=SessionConfig(threads=1))
    forced = backends["pytorch"].manifest.generation.forced_bos_token_id
    assert forced == backends["pytorch"].tokenizer._tok.convert_tokens_to_ids(other)
    texts = dev_sentences(3)
    expected = Generate(family_model_dir, backends["pytorch"])(texts, greedy=True)
    for name, backend in backends.items():
        got = [t.token_ids for t in backend.translate(texts, max_new_tokens=MAX_NEW, num_beams=1)]
        assert got == expected and all(ids[0] == forced for ids in got), name


def test_unknown_language_codes_are_refused_with_the_known_ones(family_export_dir, family_model_dir, tmp_path, capsys):
    from export.pipeline import ExportOptions, export
    from export.source import SourceError

    family, _, src, tgt = CASES[family_export_dir.name]
    with pytest.raises(ValueError, match=rf"unknown target language 'klingon'; the tokenizer knows: .*{tgt}"):
        load_backends(family_export_dir, names=("ort_fp32_kv_cache",), tgt_lang="klingon")
    with pytest.raises(ValueError, match=rf"unknown source language 'xx'.*{src}"):
        load_backends(family_export_dir, names=("ort_fp32_kv_cache",), src_lang="xx")
    with pytest.raises(SourceError, match=rf"unknown target language 'klingon'; the tokenizer knows: .*{tgt}"):
        export(str(family_model_dir), ExportOptions(out=tmp_path / "x", tgt_lang="klingon", verify=False),
               log=lambda *a, **k: None)
    assert not (tmp_path / "x").exists()
    from export.__main__ import main as export_main  # the CLI's --tgt-lang, as the README shows it

    assert export_main([str(family_model_dir), "--out", str(tmp_path / "y"), "--no-verify", "--tgt-lang", "klingon"]) == 2
    assert "unknown target language 'klingon'; the tokenizer knows: " in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_app_refuses_an_unknown_language_code(family_export_dir, capsys):
    import app

    code = app.main(["--model", str(family_export_dir), "--tgt-lang", "klingon", "--backends", "ort_fp32_kv_cache"])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown target language 'klingon'" in err and CASES[family_export_dir.name][3] in err


def test_ort_path_imports_no_torch(family_export_dir):
    code = (
        "import sys; from backends import load_backends; "
        f"b = load_backends({str(family_export_dir)!r}, names=('ort_fp32_single_step', 'ort_fp32_kv_cache', "
        "'ort_fp16', 'ort_int8')); "
        "[x.translate(['Hello world.'], max_new_tokens=4) for x in b.values()]; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_memory_needs_per_backend(family_export_dir):
    needs = memory_needs(family_export_dir)
    manifest = load_manifest(family_export_dir)
    files = manifest.data["files"]
    assert needs["ort_fp32_kv_cache"] == files["encoder.onnx"]["bytes"] + files["decoder.onnx"]["bytes"]
    assert 0 < needs["ort_int8"] < needs["ort_fp32_kv_cache"]
    assert needs["pytorch"] > 0
    # fp16 on the CPU: the files, plus the fp32 copy ORT makes of each fp16 weight at load.
    fp16_files = files["encoder_fp16.onnx"]["bytes"] + files["decoder_fp16.onnx"]["bytes"]
    halves = sum(manifest.graph(g)["initializer_bytes"]["float16"] for g in ("encoder_fp16", "decoder_fp16"))
    widened = sum(manifest.graph(g)["fp16_bytes_widened_on_cpu"] for g in ("encoder_fp16", "decoder_fp16"))
    assert 0.5 * fp16_files < halves < fp16_files  # the rest is the graph itself, large beside tiny weights
    assert 0.5 * halves < widened < halves  # the encoder's table is only gathered
    assert manifest.graph("decoder")["fp16_bytes_widened_on_cpu"] == 0
    # fp16 originals read only by widening kernels are dropped once their fp32 copy exists; a tied
    # output layer reads its own copy of the table, which the embedding gathers (export format v8).
    replaced = sum(manifest.graph(g)["fp16_bytes_replaced_on_cpu"] for g in ("encoder_fp16", "decoder_fp16"))
    assert 0 < replaced <= widened
    assert needs["ort_fp16"] == fp16_files + 2 * widened - replaced
    assert memory_needs(family_export_dir, ("ort_fp16",), cpu=False)["ort_fp16"] == fp16_files


def test_the_app_refuses_backends_that_would_not_fit_naming_each_need(family_export_dir, monkeypatch):
    """The fp16 backend's widened weights count: a machine with room for its files alone, but not
    for their fp32 copies, is refused with every figure."""
    import app

    needs = memory_needs(family_export_dir, ("pytorch", "ort_fp16"))
    manifest = load_manifest(family_export_dir)
    fp16_files = sum(manifest.data["files"][f"{g}.onnx"]["bytes"] for g in ("encoder_fp16", "decoder_fp16"))
    monkeypatch.setattr(app, "available_memory", lambda: needs["pytorch"] + fp16_files + 1)
    refusal = app.check_memory(family_export_dir, ("pytorch", "ort_fp16"), log=lambda *a, **k: None)
    assert refusal and f"ort_fp16 {needs['ort_fp16'] / 1e9:.2f} GB" in refusal and "--backends" in refusal
    monkeypatch.setattr(app, "available_memory", lambda: sum(needs.values()) + 1)
    assert app.check_memory(family_export_dir, ("pytorch", "ort_fp16"), log=lambda *a, **k: None) is None


# --- bad sources, refused at export ---------------------------------------------------------------


def test_a_tokenizer_that_does_not_match_the_vocabulary_is_refused(tmp_path):
    import transformers

    from export.fixtures import build
    from export.pipeline import ExportOptions, export
    from export.source import SourceError

    folder = build("nllb-tiny", tmp_path / "m", corpus=TRAIN_TSV)
    config = json.loads((folder / "config.json").read_text())
    n = config["vocab_size"]
    config.update(vocab_size=n - 10, pad_token_id=0)
    model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**config))
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    with pytest.raises(SourceError) as e:
        export(str(folder), ExportOptions(out=tmp_path / "x", verify=False), log=lambda *a, **k: None)
    message = str(e.value)
    assert f"the tokenizer has {n} ids but the model's vocabulary (embedding) has {n - 10}" in message
    assert "pad id: tokenizer 1, model config 0" in message


def test_unsupported_architectures_list_every_supported_family(tmp_path):
    from export.source import SourceError, check_local_folder

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "fsmt", "architectures": ["FSMTForConditionalGeneration"]}))
    with pytest.raises(SourceError) as e:
        check_local_folder(tmp_path)
    for name in ("MarianMTModel", "M2M100ForConditionalGeneration", "MBartForConditionalGeneration",
                 "T5ForConditionalGeneration"):
        assert name in str(e.value)


# --- external data ----------------------------------------------------------------------------------


def _make_external(folder: Path) -> None:
    from export.fixtures import build
    from export.pipeline import ExportOptions, export

    model = build("nllb-tiny", folder / "models" / "nllb-ext", corpus=TRAIN_TSV)
    out = folder / "exports" / "nllb-ext"
    export(str(model), ExportOptions(out=out, threads=1, external_data=True), log=lambda *a, **k: None)
    # The same model with its weights inside the graphs: every step done in memory, to compare with.
    export(str(model), ExportOptions(out=folder / "exports" / "nllb-inline", threads=1, external_data=False,
                                     verify=False), log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def external_export_dir() -> Path:
    """nllb-tiny exported with every graph's weights in external data files, as a model over 2 GB is
    (built once: conftest's cache)."""
    return cached("nllb-external", _make_external) / "exports" / "nllb-ext"


def test_external_data_is_written_checksummed_and_loaded(external_export_dir):
    m = load_manifest(external_export_dir)
    assert m.data["verification"]["fp32_passed"]
    for name, entry in m.data["graphs"].items():
        assert entry["external_data"] == [entry["file"] + ".data"], name  # fp16 and int8 rewrites keep it
        data = external_export_dir / entry["external_data"][0]
        assert data.stat().st_size > 0 and m.data["files"][data.name]["bytes"] == data.stat().st_size
    backends = load_backends(external_export_dir, session=SessionConfig(threads=1))
    ids = {n: b.translate(dev_sentences(2), max_new_tokens=8, num_beams=1)[0].token_ids for n, b in backends.items()}
    assert ids["ort_fp32_kv_cache"] == ids["ort_fp32_single_step"] == ids["pytorch"]


def test_weights_rewritten_on_disk_equal_those_rewritten_in_memory(external_export_dir):
    """With external data every step rewrites, converts (fp16) and copies weights file to file
    (export/onnx_io.py); inline, in memory. Every graph's nodes and every weight's bits are the same."""
    import numpy as np
    from onnx import numpy_helper

    inline = external_export_dir.parent / "nllb-inline"
    for name in ("full", "encoder", "decoder", "encoder_fp16", "decoder_fp16", "encoder_int8", "decoder_int8"):
        streamed, whole = (onnx.load(str(folder / f"{name}.onnx")) for folder in (external_export_dir, inline))
        assert [n.SerializeToString() for n in streamed.graph.node] == [n.SerializeToString() for n in whole.graph.node], name
        a, b = ({t.name: numpy_helper.to_array(t) for t in m.graph.initializer} for m in (streamed, whole))
        assert list(a) == list(b), name
        for key in a:
            assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), (name, key)
        assert any(t.data_location == onnx.TensorProto.EXTERNAL
                   for t in onnx.load(str(external_export_dir / f"{name}.onnx"), load_external_data=False).graph.initializer)


def _graph_bits(model: onnx.ModelProto, folder: Path) -> tuple[list[bytes], dict[str, bytes]]:
    from export.onnx_io import read_array

    return ([n.SerializeToString() for n in model.graph.node],
            {t.name: read_array(t, folder).tobytes() + str(t.data_type).encode() for t in model.graph.initializer})


def test_int8_reads_weights_one_at_a_time_and_gives_ort_quantize_dynamic_numbers(external_export_dir, tmp_path):
    """export/quantize.py runs ORT's quantizer on the graph's structure, each weight read from the
    data file when it is quantized: the nodes and every weight's bits are those of ORT's own
    quantize_dynamic (which loads the whole graph), a kept MatMul's weight is never read, and the
    re-scored output layer's table, written through a scratch file, equals the in-memory one."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from export import quantize
    from export.int8_rescore import output_layer

    src = external_export_dir / "decoder.onnx"
    structure = onnx.load(str(src), load_external_data=False)
    head = output_layer(structure).name
    kept = next(i for i in quantize.quantizable("decoder", structure) if i.op == "MatMul" and i.node != head)
    reference = tmp_path / "ref" / "decoder_int8.onnx"
    reference.parent.mkdir()
    quantize_dynamic(model_input=str(src), model_output=str(reference), op_types_to_quantize=quantize.OPS_TO_QUANTIZE,
                     per_channel=True, reduce_range=True, weight_type=QuantType.QInt8, nodes_to_exclude=[kept.node],
                     extra_options={"MatMulConstBOnly": True}, use_external_data_format=True)
    ours = quantize._quantize_dynamic(src, [kept.node])
    assert _graph_bits(ours, src.parent) == _graph_bits(onnx.load(str(reference)), reference.parent)
    weights = {t.name: t for t in ours.graph.initializer}
    assert weights[kept.weight].data_location == onnx.TensorProto.EXTERNAL and not weights[kept.weight].raw_data
    assert any(t.data_type == onnx.TensorProto.INT8 for t in weights.values())

    inline = external_export_dir.parent / "nllb-inline"
    made = {}
    for name, folder in (("streamed", external_export_dir), ("inline", inline)):
        made[name] = tmp_path / name / "decoder_int8.onnx"
        made[name].parent.mkdir()
        quantize.quantize_int8(folder / "decoder.onnx", made[name], keep={kept.node}, rescore=4)
    assert _graph_bits(onnx.load(str(made["streamed"]), load_external_data=False), made["streamed"].parent) \
        == _graph_bits(onnx.load(str(made["inline"])), made["inline"].parent)
    assert not list(external_export_dir.glob(".scratch-*"))


def test_tampered_external_data_is_refused(external_export_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(external_export_dir, copy)
    data = copy / "decoder.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of one weight
    data.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=r"decoder\.onnx\.data was modified after export"):
        load_backends(copy, names=("ort_fp32_kv_cache",))
    # the other backends' files are intact: they still load
    assert load_backends(copy, names=("ort_int8",))["ort_int8"].translate(["Hi."], max_new_tokens=2)


def test_stored_generate_options_are_the_families_own():
    """What the fixtures copy from the published generation configs stays what the sidecar reads."""
    from export.fixtures import FIXTURES

    assert FIXTURES["mbart50-tiny"].generation == {
        "max_length": 200, "num_beams": 5, "early_stopping": True, "forced_eos_token_id": 2}
    shape = FIXTURES["nllb-600m-random"].config
    assert (shape["d_model"], shape["encoder_layers"], shape["decoder_layers"], shape["vocab_size"],
            shape["encoder_ffn_dim"], shape["encoder_attention_heads"]) == (1024, 12, 12, 256206, 4096, 16)


def test_each_export_step_records_its_own_peak_rss():
    """The step runner resets the peak RSS at each step's start: a step's figure is its own high-water
    mark, not the run's so far (the sidecar's export_peak_rss_mb, next to export_seconds)."""
    from export.pipeline import _Steps

    steps = _Steps(3, log=lambda *a, **k: None)
    steps.run("small", lambda: None)

    def big():
        block = bytearray(256 * 2**20)
        block[:: 4096] = b"x" * len(block[:: 4096])  # touch every page
        return len(block)

    steps.run("big", big)
    steps.run("after", lambda: None)
    peak = steps.peak_rss_mb
    assert list(peak) == list(steps.durations) == ["small", "big", "after"]
    assert peak["big"] - peak["small"] > 200 and peak["after"] < peak["big"] - 200, peak
    assert steps.start_rss_mb["after"] < peak["big"] - 200  # the block was freed and handed back


def test_phase_peaks_attribute_each_sample_to_the_phases_open_then():
    """Verification's per-engine figures: a phase that held 256 MiB reads that much above its
    neighbours, the enclosing phase sees it too, and the step's own VmHWM is not reset by it."""
    import time

    from runtime.memory import PhasePeaks, peak_rss_mb

    with PhasePeaks(interval=0.005) as peaks:
        with peaks.phase("outer"):
            with peaks.phase("small"):
                time.sleep(0.05)
            with peaks.phase("big"):
                block = bytearray(256 * 2**20)
                block[:: 4096] = b"x" * len(block[:: 4096])  # touch every page
                time.sleep(0.05)
                del block
            with peaks.phase("after"):
                time.sleep(0.05)
    p = peaks.rounded()
    assert list(p) == ["outer", "small", "big", "after"], p
    assert p["big"] - p["small"] > 200 and p["big"] - p["after"] > 200 and p["outer"] >= p["big"], p
    assert peak_rss_mb() >= p["big"] - 5  # sampling never resets the high-water mark


def test_the_sidecar_records_each_steps_peak_rss(external_export_dir):
    data = load_manifest(external_export_dir).data
    assert set(data["export_peak_rss_mb"]) == set(data["export_start_rss_mb"]) == set(data["export_seconds"])
    assert all(mb > 0 for mb in data["export_peak_rss_mb"].values()), data["export_peak_rss_mb"]
    # The kernel syncs per-thread RSS counters lazily (and reclaims mmapped weight pages under memory
    # pressure without raising the high-water mark), so a step's start can read a few MB above its peak.
    starts = data["export_start_rss_mb"]
    assert all(starts[k] <= mb + 64 for k, mb in data["export_peak_rss_mb"].items()), (starts, data["export_peak_rss_mb"])


# --- locate: which module drifted ----------------------------------------------------------------------

LOCATE_TEXT = "Click OK to save the document."


@pytest.mark.parametrize("name", ["ort_fp32_kv_cache", "ort_fp32_single_step"])
def test_locate_reports_every_module_of_the_family_in_execution_order(family_export_dir, family_backends, name):
    """Locate on NLLB and mBART exports: the family's modules (pre-norm order, final and embedding
    norms), all mapped, none over 1e-4; without the PyTorch backend loaded, the source is loaded
    with the sidecar's class (not MarianMTModel)."""
    from service.locate import locate, module_order

    m = load_manifest(family_export_dir)
    ids = family_backends["pytorch"].translate([LOCATE_TEXT], max_new_tokens=8, num_beams=1)[0].token_ids
    report = locate({name: family_backends[name]}, name, LOCATE_TEXT, 2, reference_ids=ids)
    facts = m.data["model"]
    modules = module_order(facts["encoder_layers"], facts["decoder_layers"], m.data["family"])
    assert [row["module"] for row in report["layers"]] == modules and report["unmapped"] == []
    assert modules.index("decoder.layers.0.self_attn_layer_norm") < modules.index("decoder.layers.0.self_attn")
    assert "decoder.layer_norm" in modules and ("encoder.layernorm_embedding" in modules) == (
        m.architecture == "MBartForConditionalGeneration")
    assert report["first_over_tolerance"] is None, report["summary"]
    assert report["max_abs_dlogit"] <= 1e-4


@pytest.mark.parametrize("graph_file, module", [
    ("decoder.onnx", "decoder.layers.1.fc1"),
    ("decoder.onnx", "decoder.layers.0.self_attn.v_proj"),
    ("encoder.onnx", "encoder.layers.1.fc2"),
])
def test_locate_maps_a_perturbed_bias_to_its_module(family_export_dir, family_backends, tmp_path, graph_file, module):
    from service.locate import locate
    from test_locate import _perturbed_copy

    name = "ort_fp32_kv_cache"
    export = _perturbed_copy(family_export_dir, tmp_path, graph_file, module, 0.5)
    loaded = {"pytorch": family_backends["pytorch"], **load_backends(export, (name,), SessionConfig(threads=1))}
    ids = family_backends["pytorch"].translate([LOCATE_TEXT], max_new_tokens=8, num_beams=1)[0].token_ids
    report = locate(loaded, name, LOCATE_TEXT, 2, reference_ids=ids)
    assert report["first_over_tolerance"] is not None, report["summary"]
    assert report["first_over_tolerance"]["module"] == module, report["summary"]


def test_the_ray_engine_ships_the_familys_tokenizer_files_and_external_data(external_export_dir, tmp_path):
    """bench/engine/model_files: an NLLB export ships whole (its tokenizer.json, not Marian's spm
    files; every graph's external data), and the node's copy loads and translates."""
    from bench.engine.model_files import digests, materialize, shipment_files

    m = load_manifest(external_export_dir)
    files = shipment_files(external_export_dir, ["ort_fp32_kv_cache", "ort_int8"])
    shipped = {name.split("/", 1)[1] for name in files}
    assert set(m.tokenizer_files) <= shipped and "tokenizer.json" in shipped and "source.spm" not in shipped
    for graph in ("encoder", "decoder", "encoder_int8", "decoder_int8"):
        entry = m.graph(graph)
        assert {entry["file"], *entry["external_data"]} <= shipped and entry["external_data"], graph
    assert all(path.is_file() for path in files.values())
    copy, info = materialize(tmp_path / "cache", digests(files), lambda name: files[name].read_bytes())
    assert info["written_here"] and info["checked"] == len(files)
    [t] = load_backends(copy, ("ort_int8",))["ort_int8"].translate(["Hello."], max_new_tokens=4, num_beams=1)
    assert t.token_ids


def test_shared_tables_read_only_the_tables_from_external_data(external_export_dir, monkeypatch):
    """backends/shared_tables: a graph with external data is parsed without it, and only the tables a
    Gather reads come from its data file; the tables are those of a whole load, bit for bit."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from backends.shared_tables import SharedTables

    path = external_export_dir / "decoder.onnx"
    whole = onnx.load(str(path))
    gathered = {n.input[0] for n in whole.graph.node if n.op_type == "Gather"}
    expected = {i.name: numpy_helper.to_array(i) for i in whole.graph.initializer if i.name in gathered}
    loads, real_load = [], onnx.load
    monkeypatch.setattr(onnx, "load", lambda *a, **k: loads.append(k) or real_load(*a, **k))
    tables = SharedTables(min_bytes=0).for_graph(path)
    assert loads == [{"load_external_data": False}]
    assert set(tables) == set(expected) and expected
    for name, array in tables.items():
        assert array.dtype == expected[name].dtype and np.array_equal(array.view(np.uint8), expected[name].view(np.uint8))


def test_the_app_header_names_the_family_and_the_languages(family_export_dir, family_backends):
    from app import build_app
    from ui.state import Loaded, model_heading

    expected = {"nllb-tiny": "NLLB-200 eng_Latn→zho_Hans", "mbart50-tiny": "mBART-50 en_XX→zh_CN"}[family_export_dir.name]
    loaded = Loaded({"ort_int8": family_backends["ort_int8"]}, model=str(family_export_dir))
    assert model_heading(loaded.manifest) == expected
    demo = build_app(loaded)
    assert demo.title == f"{expected}: PyTorch vs ONNX Runtime"
    # --tgt-lang reaches the heading through the backends' sidecar
    code = {"nllb-tiny": "fra_Latn", "mbart50-tiny": "fr_XX"}[family_export_dir.name]
    overridden = load_manifest(family_export_dir).with_languages(None, code)
    assert model_heading(overridden) == expected.rsplit("→", 1)[0] + "→" + code


@pytest.mark.parametrize("change", ["more_layers", "wider_ffn"])
def test_a_checkpoint_whose_weights_do_not_match_its_config_is_refused(tiny_model_dir, tmp_path, change):
    """transformers only warns on missing weights (and initialises them randomly): the export would
    then verify against a model that translates garbage. It is refused, naming the tensors."""
    import shutil

    from export.pipeline import ExportOptions, export
    from export.source import SourceError

    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    if change == "more_layers":
        config["encoder_layers"] += 1
    else:
        config["encoder_ffn_dim"] *= 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(SourceError) as e:
        export(str(folder), ExportOptions(out=tmp_path / "x", verify=False), log=lambda *a, **k: None)
    message = str(e.value)
    assert "the weights do not match config.json" in message, message
    if change == "more_layers":
        assert "in the config, not in the weights (would be random)" in message
        assert f"encoder.layers.{config['encoder_layers'] - 1}." in message
    else:
        assert "fc1.weight" in message
    assert not (tmp_path / "x").exists()
