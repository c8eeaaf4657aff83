"""Someone else's export as a backend (backends/ort_external.py): an Optimum export of the tiny
fixture, made here by `optimum-cli` in the peer environment, runs through our decoding loop token
for token like the pytorch backend, greedy and with beams, in both Optimum layouts (merged decoder;
decoder + decoder with past); a folder of another model is refused naming what differs while the
other backends load; provenance is recorded; no torch on its path. The same for NLLB (M2M100) and
mBART-50 fixtures, greedy and at each family's own beam count, with its forced target language.

The tests that need an Optimum export use the peer environment `.venv-bench`: `make test` creates
it before pytest (so they run in CI); pytest run directly where it is absent skips them
(`make bench-venv` creates it).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from backends import SessionConfig, load_backends, load_manifest, try_load_backends
from backends.ort_external import ExternalExportError, check, find_layout, parse_external
from conftest import REPO, TRAIN_TSV, dev_sentences
from test_families import CASES

PEER_PYTHON = REPO / ".venv-bench" / "bin" / "python"
NO_PEERS = "no peer environment with optimum-cli (.venv-bench); `make bench-venv` creates it"
META = ("config.json", "generation_config.json", "source.spm", "target.spm", "vocab.json", "tokenizer_config.json",
        "special_tokens_map.json")


@pytest.fixture(scope="module")
def optimum_dir(tiny_model_dir, tiny_export_dir, peer_cache) -> Path:
    """`optimum-cli export onnx --task text2text-generation-with-past` of the tiny fixture, made once
    per run with bench/peers.py's own conversion (it writes all four graphs), where `bench speed
    --peers` keeps it (PEER_CACHE/EXPORT_NAME/optimum): test_bench's peer tests reuse it."""
    if not (PEER_PYTHON.parent / "optimum-cli").is_file():
        pytest.skip(NO_PEERS)
    from bench.peers import prepare

    prepared = prepare(Path(tiny_model_dir), peer_cache / Path(tiny_export_dir).name, ["optimum_fp32"], PEER_PYTHON,
                       log=lambda m: None)["optimum_fp32"]
    assert "error" not in prepared, prepared["error"]
    return Path(prepared["dir"])


@pytest.fixture(scope="module")
def split_dir(optimum_dir, tmp_path_factory) -> Path:
    """The same export without its merged decoder: decoder_model.onnx + decoder_with_past_model.onnx."""
    out = tmp_path_factory.mktemp("split")
    for name in ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx", *META):
        if (optimum_dir / name).is_file():
            (out / name).symlink_to(optimum_dir / name)
    return out


@pytest.fixture(scope="module")
def loaded(tiny_export_dir, optimum_dir, split_dir):
    backends = load_backends(tiny_export_dir, names=("pytorch",), session=SessionConfig(threads=2),
                             external={"optimum": optimum_dir, "optimum_split": split_dir})
    yield backends
    for b in backends.values():
        b.close()


def test_optimum_writes_both_layouts_and_the_merged_decoder_is_run(optimum_dir, split_dir, loaded):
    assert {p.name for p in optimum_dir.glob("*.onnx")} == {
        "encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx", "decoder_model_merged.onnx"}
    assert loaded["optimum"].info["graph"] == "encoder_model.onnx + decoder_model_merged.onnx"
    split = "encoder_model.onnx + decoder_model.onnx + decoder_with_past_model.onnx"
    assert loaded["optimum_split"].info["graph"] == split
    assert find_layout(optimum_dir / "encoder_model.onnx").merged == optimum_dir / "decoder_model_merged.onnx"


@pytest.mark.parametrize("name", ["optimum", "optimum_split"])
def test_greedy_ids_identical_to_pytorch_on_8_dev_sentences(loaded, name):
    sentences = dev_sentences(8)
    ref = loaded["pytorch"].translate(sentences, max_new_tokens=24, num_beams=1)
    out = loaded[name].translate(sentences, max_new_tokens=24, num_beams=1)  # one padded batch of 8
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert [o.text for o in out] == [r.text for r in ref]
    assert sum(len(r.token_ids) for r in ref) > 8 * 3  # real decoding, not eos at once
    for o, r in zip(out, ref):
        assert [s.logprob for s in o.scores] == pytest.approx([s.logprob for s in r.scores], abs=1e-4)


def _assert_same_n_best(out, ref) -> None:
    """Best ids, and every hypothesis of the n-best list with its score, as the pytorch backend's."""
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    for o, r in zip(out, ref):
        assert [h.token_ids for h in o.hypotheses] == [h.token_ids for h in r.hypotheses]
        assert [h.score for h in o.hypotheses] == pytest.approx([h.score for h in r.hypotheses], abs=1e-4)


@pytest.mark.parametrize("name", ["optimum", "optimum_split"])
def test_beam_4_ids_and_n_best_identical_to_pytorch(loaded, name):
    sentences = dev_sentences(8)
    decode = dict(max_new_tokens=16, num_beams=4, num_return_sequences=4)
    ref = loaded["pytorch"].translate(sentences, **decode)
    out = loaded[name].translate(sentences, **decode)
    _assert_same_n_best(out, ref)
    # One sentence alone decodes as it did in the batch (the per-sentence first step and its repeat).
    (single,) = loaded[name].translate(sentences[3:4], **decode)
    assert single.token_ids == out[3].token_ids


@pytest.fixture(scope="module")
def int8_dir(split_dir, tmp_path_factory) -> Path:
    """The split export's three graphs quantized (ORT dynamic int8, per channel), config and tokenizer kept."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out = tmp_path_factory.mktemp("int8")
    for path in split_dir.iterdir():
        if path.suffix == ".onnx":
            quantize_dynamic(path.resolve(), out / path.name, weight_type=QuantType.QInt8, per_channel=True)
        else:
            (out / path.name).symlink_to(path.resolve())
    return out


def test_a_quantized_export_is_recorded_as_int8_and_measured_not_required(loaded, int8_dir):
    from backends.divergence import parity_report

    (quantized,) = load_backends(loaded["pytorch"].manifest.root, names=(), session=SessionConfig(threads=2),
                                 external={"q": int8_dir}).values()
    assert quantized.info["precision"] == "int8"
    assert {f["precision"] for f in quantized.info["source"]["files"]} == {"int8"}
    sentences = dev_sentences(8)
    report = parity_report({"pytorch": loaded["pytorch"], "q": quantized}, sentences, "pytorch",
                           max_new_tokens=16, num_beams=1)["backends"]["q"]
    assert 0.5 <= report["token_agreement"] <= 1.0  # agreement is reported; int8 kernels differ per CPU
    text = sentences[0]
    target = loaded["pytorch"].translate([text], max_new_tokens=8, num_beams=1)[0].token_ids
    drift = abs(quantized.score(text, target).logits - loaded["optimum"].score(text, target).logits).max()
    assert 0 < drift < 1.0  # really other numbers than the fp32 graphs, and still close


def test_teacher_forced_scores_match_pytorch(loaded):
    text = dev_sentences(3)[2]
    target = loaded["pytorch"].translate([text], max_new_tokens=12, num_beams=1)[0].token_ids
    ref = loaded["pytorch"].score(text, target)
    out = loaded["optimum"].score(text, target)
    assert out.ranks == ref.ranks
    assert abs(out.logits - ref.logits).max() < 1e-3


def test_compare_runs_external_backends_after_the_built_in_ones_with_their_divergence(loaded):
    from service.compare import compare_iter

    ran = list(compare_iter(loaded, "Hello world. Click OK to close the window.", num_beams=2, max_new_tokens=8))
    assert [r.name for r in ran] == ["pytorch", "optimum", "optimum_split"]
    results = [r.to_json() for r in ran]
    assert all(r["error"] is None and r["divergence"]["identical"] for r in results[1:])
    assert results[1]["info"]["source"]["files"][0]["file"] == "encoder_model.onnx"


def test_provenance_is_recorded(loaded, optimum_dir, tiny_export_dir):
    info = loaded["optimum"].info
    assert info["precision"] == "fp32" and info["threads"] == 2 and info["runtime"].startswith("ONNX Runtime")
    source = info["source"]
    assert source["folder"] == str(optimum_dir) and "merged decoder" in source["layout"]
    files = {f["file"]: f for f in source["files"]}
    assert set(files) == {"encoder_model.onnx", "decoder_model_merged.onnx"}
    for name, f in files.items():
        data = (optimum_dir / name).read_bytes()
        assert f["bytes"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
        assert isinstance(f["opset"], int) and f["opset"] >= 11 and f["producer"] and f["external_data"] == []
    assert files["decoder_model_merged.onnx"]["producer"].startswith("optimum")
    model = load_manifest(tiny_export_dir).data["model"]
    heads = model["decoder_attention_heads"]
    assert source["cache"] == {"layers": model["decoder_layers"], "heads": heads,
                               "head_dim": model["d_model"] // heads, "dtype": "float32"}
    assert source["config"]["model_type"] == "marian" and source["config"]["vocab_size"] == model["vocab_size"]
    assert any("tokenizer" in c for c in source["checked"])
    # ... and shown in its panel, file by file
    from ui.compare_render import info_html

    html = info_html(info)
    assert f"from {optimum_dir}" in html
    for name, f in files.items():
        assert f"{name}: " in html and f["sha256"][:12] in html and f"opset {f['opset']}" in html


def _mismatched_copy(optimum_dir: Path, out: Path) -> Path:
    """The export with another vocabulary: config.json's size and pad id changed, two ids' pieces swapped."""
    shutil.copytree(optimum_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["vocab_size"] += 7
    config["pad_token_id"] = 3
    (out / "config.json").write_text(json.dumps(config))
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    by_id = {i: p for p, i in vocab.items()}
    vocab[by_id[10]], vocab[by_id[11]] = 11, 10
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    return out


def test_another_models_export_is_refused_naming_what_differs_and_others_still_load(
    tiny_export_dir, optimum_dir, tmp_path
):
    bad = _mismatched_copy(optimum_dir, tmp_path / "other")
    vocab = load_manifest(tiny_export_dir).vocab_size
    empty = tmp_path / "empty"
    empty.mkdir()
    loaded, failed = try_load_backends(tiny_export_dir, names=("ort_fp32_kv_cache",), session=SessionConfig(threads=2),
                                       external={"theirs": bad, "nothing": empty, "optimum": optimum_dir})
    try:
        assert set(loaded) == {"ort_fp32_kv_cache", "optimum"} and set(failed) == {"theirs", "nothing"}
        message = failed["theirs"]
        assert message.startswith("ExternalExportError: ") and "is not an export of the reference model" in message
        assert f"config.json vocab_size is {vocab + 7}, the reference's {vocab}" in message
        assert "config.json pad_token_id is 3" in message
        assert f"tokenizer: 2 of {vocab} ids map to other pieces (id 10:" in message
        assert "no encoder_model.onnx: not an Optimum-layout export" in failed["nothing"]
        text = dev_sentences(1)
        assert loaded["optimum"].translate(text, max_new_tokens=8)[0].token_ids == \
            loaded["ort_fp32_kv_cache"].translate(text, max_new_tokens=8)[0].token_ids
    finally:
        for b in loaded.values():
            b.close()
    with pytest.raises(ExternalExportError, match="vocab_size"):  # load_backends: any failure raises
        load_backends(tiny_export_dir, names=("ort_fp32_kv_cache",), external={"theirs": bad})


def test_a_graph_over_another_vocabulary_is_refused(tiny_export_dir, optimum_dir):
    from backends.tokenizer import TokenizerWrapper

    manifest = load_manifest(tiny_export_dir)
    graphs = [{"file": "decoder_model_merged.onnx", "logits_shape": ["batch_size", "decoder_sequence_length", 999]}]
    with pytest.raises(ExternalExportError, match=f"decoder_model_merged.onnx outputs logits over 999 ids, "
                                                  f"the reference's vocabulary has {manifest.vocab_size}"):
        check(find_layout(optimum_dir), manifest, TokenizerWrapper(tiny_export_dir), graphs)


def test_external_path_imports_no_torch(tiny_export_dir, optimum_dir):
    code = (
        "import sys; from backends import load_backends; "
        f"b = load_backends({str(tiny_export_dir)!r}, names=('ort_fp32_kv_cache',), "
        f"external={{'o': {str(optimum_dir)!r}}}); "
        "b['o'].translate(['Hello world.'], max_new_tokens=4, num_beams=1); "
        "b['o'].translate(['Hello world.', 'Good night.'], max_new_tokens=4, num_beams=2); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_parity_cli_checks_an_external_export(tiny_export_dir, optimum_dir, tmp_path, capsys):
    from bench.parity import main

    report_path = tmp_path / "parity.json"
    code = main([str(tiny_export_dir), "--sentences", "6", "--max-new-tokens", "12", "--backends", "pytorch",
                 "--threads", "2", "--num-beams", "1", "--external", f"optimum={optimum_dir}",
                 "--json", str(report_path)])
    assert code == 0
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["backends"]["optimum"]["identical_ids"] == 6
    assert report["external"]["optimum"]["precision"] == "fp32" and report["external"]["optimum"]["files"]
    assert "optimum: identical ids 6/6" in capsys.readouterr().out


def test_bench_speed_times_an_external_export_beside_the_built_in_ones_at_the_same_beams(
    tiny_export_dir, optimum_dir, tmp_path, capsys
):
    """Its own worker process, the run's decoding, its files' size, its precision and provenance in
    results.json, report.md and the README table."""
    from bench.__main__ import main

    out = tmp_path / "speed"
    assert main(["speed", "--model", str(tiny_export_dir), "--backends", "pytorch,ort_fp32_kv_cache", "--external",
                 f"optimum={optimum_dir}", "--sentences", "3", "--batch-sizes", "3", "--warmup", "1",
                 "--max-new-tokens", "8", "--num-beams", "2", "--no-floor", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert list(results["runtimes"]) == ["pytorch", "ort_fp32_kv_cache", "optimum"] and results["failed"] == {}
    assert results["external"] == {"optimum": str(optimum_dir)}
    r = results["runtimes"]["optimum"]
    cmd = r["command"]
    assert cmd[cmd.index("--external-dir") + 1] == str(optimum_dir) and cmd[cmd.index("--num-beams") + 1] == "2"
    assert r["decoding"] == {"num_beams": 2} and r["torch_in_process"] is False
    assert r["latency"]["n"] == 3 and r["throughput"]["3"]["sentences"] == 3 and r["load_s"] > 0
    graphs = ["encoder_model.onnx", "decoder_model_merged.onnx"]
    assert r["info"]["files"] == graphs
    assert r["size_bytes"] == sum((optimum_dir / f).stat().st_size for f in graphs)
    assert r["info"]["precision"] == "fp32" and r["info"]["source"]["folder"] == str(optimum_dir)
    assert r["comparison"]["identical_to_reference"] == 1.0  # beam 2 through our loop, as pytorch decodes
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "| `optimum` | fp32 |" in md
    sha = r["info"]["source"]["files"][0]["sha256"][:12]
    assert "- `optimum`: ONNX Runtime" in md and "external export, fp32" in md and sha in md
    capsys.readouterr()
    assert main(["table", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| `optimum` (fp32) |" in table and "- `optimum`: external export, fp32" in table and str(optimum_dir) in table


def test_bench_speed_reports_why_an_external_export_did_not_run(tiny_export_dir, optimum_dir, tmp_path, capsys):
    """Another model's export fails in its worker; the report names what differs, the others are timed."""
    from bench.__main__ import main

    bad, out = _mismatched_copy(optimum_dir, tmp_path / "theirs"), tmp_path / "speed"
    assert main(["speed", "--model", str(tiny_export_dir), "--backends", "ort_fp32_kv_cache", "--external",
                 f"theirs={bad}", "--sentences", "2", "--batch-sizes", "2", "--sweep", "", "--warmup", "1",
                 "--max-new-tokens", "4", "--no-floor", "--out", str(out)]) == 1
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert list(results["runtimes"]) == ["ort_fp32_kv_cache"] and list(results["failed"]) == ["theirs"]
    reason = "ExternalExportError: " + f"{bad} is not an export of the reference model"
    line = next(x for x in (out / "report.md").read_text(encoding="utf-8").splitlines() if "did not run" in x)
    assert line.startswith("- `theirs` did not run: exit 1; last lines of theirs.log: … ") and reason in line
    assert "config.json vocab_size is" in line
    printed = capsys.readouterr().out
    assert "theirs: FAILED: exit 1" in printed and reason in printed


def test_bench_quality_runs_an_external_export_beside_the_built_in_ones(tiny_export_dir, optimum_dir, split_dir,
                                                                         tmp_path, capsys):
    import pyarrow.parquet as pq

    from bench.__main__ import main

    out = tmp_path / "quality"
    args = ["quality", "--model", str(tiny_export_dir), "--backends", "pytorch", "--sentences", "6",
            "--shard-size", "3", "--max-new-tokens", "12", "--out", str(out)]
    assert main([*args, "--external", f"optimum={optimum_dir}", "--external", f"split={split_dir}"]) == 0
    results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert list(results["backends"]) == ["pytorch", "optimum", "split"]
    for name in ("optimum", "split"):
        b = results["backends"][name]
        assert (b["agreement"]["identical"], b["agreement"]["n"], b["identical_text"]) == (6, 6, 6), name
        assert b["vs_reference_backend"]["bleu"] == 100.0 and b["info"]["precision"] == "fp32"
        assert b["info"]["source"]["folder"] == str(find_layout(results["external"][name]).folder)
        assert results["outputs"][name] == results["outputs"]["pytorch"]
    printed = capsys.readouterr().out
    assert "optimum: identical tokens 6/6" in printed and "split: identical tokens 6/6" in printed
    rows = [r for p in sorted((out / "shards").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert len(rows) == 6 and all(r["split_ids"] == r["pytorch_ids"] for r in rows)
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "| `split` | 6/6 (100.0%) | 6/6 |" in md
    assert f"- `optimum` (`--external optimum={optimum_dir}`): external export, fp32" in md
    # run.json pins the external exports by their files' sha256: another set of them is another run
    pinned = json.loads((out / "run.json").read_text(encoding="utf-8"))["external"]["optimum"]["files"]
    assert pinned["decoder_model_merged.onnx"] == hashlib.sha256(
        (optimum_dir / "decoder_model_merged.onnx").read_bytes()).hexdigest()
    assert main([*args, "--external", f"optimum={optimum_dir}"]) == 2
    assert "holds shards of another run (external differ)" in capsys.readouterr().err


@pytest.mark.ray
def test_the_ray_engine_ships_an_external_export_to_the_node(tiny_export_dir, optimum_dir, tmp_path):
    """--model-transfer ship: its files go through the object store under external/NAME/, are checked on
    the node and loaded from there; the per-sentence results equal the local engine's."""
    pytest.importorskip("ray")
    from bench.__main__ import main

    tables = {}
    for engine in ("local", "ray"):
        out = tmp_path / engine
        extra = ["--engine", "ray", "--actors", "1", "--threads", "1", "--model-transfer", "ship",
                 "--node-cache", str(tmp_path / "node")] if engine == "ray" else []
        assert main(["quality", "--model", str(tiny_export_dir), "--backends", "pytorch", "--external",
                     f"optimum={optimum_dir}", "--sentences", "4", "--shard-size", "4", "--max-new-tokens", "8",
                     "--out", str(out), *extra]) == 0
        tables[engine] = json.loads((out / "results.json").read_text(encoding="utf-8"))
    ray_run = tables["ray"]
    assert ray_run["engine"]["model_transfer"] == "ship"
    assert ray_run["outputs"] == tables["local"]["outputs"] and ray_run["backends"]["optimum"]["agreement"]["identical"] == 4
    folder = ray_run["backends"]["optimum"]["info"]["source"]["folder"]
    assert folder.startswith(str(tmp_path / "node")) and folder.endswith("external/optimum")


def test_shipped_external_files_are_checked_on_the_node(tiny_export_dir, split_dir, tmp_path):
    from backends import ManifestError
    from bench.engine.model_files import digests, materialize, shipment_files, shipped_external

    external = {"split": str(split_dir / "encoder_model.onnx")}  # a variant named by its encoder file
    files = shipment_files(tiny_export_dir, ["ort_fp32_kv_cache"], external)
    shipped = {n for n in files if n.startswith("external/")}
    assert shipped == {f"external/split/{f}" for f in ("encoder_model.onnx", "decoder_model.onnx",
                                                        "decoder_with_past_model.onnx", "config.json",
                                                        *load_manifest(tiny_export_dir).tokenizer_files)}
    assert shipped_external(external) == {"split": "external/split/encoder_model.onnx"}
    digest = digests(files)
    export, _ = materialize(tmp_path / "node", digest, lambda name: files[name].read_bytes())
    where = {"split": str(export.parent / "external/split/encoder_model.onnx")}
    backends = load_backends(export, names=("ort_fp32_kv_cache",), external=where)
    text = dev_sentences(2)
    assert [t.token_ids for t in backends["split"].translate(text, max_new_tokens=8)] == \
        [t.token_ids for t in backends["ort_fp32_kv_cache"].translate(text, max_new_tokens=8)]

    def corrupt(name):
        data = bytearray(files[name].read_bytes())
        if name == "external/split/decoder_with_past_model.onnx":
            data[len(data) // 2] ^= 0xFF
        return bytes(data)

    with pytest.raises(ManifestError, match="decoder_with_past_model.onnx: sha256 differs from the external export"):
        materialize(tmp_path / "other-node", digest, corrupt)


def test_spot_check_runs_external_backends_beside_the_built_in_ones(loaded, tmp_path):
    """app.py --external: the Batch spot-check tab runs them too, with their agreement with pytorch."""
    from ui import spotcheck_tab
    from ui.state import Loaded

    app_loaded = Loaded(loaded, {"broken": "ExternalExportError: vocab_size differs"}, max_new_tokens=8)
    lines = ["en\tzh", *(f"{s}\t参考" for s in dev_sentences(4))]
    view = spotcheck_tab.run(app_loaded, "\n".join(lines), None)
    assert view.result is not None, view.status
    rows = {row[0]: dict(zip(spotcheck_tab.headers("pytorch"), row)) for row in view.summary}
    assert list(rows) == ["pytorch", "optimum", "optimum_split"]
    for name in ("optimum", "optimum_split"):
        assert rows[name]["identical tokens"] == "4/4 (100%)" and rows[name]["first divergence: step (sentences)"] == "none"
        b = view.result["backends"][name]
        assert b["agreement"]["identical"] == 4 and b["translations"] == view.result["backends"]["pytorch"]["translations"]
    assert "`optimum`: external export, fp32" in view.status and "`broken` not run: failed to load" in view.status
    saved = json.loads(view.json_path.read_text(encoding="utf-8"))
    assert saved["backends"]["optimum"]["info"]["source"]["files"][0]["file"] == "encoder_model.onnx"


# --- NLLB (M2M100) and mBART-50 -----------------------------------------------------------------------
#
# The families' tiny fixtures with their weights spread (`_spread`): as built, random tiny NLLB and
# mBART weights give every sentence the same output (the final LayerNorm leaves the logits ~0.1
# apart, whatever the source), so equal ids would say nothing about the encoder, and no beam ends.
# Our export of each is the reference (unverified here: test_families verifies these families'
# exports); Optimum exports the same weights with the peer environment's transformers 4.x. That
# transformers cannot read the fixtures' tokenizer_config.json (written by transformers 5, its
# `extra_special_tokens` a list: AutoTokenizer raises "'list' object has no attribute 'keys'"), so
# optimum-cli writes the graphs and config.json without a tokenizer. The tokenizer a hub model's
# Optimum export carries is made here by the peer environment's own fast tokenizer class from the
# fixture's tokenizer.json: 4.x files, checked against our 5.x sidecar id by id.

# fixture -> the peer environment's tokenizer class (transformers 4.x)
PEER_TOKENIZERS = {"nllb-tiny": "NllbTokenizerFast", "mbart50-tiny": "MBart50TokenizerFast"}
SPREAD, EOS_LIFT = 8.0, 2.5  # chosen on the fixtures (seed 0): outputs differ by sentence, some beams end


def _spread(model) -> None:
    """Every weight matrix times SPREAD, so the logits depend on the source (a closest pair of top
    tokens 0.005 apart at the least, far above PyTorch-vs-ORT float differences); eos lifted by
    EOS_LIFT at every step, so some hypotheses end before the cap: mBART through its
    final_logits_bias; NLLB, which has none, through the decoder's final LayerNorm bias along eos's
    row of the tied output layer (adding c w/|w|^2 to the bias adds c to eos's logit)."""
    import torch

    eos = model.config.eos_token_id
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(SPREAD)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias[0, eos] += EOS_LIFT
        else:
            w = model.lm_head.weight[eos]
            model.model.decoder.layer_norm.bias.add_(EOS_LIFT / float(w @ w) * w)


PEER_TOKENIZER_SCRIPT = """
import sys, transformers
model, out, cls, src, tgt = sys.argv[1:]
tok = getattr(transformers, cls)(tokenizer_file=model + "/tokenizer.json", src_lang=src, tgt_lang=tgt)
tok.save_pretrained(out)
"""


@dataclass
class Family:
    name: str  # the fixture: nllb-tiny or mbart50-tiny
    model: Path  # its weights and tokenizer
    export: Path  # our export of it: the reference
    graphs: Path  # Optimum's graphs and config.json, no tokenizer (what optimum-cli wrote)
    optimum: Path  # the same with the tokenizer the peer environment writes
    split: Path  # that without the merged decoder


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory) -> Family:
    """One family's fixture, spread, exported by us and by Optimum (about 45 s each on 2 shared cores:
    our export 25-30 s, optimum-cli 8-9 s, the peer tokenizer 4-5 s)."""
    if not (PEER_PYTHON.parent / "optimum-cli").is_file():
        pytest.skip(NO_PEERS)
    import transformers

    from bench.peers import prepare
    from export.fixtures import FIXTURES, build
    from export.pipeline import ExportOptions, export

    name = request.param
    root = tmp_path_factory.mktemp(name)
    model = build(name, root / "model", corpus=TRAIN_TSV)
    weights = getattr(transformers, FIXTURES[name].architecture).from_pretrained(model).eval()
    _spread(weights)
    weights.save_pretrained(model)
    reference = export(str(model), ExportOptions(out=root / "export", threads=1, verify=False), log=lambda *a, **k: None)
    prepared = prepare(model, root / "peers", ["optimum_fp32"], PEER_PYTHON, log=lambda m: None)["optimum_fp32"]
    assert "error" not in prepared, prepared["error"]
    written = Path(prepared["dir"])
    folders = {k: root / k for k in ("graphs", "optimum", "split")}
    for folder in folders.values():
        folder.mkdir()
    for path in written.iterdir():
        if path.suffix == ".onnx" or path.name in ("config.json", "generation_config.json"):
            (folders["graphs"] / path.name).symlink_to(path)
            (folders["optimum"] / path.name).symlink_to(path)
            if path.name != "decoder_model_merged.onnx":
                (folders["split"] / path.name).symlink_to(path)
    _, _, src, tgt = CASES[name]
    subprocess.run([PEER_PYTHON, "-c", PEER_TOKENIZER_SCRIPT, model, folders["optimum"], PEER_TOKENIZERS[name], src,
                    tgt], check=True, capture_output=True, timeout=120)
    for path in folders["optimum"].iterdir():
        if not path.is_symlink():  # the tokenizer files
            (folders["split"] / path.name).symlink_to(path)
    return Family(name, model, reference, **folders)


@pytest.fixture(scope="module")
def family_loaded(family):
    backends = load_backends(family.export, names=("pytorch",), session=SessionConfig(threads=1),
                             external={"optimum": family.optimum, "optimum_split": family.split})
    yield backends
    for b in backends.values():
        b.close()


def test_family_export_without_a_tokenizer_is_refused_naming_the_missing_files(family):
    manifest = load_manifest(family.export)
    with pytest.raises(ExternalExportError) as e:
        load_backends(family.export, names=(), external={"theirs": family.graphs})
    message = str(e.value)
    assert f"tokenizer files missing: {', '.join(manifest.tokenizer_files)}" in message, message
    assert "copy the tokenizer the model was exported with next to the graphs" in message


def test_family_export_is_checked_and_recorded_as_the_familys(family, family_loaded):
    manifest = load_manifest(family.export)
    info = family_loaded["optimum"].info
    assert info["graph"] == "encoder_model.onnx + decoder_model_merged.onnx"
    assert family_loaded["optimum_split"].info["graph"] == \
        "encoder_model.onnx + decoder_model.onnx + decoder_with_past_model.onnx"
    source = info["source"]
    assert source["config"]["model_type"] == manifest.family == CASES[family.name][0]
    model = manifest.data["model"]
    heads = model["decoder_attention_heads"]
    assert source["cache"] == {"layers": model["decoder_layers"], "heads": heads,
                               "head_dim": model["d_model"] // heads, "dtype": "float32"}
    # the peer environment's 4.x tokenizer files, not ours: the check compared them, id by id
    assert json.loads((family.optimum / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        PEER_TOKENIZERS[family.name]
    assert any("every id's piece" in c for c in source["checked"])


@pytest.mark.parametrize("name", ["optimum", "optimum_split"])
def test_family_greedy_ids_identical_to_pytorch_with_the_forced_target_language(family_loaded, name):
    sentences = dev_sentences(5)
    ref = family_loaded["pytorch"].translate(sentences, max_new_tokens=24, num_beams=1)
    out = family_loaded[name].translate(sentences, max_new_tokens=24, num_beams=1)  # one padded batch
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert [o.text for o in out] == [r.text for r in ref]
    forced = family_loaded["pytorch"].manifest.generation.forced_bos_token_id
    assert all(r.token_ids[0] == forced for r in ref)
    assert len({tuple(r.token_ids) for r in ref}) > 1  # the source matters: not one output for all
    for o, r in zip(out, ref):
        assert [s.logprob for s in o.scores] == pytest.approx([s.logprob for s in r.scores], abs=1e-4)


@pytest.mark.parametrize("name", ["optimum", "optimum_split"])
def test_family_beam_ids_and_n_best_identical_to_pytorch_at_its_own_beams(family_loaded, name):
    sentences = dev_sentences(5)
    beams = family_loaded["pytorch"].manifest.generation.num_beams  # NLLB's 4, mBART-50's 5
    assert beams > 1
    decode = dict(max_new_tokens=24, num_beams=beams, num_return_sequences=beams)
    ref = family_loaded["pytorch"].translate(sentences, **decode)
    out = family_loaded[name].translate(sentences, **decode)
    _assert_same_n_best(out, ref)
    assert min(len(r.token_ids) for r in ref) < 24  # beams finish: eos decides, not the cap
    (single,) = family_loaded[name].translate(sentences[2:3], **decode)
    assert single.token_ids == out[2].token_ids


def test_family_teacher_forced_logits_match_pytorch_at_every_position(family_loaded):
    """40 target positions, one sentence: the decoder's positions (NLLB's sinusoidal table, mBART's
    learned one, each offset by 2) agree with PyTorch's at each."""
    text = dev_sentences(4)[3]
    target = family_loaded["pytorch"].translate([text], max_new_tokens=40, min_new_tokens=40,
                                                num_beams=1)[0].token_ids
    assert len(target) == 40
    ref = family_loaded["pytorch"].score(text, target)
    out = family_loaded["optimum"].score(text, target)
    assert out.ranks == ref.ranks
    assert abs(out.logits - ref.logits).max() < 1e-3


def test_family_target_language_override_reaches_the_external_backend(family):
    other = {"nllb-tiny": "fra_Latn", "mbart50-tiny": "fr_XX"}[family.name]
    backends = load_backends(family.export, names=("pytorch",), tgt_lang=other, session=SessionConfig(threads=1),
                             external={"optimum": family.optimum})
    forced = backends["pytorch"].tokenizer._tok.convert_tokens_to_ids(other)
    sentences = dev_sentences(3)
    ref = [t.token_ids for t in backends["pytorch"].translate(sentences, max_new_tokens=12, num_beams=1)]
    out = [t.token_ids for t in backends["optimum"].translate(sentences, max_new_tokens=12, num_beams=1)]
    assert out == ref and all(ids[0] == forced for ids in out)


# --- without the peer environment -------------------------------------------------------------------


def test_external_arguments_are_parsed_and_checked(tiny_export_dir, tmp_path):
    assert parse_external(["a=/x/y", "b = z=w "]) == {"a": "/x/y", "b": "z=w"}
    for bad, why in ((["a"], "expected NAME=DIR"), (["=d"], "expected NAME=DIR"), (["a=x", "a=y"], "given twice")):
        with pytest.raises(ValueError, match=why):
            parse_external(bad)
    with pytest.raises(ValueError, match="taken by a built-in backend"):
        load_backends(tiny_export_dir, names=("ort_fp32_kv_cache",), external={"ort_int8": tmp_path})
    with pytest.raises(ValueError, match="use letters, digits"):
        load_backends(tiny_export_dir, names=("ort_fp32_kv_cache",), external={"a b": tmp_path})


@pytest.mark.parametrize("command", ["speed", "quality"])
def test_bench_external_values_are_checked_before_any_work(command, tiny_export_dir, tmp_path, capsys):
    from bench.__main__ import main

    base = [command, "--model", str(tiny_export_dir), "--sentences", "2", "--out", str(tmp_path / "out")]
    for value, message in (("no-equals-sign", "--external: expected NAME=DIR"),
                           ("ort_int8=x", "taken by a built-in backend"),
                           (f"mine={tmp_path / 'missing'}", "no such folder or file")):
        assert main([*base, "--external", value]) == 2
        assert message in capsys.readouterr().err, value
    if command == "speed":  # a peer's name would mix its numbers with the peer's in results.json
        assert main([*base, "--external", f"optimum_fp32={tmp_path}"]) == 2
        assert "taken by a peer runtime" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_layouts_that_cannot_run_are_named(tmp_path):
    (tmp_path / "encoder_model.onnx").write_bytes(b"")
    with pytest.raises(ExternalExportError, match="needs decoder_model_merged.onnx, or both decoder_model.onnx "
                                                  "and decoder_with_past_model.onnx"):
        find_layout(tmp_path)
    (tmp_path / "encoder_model_quantized.onnx").write_bytes(b"")
    several = r"several variants \(encoder_model.onnx, encoder_model_quantized.onnx\)"
    with pytest.raises(ExternalExportError, match=several):
        find_layout(tmp_path)
    (tmp_path / "decoder_model_merged_quantized.onnx").write_bytes(b"")
    layout = find_layout(tmp_path / "encoder_model_quantized.onnx")  # a variant named by its encoder file
    assert layout.merged.name == "decoder_model_merged_quantized.onnx" and layout.decoder is None
    with pytest.raises(ExternalExportError, match="no such folder or file"):
        find_layout(tmp_path / "missing")


def test_app_refuses_an_external_name_taken_by_a_built_in_backend(tiny_export_dir, tmp_path, capsys):
    import app

    with pytest.raises(SystemExit) as exit_info:
        app.main(["--model", str(tiny_export_dir), "--external", "no-equals-sign"])
    assert exit_info.value.code == 2 and "expected NAME=DIR" in capsys.readouterr().err
    code = app.main(["--model", str(tiny_export_dir), "--backends", "ort_fp32_kv_cache",
                     "--external", f"ort_fp16={tmp_path}"])
    assert code == 2 and "taken by a built-in backend" in capsys.readouterr().err
