"""bench/ and the runs it shares with the app (service/): short runs on the tiny export, asserting the numbers."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from backends import MAX_BEAMS
from backends.divergence import first_divergence
from bench.data import default_backends
from conftest import DEV_TSV, REPO, dev_sentences
from corpus import SAMPLE_WORDS as WORDS, default_sample, read_pairs
from runtime.protocol import percentiles
from service import metrics

PNG = b"\x89PNG\r\n\x1a\n"
FP32 = ("ort_fp32_single_step", "ort_fp32_kv_cache")
PEER_PYTHON = REPO / ".venv-bench" / "bin" / "python"


def _ordered(lat: dict) -> None:
    assert lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert lat["min"] <= lat["mean"] <= lat["max"]
    assert lat["min"] > 0


# --- pure functions: golden values -------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, step",
    [
        ([5, 6, 7], [5, 6, 7], None),
        ([5, 6, 7], [9, 6, 7], 0),
        ([5, 6, 7], [5, 6, 8], 2),
        ([5, 6], [5, 6, 7], 2),  # a prefix diverges where the shorter one ends
        ([], [1], 0),
    ],
)
def test_first_divergence(a, b, step):
    assert first_divergence(a, b) == step


def test_agreement_counts_and_buckets():
    ref = [[1, 2, 3]] * 5
    outs = [[1, 2, 3], [1, 2, 3], [9, 2, 3], [1, 2, 9], [1, 2, 3] + [0] * 30]
    a = metrics.agreement(outs, ref)
    assert (a["n"], a["identical"], a["identical_share"]) == (5, 2, 0.4)
    assert a["first_divergence_steps"] == [None, None, 0, 2, 3]
    assert a["first_divergence_histogram"] == {0: 1, 2: 1, 3: 1}
    assert a["first_divergence_buckets"] == {"0": 1, "1-4": 2, "5-9": 0, "10-19": 0, "20+": 0}


def test_percentiles_of_known_values():
    p = percentiles([float(x) for x in range(1, 101)])
    assert p["n"] == 100
    assert p["p50"] == pytest.approx(50.5)
    assert p["p90"] == pytest.approx(90.1)
    assert p["p99"] == pytest.approx(99.01)
    assert (p["mean"], p["min"], p["max"]) == (50.5, 1.0, 100.0)
    with pytest.raises(ValueError):
        percentiles([])


def test_bleu_chrf_identical_and_different():
    same = metrics.bleu_chrf(["点击确定保存文档。"], ["点击确定保存文档。"])
    assert same["bleu"] == pytest.approx(100.0) and same["chrf"] == pytest.approx(100.0)
    other = metrics.bleu_chrf(["今天天气很好。"], ["点击确定保存文档。"])
    assert other["bleu"] < 10 and other["chrf"] < 20


def test_default_sample_is_fixed_and_in_range():
    a, b = default_sample(200), default_sample(200)
    assert [p.en for p in a] == [p.en for p in b]
    assert len(a) == min(200, sum(WORDS[0] <= len(p.en.split()) <= WORDS[1] for p in read_pairs(DEV_TSV)))
    assert len({p.en for p in a}) == len(a)
    assert all(WORDS[0] <= len(p.en.split()) <= WORDS[1] and p.zh for p in a)
    assert [p.en for p in default_sample(20)] != [p.en for p in a[:20]] or len(a) == 20  # drawn, not sliced


# --- python -m bench speed / quality on the tiny export -----------------------------------------


@pytest.fixture(scope="module")
def speed_run(tiny_export_dir, tmp_path_factory):
    from bench.__main__ import main

    out = tmp_path_factory.mktemp("speed")
    rc = main(["speed", "--model", str(tiny_export_dir), "--sentences", "5", "--forced-tokens", "4",
               "--batch-sizes", "2,4", "--sweep", "4,8", "--sweep-sentences", "2", "--warmup", "1", "--out", str(out)])
    return rc, out, json.loads((out / "results.json").read_text(encoding="utf-8"))


def test_speed_writes_real_numbers(speed_run, tiny_export_dir):
    from backends import load_manifest

    rc, out, results = speed_run
    assert rc == 0, results["failed"]
    manifest = load_manifest(tiny_export_dir)
    expected, _ = default_backends(manifest)
    assert list(results["runtimes"]) == expected
    assert results["sentences"]["count"] == 5 and results["options"]["forced_tokens"] == 4
    # No --num-beams: greedy search for every runtime, as before the option existed, and on record.
    assert results["options"]["num_beams"] == 1 and results["decoding"]["label"] == "greedy"
    assert all(r["decoding"] == {"num_beams": 1} for r in results["runtimes"].values())
    for name, r in results["runtimes"].items():
        lat = r["latency"]
        assert lat["n"] == 5, name
        _ordered(lat)
        assert lat["tokens_mean"] == 4.0  # forced: every sentence generates exactly 4 tokens
        assert lat["ms_per_token_p50"] == pytest.approx(lat["p50"] / 4, rel=0.5)
        for b, batches in (("2", 3), ("4", 2)):
            t = r["throughput"][b]
            assert (t["sentences"], t["batches"], t["generated_tokens"]) == (5, batches, 20)
            assert t["sentences_per_s"] == pytest.approx(5 / t["seconds"])
            assert t["tokens_per_s"] == pytest.approx(4 * t["sentences_per_s"])
            # Our backends time their engine apart from the loop: part of the call, never more.
            assert 0 < t["engine_seconds"] < t["seconds"], (name, b)
        assert 0 < lat["engine_ms_per_token_p50"] < lat["ms_per_token_p50"], name
        assert set(r["sweep"]) == {"4", "8"} and all(c["n"] == 2 for c in r["sweep"].values())
        assert r["sweep"]["8"]["ms_per_token"] == pytest.approx(r["sweep"]["8"]["ms_per_sentence"] / 8)
        assert r["load_s"] > 0 and r["peak_rss_mb"] >= r["rss_after_load_mb"] > 20
        if name != "pytorch":
            assert r["size_bytes"] == sum(manifest.data["files"][f]["bytes"] for f in r["info"]["files"])
            assert r["torch_in_process"] is False, f"{name} pulled torch into its process"
        assert r["comparison"]["latency_p50_ratio"] > 0
    assert results["runtimes"]["pytorch"]["size_bytes"] > 0
    for name in FP32:
        assert results["runtimes"][name]["comparison"]["identical_to_reference"] == 1.0


def test_speed_writes_report_and_plots(speed_run):
    _, out, results = speed_run
    md = (out / "report.md").read_text(encoding="utf-8")
    for name in results["runtimes"]:
        assert f"| `{name}` |" in md
    assert "## What is timed" in md and "single-step / KV cache" in md and results["environment"]["cpu"] in md
    from backends import native

    assert f"- Our decoding loop's scoring passes: {native.describe()}" in md  # which ones were timed
    assert "Decoding: greedy." in md and "Greedy search (num_beams 1) for every runtime." in results["what_is_timed"]
    assert results["plots"] == ["sweep.png", "speed.png"]
    for p in results["plots"]:
        assert (out / p).read_bytes().startswith(PNG)


def test_speed_measures_the_bandwidth_floor_and_checks_the_targets(speed_run, tiny_export_dir):
    from bench.floor import weight_bytes

    _, out, results = speed_run
    floor = results["environment"]["floor"]
    bw = floor["bandwidth"]["gb_per_s"]
    assert bw == max(p["gb_per_s"] for p in floor["bandwidth"]["probes"].values()) > 0.1
    decoder = floor["graphs"]["decoder"]
    assert decoder["weight_mb"] == pytest.approx(weight_bytes(tiny_export_dir / "decoder.onnx") / 2**20, abs=0.01)
    assert decoder["floor_ms_per_token"] == pytest.approx(decoder["weight_mb"] / 1024 / bw * 1e3, rel=0.02)
    assert floor["graphs"]["decoder_int8"]["weight_mb"] < decoder["weight_mb"]
    targets = {t["target"]: t for t in results["targets"]}
    kv = targets["ort_fp32_kv_cache, batch 1: ms per token within 1.15x of the memory-bandwidth floor"]
    lat = results["runtimes"]["ort_fp32_kv_cache"]["latency"]
    # The target compares the round with a floor measured just before it (one round here), not the end-of-run one.
    beside = results["runtimes"]["ort_fp32_kv_cache"]["floor_beside"]
    assert beside["weight_mb"] == decoder["weight_mb"] and beside["gb_per_s"] > 0.1
    assert beside["floor_ms_per_token"] == pytest.approx(beside["weight_mb"] / 1024 / beside["gb_per_s"] * 1e3, rel=0.02)
    assert kv["value"] == pytest.approx(lat["ms_per_token_p50"] / beside["floor_ms_per_token"])
    assert kv["held"] == (kv["value"] <= 1.15)
    assert "in the median of 1 rounds, each against the floor measured just before it" in kv["measured"]
    # With the engine's own figure, so a miss says whether the loop or the graphs are behind it.
    engine = lat["engine_ms_per_token_p50"] / beside["floor_ms_per_token"]
    assert f"the ORT graphs alone {engine:.2f}x" in kv["measured"]
    assert f"ORT's weight products alone {beside['matmuls_alone']['x_floor']:.2f}x" in kv["measured"]
    assert "floor_beside" in results["runtimes"]["ort_int8"] and "floor_beside" not in results["runtimes"]["pytorch"]
    i8 = targets["ort_int8, batch 1: ms per token within 1.3x of the memory-bandwidth floor"]
    assert i8["held"] == (i8["value"] <= 1.3)
    # No peers in this run: targets against them are reported as not measured, not as passed.
    ct2 = targets["ort_int8, batch 4: at least CTranslate2 int8's throughput"]
    assert ct2["held"] is None and "not measured" in ct2["measured"]
    assert not any("beam" in t for t in targets)  # a greedy run checks no beam target
    # ORT's weight products alone, for both graphs, against the same floor.
    for name, graph in (("decoder", decoder), ("decoder_int8", floor["graphs"]["decoder_int8"])):
        model = onnx.load(str(tiny_export_dir / f"{name}.onnx"))
        inits = {i.name for i in model.graph.initializer}
        op = "MatMulInteger" if name.endswith("int8") else "MatMul"
        products = sum(n.op_type == op and n.input[1] in inits for n in model.graph.node)
        alone = graph["matmuls_alone"]
        assert alone["products"] == products > 0 and alone["ms"] > 0
        unrounded_floor = graph["weight_mb"] / 1024 / bw * 1e3  # the tiny graph's floor is a few microseconds
        assert alone["x_floor"] == pytest.approx(alone["ms"] / unrounded_floor, rel=0.01, abs=2e-3)
        # and the rest of the step's kernels alone: every product taken out, the sum beside them
        others = graph["others_alone"]
        assert others["products_taken"] == products and others["ms"] > 0 and others["nodes"] > 0
        assert others["x_floor"] == pytest.approx(others["ms"] / unrounded_floor, rel=0.01, abs=2e-3)
        assert graph["kernels_x_floor"] == pytest.approx((alone["ms"] + others["ms"]) / unrounded_floor, rel=0.01,
                                                         abs=2e-3)
    others = beside["others_alone"]
    assert f"the rest of the step's kernels alone {others['x_floor']:.2f}x: together {beside['kernels_x_floor']:.2f}x" \
        in kv["measured"]
    assert ("out of its reach with ORT's kernels" in kv["measured"]) == (beside["kernels_x_floor"] > 1.15)
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "## Memory-bandwidth floor" in md and "## Speed targets" in md
    assert f"batch 1, a cache of {others['past']}, a source of {others['source']})" in md
    assert f"| `decoder` | {decoder['weight_mb']:,} | {decoder['floor_ms_per_token']:.2f} | " \
           f"{decoder['matmuls_alone']['ms']:.2f} | {decoder['matmuls_alone']['x_floor']:.2f} | " \
           f"{decoder['others_alone']['ms']:.2f} | {decoder['kernels_x_floor']:.2f} |" in md


def test_a_floor_target_is_the_median_of_rounds_each_against_its_own_floor():
    """Golden values: rounds of 10, 12, 9 ms/token against floors of 8, 12, 9 ms measured just
    before each -> per-round 1.25, 1.00, 1.00x: median 1.00x (held at 1.15), where the medians'
    ratio (10 / 9 = 1.11x) would mix a slow round's latency with a fast minute's floor. A run
    where one round has no floor falls back to the end-of-run floor."""
    from service.speedrun import floor_beside_rounds, targets

    def beside(floor_ms, alone, others=None):
        return {"floor_ms_per_token": floor_ms, "gb_per_s": 212 / 1024 / floor_ms * 1e3,
                "matmuls_alone": {"x_floor": alone},
                **({"others_alone": {"x_floor": others}, "kernels_x_floor": alone + others} if others else {})}

    rounds = [{"ms_per_token_p50": t, "engine_ms_per_token_p50": t - 1, "floor_beside": beside(f, a)}
              for t, f, a in ((10, 8, 1.1), (12, 12, 1.0), (9, 9, 1.2))]
    kv = {"latency": {"p50": 400, "ms_per_token_p50": 10, "engine_ms_per_token_p50": 9}, "throughput": {},
          "rounds": rounds}
    got = floor_beside_rounds(kv)
    assert [r["x_floor"] for r in got] == [1.25, 1.0, 1.0]
    results = {"runtimes": {"ort_fp32_kv_cache": kv}, "options": {"batch_sizes": [1], "forced_tokens": 40},
               "environment": {"floor": {"graphs": {"decoder": {"floor_ms_per_token": 9.0}}}}}
    target = next(t for t in targets(results) if t["target"].startswith("ort_fp32_kv_cache, batch 1: ms per token"))
    assert target["value"] == 1.0 and target["held"] is True
    assert "rounds 1.00–1.25x; 9.00–12.00 ms/token against floors of 8.00–12.00 ms" in target["measured"]
    assert "ORT's weight products alone 1.10x (1.00–1.20)" in target["measured"]
    assert "the ORT graphs alone 0.92x" in target["measured"]  # median of 9/8, 11/12, 8/9
    assert "the rest of the step's kernels" not in target["measured"]  # rounds measured before it existed
    # With the rest of the step's kernels: kernels together 1.10 + 0.04, 1.00 + 0.05, 1.20 + 0.06 ->
    # median 1.14x, under the 1.15x limit; with the int8 limit of 1.3 too. At 1.10 + 0.30 and so on
    # (median 1.40x) the target is out of reach of the kernels themselves, and the text says so.
    for extra, out_of_reach in ((0.0, False), (0.26, True)):
        for r, (a, o) in zip(rounds, ((1.1, 0.04), (1.0, 0.05), (1.2, 0.06))):
            r["floor_beside"] = beside(r["floor_beside"]["floor_ms_per_token"], a, o + extra)
        target = next(t for t in targets(results) if t["target"].startswith("ort_fp32_kv_cache, batch 1: ms per token"))
        together = 1.14 + extra
        assert f"the rest of the step's kernels alone {0.05 + extra:.2f}x: together {together:.2f}x" in target["measured"]
        assert ("above the 1.15x target: out of its reach with ORT's kernels" in target["measured"]) == out_of_reach
        assert target["held"] is True  # the verdict is the per-token figure's; the kernels only explain it
    del rounds[1]["floor_beside"]
    assert floor_beside_rounds(kv) == []
    target = next(t for t in targets(results) if t["target"].startswith("ort_fp32_kv_cache, batch 1: ms per token"))
    assert target["value"] == pytest.approx(10 / 9) and "floor measured at the end of the run" in target["measured"]


def test_the_weight_products_alone_compute_the_chain_of_the_graphs_weights(tiny_export_dir):
    """bench.floor's chain multiplies exactly the decoder's weights, in its order: its output equals
    numpy's products chained the same way (fp32), and the int8 chain stays close to it."""
    import onnxruntime as ort
    from onnx import numpy_helper

    from bench.floor import _matmul_chain

    model = onnx.load(str(tiny_export_dir / "decoder.onnx"))
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    chain, width, count = _matmul_chain(tiny_export_dir / "decoder.onnx")
    x = np.random.default_rng(0).standard_normal((1, 1, width)).astype(np.float32)
    latest = {width: x}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in weights:
            w = weights[node.input[1]]
            y = latest[w.shape[0]] @ w
            latest[w.shape[1]] = y
    expected = y
    got = ort.InferenceSession(chain.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert count == sum(n.op_type == "MatMul" and n.input[1] in weights for n in model.graph.node)
    assert got.shape == expected.shape and np.allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    chain8, width8, count8 = _matmul_chain(tiny_export_dir / "decoder_int8.onnx")
    assert (width8, count8) == (width, count)
    got8 = ort.InferenceSession(chain8.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # int8 weights and activations: the same products up to quantization error
    assert got8.shape == expected.shape
    assert np.corrcoef(got8.ravel(), expected.ravel())[0, 1] > 0.9


def test_the_rest_of_the_step_is_the_step_without_its_products(tiny_export_dir, tmp_path):
    """bench.floor's step without its weight products computes exactly what the optimized graph
    computes once the products' own results are fed in: nothing but the products is taken out."""
    import onnxruntime as ort
    from onnx import helper

    from bench.floor import _decoder_feeds, _without_products

    for name in ("decoder", "decoder_int8"):
        workdir = tmp_path / name
        workdir.mkdir()
        others, fed, taken = _without_products(tiny_export_dir / f"{name}.onnx", 1, workdir)
        optimized = onnx.load(str(workdir / "optimized.onnx"))
        inits = {i.name for i in optimized.graph.initializer}
        products = [n for n in optimized.graph.node if n.op_type in ("MatMul", "DynamicQuantizeMatMul")
                    and n.input[1] in inits]
        assert taken == len(products) == len(fed) > 0
        assert not any(n.op_type in ("MatMul", "DynamicQuantizeMatMul") and n.input[1] in
                       {i.name for i in others.graph.initializer} for n in others.graph.node)
        # the optimized graph, made to return each product's result too
        names = [p.output[0] for p in products]
        optimized.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                                      for n in names if n not in {o.name for o in optimized.graph.output})
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # already optimized
        full = ort.InferenceSession(optimized.SerializeToString(), options, providers=["CPUExecutionProvider"])
        rest = ort.InferenceSession(others.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feeds = _decoder_feeds(full, 3, 5, np.random.default_rng(0))
        got_full = dict(zip([o.name for o in full.get_outputs()], full.run(None, feeds)))
        fed_values = {n: got_full[n[: -len(".product")] if n.endswith(".product") else n] for n in fed}
        assert all(v.shape == fed[n] for n, v in fed_values.items())
        got_rest = dict(zip([o.name for o in rest.get_outputs()], rest.run(None, {**feeds, **fed_values})))
        assert got_rest.keys() == {o.name for o in others.graph.output} and "logits" in got_rest
        for out, value in got_rest.items():
            np.testing.assert_array_equal(value, got_full[out])


def test_readme_table_has_ratios(speed_run, capsys):
    from bench.__main__ import main

    _, out, results = speed_run
    assert main(["table", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| `")]
    assert len(rows) == len(results["runtimes"])
    assert rows[0].startswith("| `pytorch` (fp32) |") and rows[0].count("1.00×") == 2
    assert results["environment"]["date_utc"] in lines[-1] and "onnxruntime" in lines[-1]
    assert ", greedy search" in lines[-1] and lines[0].startswith("| runtime |")


def test_load_latest_finds_the_report(speed_run):
    from service.reports import load_latest

    _, out, results = speed_run
    latest = load_latest(out.parent)
    assert latest is not None and Path(latest["path"]) == out / "results.json"
    assert latest["results"]["runtimes"].keys() == results["runtimes"].keys()
    assert latest["markdown"].startswith("# Speed") and len(latest["plots"]) == 2
    assert load_latest(out / "nothing-here") is None


@pytest.mark.slow
def test_quality_command(tiny_export_dir, tmp_path):
    from bench.__main__ import main

    assert main(["quality", "--model", str(tiny_export_dir), "--sentences", "6", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert results["sentences"] == 6 and results["reference"] == "pytorch"
    ref_texts = results["outputs"]["pytorch"]
    for name, b in results["backends"].items():
        a = b["agreement"]
        assert a["n"] == 6 and 0 <= a["identical"] <= 6
        assert len(a["first_divergence_steps"]) == 6
        assert 0 <= b["vs_references"]["bleu"] <= 100 and 0 <= b["vs_references"]["chrf"] <= 100
        assert len(b["differing"]) == 6 - a["identical"]
        assert len(results["outputs"][name]) == 6
    for name in FP32:
        b = results["backends"][name]
        assert b["agreement"]["identical_share"] == 1.0 and b["identical_text"] == 6 and b["differing"] == []
        assert b["vs_reference_backend"]["bleu"] == pytest.approx(100.0)
        assert results["outputs"][name] == ref_texts
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert md.startswith("# Quality") and "| `ort_fp32_kv_cache` | 6/6 (100.0%)" in md


# --- the app's entry points ---------------------------------------------------------------------


def test_the_app_and_the_request_layer_never_import_bench():
    """app.py, ui/ and service/ use bench/'s results only as files; bench/ may import service/."""
    found = []
    for path in [REPO / "app.py", *sorted((REPO / "ui").glob("*.py")), *sorted((REPO / "service").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "bench"]
    assert found == []


def test_measuring_workers_load_the_protocol_without_the_request_layer():
    """The worker and peer processes import the protocol from runtime/, below the request layer: no
    service/__init__, so no backends or ONNX Runtime in a peer's memory or before our workers' timed
    imports (and none in .venv-bench)."""
    code = ("import sys, bench.worker, bench.peers.worker, runtime.protocol as p; "
            "print(p.measure.__module__, sorted({m.split('.')[0] for m in sys.modules} & "
            "{'service', 'backends', 'onnxruntime', 'torch', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["runtime.protocol", "[]"]


def test_quick_run_for_the_app(tiny_backends, tmp_path):
    from service.quickbench import quick_run
    from service.reports import load_latest, write

    calls = []
    sentences = dev_sentences(3)
    results = quick_run(tiny_backends, sentences, progress=lambda f, msg: calls.append((f, msg)), forced_tokens=4)
    fractions = [f for f, _ in calls]
    assert fractions == sorted(fractions) and fractions[0] == 0 and fractions[-1] == 1.0
    assert list(results["runtimes"]) == list(tiny_backends)
    for name, r in results["runtimes"].items():
        assert r["latency"]["n"] == 3 and r["latency"]["tokens_mean"] == 4.0
        _ordered(r["latency"])
        assert r["throughput"]["3"]["generated_tokens"] == 12
    for name in FP32:
        assert results["runtimes"][name]["comparison"]["identical_to_reference"] == 1.0
    write(results, tmp_path)
    latest = load_latest(tmp_path)
    assert latest["results"]["quick"] is True and "| `ort_fp32_kv_cache` |" in latest["markdown"]
    with pytest.raises(ValueError, match="1 to 20"):
        quick_run(tiny_backends, dev_sentences(21))


def test_spot_check_for_the_app(tiny_backends):
    from service.spotcheck import spot_check

    pairs = read_pairs(DEV_TSV)[:3]
    r = spot_check(tiny_backends, [p.en for p in pairs], references=[p.zh for p in pairs], max_new_tokens=8)
    assert r["reference"] == "pytorch" and list(r["backends"]) == list(tiny_backends)
    for name, b in r["backends"].items():
        _ordered(b["latency_ms"])
        assert b["latency_ms"]["n"] == 3 and len(b["translations"]) == 3
        assert 0 <= b["vs_references"]["bleu"] <= 100
    for name in FP32:
        assert r["backends"][name]["agreement"]["identical_share"] == 1.0
    json.dumps(r)  # downloadable as JSON
    with pytest.raises(ValueError, match="references"):
        spot_check(tiny_backends, ["One.", "Two."], references=["一。"])
    with pytest.raises(ValueError, match="empty"):
        spot_check(tiny_backends, ["One.", "  "])


@pytest.mark.slow
def test_rounds_run_round_robin_and_report_medians(tiny_export_dir, tmp_path):
    """--rounds: every runtime again after all the others, medians reported, each round on record."""
    from bench.speed import run
    from service.speedrun import SpeedOptions

    lines = []
    options = SpeedOptions(forced_tokens=4, batch_sizes=(2,), sweep_lengths=(4,), sweep_sentences=1, warmup=1,
                           rounds=3, floor=False)
    results = run(tiny_export_dir, default_sample(3), options, tmp_path / "out",
                  backend_names=["pytorch", "ort_fp32_kv_cache"], log=lines.append)
    assert results["failed"] == {}
    started = [m for m in lines if "running in its own process" in m]
    assert started == [f"{n}: running in its own process (round {i} of 3) ..."
                       for i in (1, 2, 3) for n in ("pytorch", "ort_fp32_kv_cache")]
    for name, r in results["runtimes"].items():
        per = [json.loads((tmp_path / "out" / "logs" / f"{name}.round{i}.json").read_text()) for i in (1, 2, 3)]
        assert [x["b1_p50_ms"] for x in r["rounds"]] == [x["latency"]["p50"] for x in per]
        assert r["latency"]["p50"] == pytest.approx(float(np.median([x["latency"]["p50"] for x in per])))
        seconds = float(np.median([x["throughput"]["2"]["seconds"] for x in per]))
        assert r["throughput"]["2"]["sentences_per_s"] == pytest.approx(3 / seconds)
        assert r["peak_rss_mb"] == max(x["peak_rss_mb"] for x in per)
        assert set(r["sweep"]) == {"4"} and all(not x["sweep"] for x in per[1:])  # the sweep: round 1 only
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "Rounds: 3, round-robin" in md and md.count(" / ") >= 6


# --- CTranslate2's settings: probed on the machine, the fastest used ------------------------------


def test_ct2_settings_cover_both_gemm_libraries_and_thread_counts():
    from bench.peers import ct2_settings

    assert ct2_settings(2) == [{"gemm": "mkl", "threads": 1}, {"gemm": "mkl", "threads": 2},
                               {"gemm": "dnnl", "threads": 1}, {"gemm": "dnnl", "threads": 2}]
    assert ct2_settings(1) == [{"gemm": "mkl", "threads": 1}, {"gemm": "dnnl", "threads": 1}]
    assert [s["threads"] for s in ct2_settings(8)] == [1, 4, 8, 1, 4, 8]


def test_choose_setting_takes_each_settings_best_and_the_lowest_latency_per_throughput():
    from service.speedrun import choose_setting

    mkl1, mkl2, dnnl2 = {"gemm": "mkl", "threads": 1}, {"gemm": "mkl", "threads": 2}, {"gemm": "dnnl", "threads": 2}
    trials = [{"setting": mkl2, "latency_p50_ms": 200.0, "sentences_per_s": 90.0},
              {"setting": dnnl2, "latency_p50_ms": 30.0, "sentences_per_s": 250.0},
              {"setting": mkl1, "latency_p50_ms": 19.0, "sentences_per_s": 240.0},
              {"setting": dnnl2, "latency_p50_ms": 24.0, "sentences_per_s": 230.0},  # a slower run of the same
              {"setting": mkl2, "latency_p50_ms": 210.0, "sentences_per_s": 100.0}]
    c = choose_setting(trials)
    rows = {json.dumps(r["setting"], sort_keys=True): r for r in c["settings"]}
    d = rows[json.dumps(dnnl2, sort_keys=True)]
    assert (d["latency_p50_ms"], d["sentences_per_s"], d["runs"]) == (24.0, 250.0, 2)  # best of each figure
    assert d["score"] == pytest.approx(24.0 / 250.0)
    assert rows[json.dumps(mkl2, sort_keys=True)]["score"] == pytest.approx(200.0 / 100.0)
    # mkl1: 19/240 = 0.079 beats dnnl2's 0.096; dnnl2 still has the best throughput, and that is said
    assert c["chosen"] == mkl1 and c["fastest_latency"] == mkl1 and c["fastest_throughput"] == dnnl2
    with pytest.raises(ValueError, match="no probe trial"):
        choose_setting([])


def test_the_probe_times_again_only_settings_near_the_best(monkeypatch, tmp_path):
    from bench import speed
    from runtime.protocol import Spec
    from service.speedrun import SpeedOptions

    ran = []

    def fake_run(cmd, out_json, log_path, threads, timeout):  # MKL 10x behind oneDNN, 1 thread failing for oneDNN
        gemm, n = cmd[cmd.index("--ct2-gemm") + 1], int(cmd[cmd.index("--ct2-threads") + 1])
        ran.append((gemm, n))
        if (gemm, n) == ("dnnl", 1):
            return {"error": "exit 1; boom"}
        ms = (100.0 if gemm == "mkl" else 10.0) / n
        return {"latency": {"p50": ms}, "throughput": {"32": {"sentences_per_s": 1000.0 / ms}}}

    monkeypatch.setattr(speed, "_run_subprocess", fake_run)
    (tmp_path / "logs").mkdir()
    Spec(sentences=["a"] * 5, latency_idx=[0, 1, 2, 3, 4], throughput_idx=[0], batch_sizes=[32], max_new_tokens=4,
         forced_tokens=4, sweep_lengths=[], sweep_idx=[], warmup=1, threads=2).save(tmp_path / "spec.json")
    probe = speed._probe_ct2("ct2_int8", ["worker"], tmp_path / "spec.json", SpeedOptions(ct2_probe_rounds=3),
                             tmp_path, log=lambda m: None)
    # pass 1: all four; passes 2 and 3 (reversed, then forward): only oneDNN 2 threads is within 2x
    assert ran == [("mkl", 1), ("mkl", 2), ("dnnl", 1), ("dnnl", 2), ("dnnl", 2), ("dnnl", 2)]
    assert probe["chosen"] == {"gemm": "dnnl", "threads": 2} and len(probe["errors"]) == 1
    assert [r["runs"] for r in probe["settings"]] == [1, 1, 3]


def test_probe_spec_times_a_few_single_sentences_and_one_largest_batch():
    from runtime.protocol import Spec
    from service.speedrun import PROBE_LATENCY_SENTENCES, probe_spec

    spec = Spec(sentences=[f"s{i}" for i in range(40)], latency_idx=list(range(40)), throughput_idx=list(range(39, -1, -1)),
                batch_sizes=[8, 32], max_new_tokens=40, forced_tokens=40, sweep_lengths=[8, 16], sweep_idx=[0, 1],
                warmup=3, threads=2)
    p = probe_spec(spec)
    assert p.latency_idx == list(range(PROBE_LATENCY_SENTENCES)) and p.batch_sizes == [32]
    assert p.throughput_idx == list(range(39, 7, -1)) and p.sweep_lengths == [] and p.warmup == 3
    assert (p.sentences, p.forced_tokens, p.threads) == (spec.sentences, 40, 2)


# --- --paired-rounds: a target between two runtimes decided within back-to-back pairs ------------


def _results_for_targets(kv_thr: float, ct2_thr: float, paired: dict | None) -> dict:
    runtime = lambda thr: {"latency": {"p50": 10.0}, "throughput": {"32": {"sentences": 128, "sentences_per_s": thr}}}  # noqa: E731
    results = {"runtimes": {"ort_fp32_kv_cache": runtime(kv_thr), "ct2_float32": runtime(ct2_thr)},
               "options": {"batch_sizes": [32]}, "environment": {}}
    if paired:
        results["paired"] = paired
    return results


def test_the_median_pair_decides_a_target_and_the_round_robin_ratio_stays_beside_it():
    from service.speedrun import summarize_pairs, targets

    greedy = {"search": "greedy", "num_beams": 1}
    pairs = [{"first": "ort_fp32_kv_cache", "ort_fp32_kv_cache": 120.0, "ct2_float32": 100.0},
             {"first": "ct2_float32", "ort_fp32_kv_cache": 80.0, "ct2_float32": 100.0},
             {"first": "ort_fp32_kv_cache", "ort_fp32_kv_cache": 110.0, "ct2_float32": 100.0}]
    summary = summarize_pairs("ort_fp32_kv_cache", "ct2_float32", pairs, greedy, "32")
    assert [p["ratio"] for p in summary["pairs"]] == pytest.approx([1.2, 0.8, 1.1])
    assert summary["median_ratio"] == pytest.approx(1.1) and (summary["ours_ahead"], summary["n"]) == (2, 3)
    # Round-robin medians 0.9x (a slow minute on our side) but 1.1x within the pairs: the pairs decide.
    name = "ort_fp32_kv_cache, batch 32: at least CTranslate2 float32's throughput"
    t = {x["target"]: x for x in targets(_results_for_targets(90.0, 100.0, {"ort_fp32_kv_cache/ct2_float32": summary}))}[name]
    assert (t["held"], t["decided_by"], t["value"], t["round_robin_value"]) == (True, "paired", pytest.approx(1.1), pytest.approx(0.9))
    assert "1.10x in the median of 3 back-to-back pairs (ours ahead in 2)" in t["measured"] and "0.90x" in t["measured"]
    # And the other way: ahead in the round-robin, behind within the pairs.
    behind = summarize_pairs("ort_fp32_kv_cache", "ct2_float32", [{**p, "ort_fp32_kv_cache": p["ort_fp32_kv_cache"] - 25} for p in pairs],
                             greedy, "32")
    t = {x["target"]: x for x in targets(_results_for_targets(130.0, 100.0, {"ort_fp32_kv_cache/ct2_float32": behind}))}[name]
    assert t["held"] is False and t["value"] == pytest.approx(0.85)
    # Without a paired check (or when it failed) the round-robin ratio decides, and a failure is said.
    t = {x["target"]: x for x in targets(_results_for_targets(90.0, 100.0, None))}[name]
    assert (t["held"], t["decided_by"], t["value"]) == (False, "round-robin", pytest.approx(0.9))
    failed = {"ort_fp32_kv_cache/ct2_float32": {"error": "ct2_float32 in pair 2: exit 1"}}
    t = {x["target"]: x for x in targets(_results_for_targets(110.0, 100.0, failed))}[name]
    assert t["decided_by"] == "round-robin" and "the paired check failed: ct2_float32 in pair 2" in t["measured"]
    # Beam targets compare batch-1 latency: lower is better, so a pair at 0.9 is ours ahead.
    beam = summarize_pairs("ort_int8", "ct2_int8", [{"first": "ort_int8", "ort_int8": 90.0, "ct2_int8": 100.0}],
                           {"search": "beam", "num_beams": 4}, "4")
    assert beam["ours_ahead"] == 1 and beam["figure"] == "batch-1 p50 ms"
    # Beam runs also compare batch-32 throughput with CTranslate2's, decided by that figure's pairs.
    beam_thr = summarize_pairs("ort_fp32_kv_cache", "ct2_float32", pairs, {"search": "beam", "num_beams": 4}, "32",
                               "batch-32 sentences/s")
    assert beam_thr["ours_ahead"] == 2 and beam_thr["median_ratio"] == pytest.approx(1.1)
    results = _results_for_targets(90.0, 100.0, {"ort_fp32_kv_cache/ct2_float32@batch-32 sentences/s": beam_thr})
    results["decoding"] = {"search": "beam", "num_beams": 4}
    t = {x["target"]: x for x in targets(results)}["ort_fp32_kv_cache, batch 32, beam 4: at least CTranslate2 float32's throughput"]
    assert (t["held"], t["decided_by"], t["round_robin_value"]) == (True, "paired", pytest.approx(0.9))


def test_a_paired_spec_times_only_what_its_target_compares():
    from service.speedrun import PAIRED_LATENCY_SENTENCES, SpeedOptions, make_spec, paired_spec

    n = 40
    spec = make_spec([f"s{i}" for i in range(n)], [i % 7 + 1 for i in range(n)], SpeedOptions(batch_sizes=(8, 32)), sweep=True)
    greedy = paired_spec(spec, {"num_beams": 1})
    assert (greedy.latency_idx, greedy.batch_sizes, greedy.sweep_lengths, greedy.warmup) == ([], [32], [], 0)
    assert greedy.throughput_idx == spec.throughput_idx and greedy.sentences == spec.sentences
    beam = paired_spec(spec, {"num_beams": 4})  # batch-1 latency, and the largest batch's throughput
    assert beam.latency_idx == spec.latency_idx[:PAIRED_LATENCY_SENTENCES] and beam.batch_sizes == [32]
    assert beam.warmup == spec.warmup and beam.sweep_idx == []


@pytest.mark.slow
def test_paired_rounds_time_each_pair_back_to_back_first_alternating(tiny_export_dir, tmp_path):
    """Beam 2, our KV cache against generate() (the transformers peer, in this environment): the
    paired check's pairs are real processes whose figures are the ratio's two sides."""
    from bench.speed import run
    from service.speedrun import SpeedOptions

    lines = []
    options = SpeedOptions(max_new_tokens=6, latency_sentences=3, batch_sizes=(3,), sweep_lengths=(), warmup=1,
                           floor=False, paired_rounds=3)
    out = tmp_path / "out"
    results = run(tiny_export_dir, default_sample(3), options, out, backend_names=["ort_fp32_kv_cache"],
                  peer_names=["transformers"], peer_cache=tmp_path / "peers", log=lines.append, num_beams=2)
    assert results["failed"] == {}
    p = results["paired"]["ort_fp32_kv_cache/transformers"]
    throughput = results["paired"]["ort_fp32_kv_cache/transformers@batch-3 sentences/s"]
    assert [q["first"] for q in p["pairs"]] == ["ort_fp32_kv_cache", "transformers", "ort_fp32_kv_cache"]
    for k, q in enumerate(p["pairs"], 1):
        sides = {name: json.loads((out / "logs" / f"paired.ort_fp32_kv_cache-transformers.{k}.{name}.json").read_text())
                 for name in ("ort_fp32_kv_cache", "transformers")}
        for name, r in sides.items():
            assert r["latency"]["n"] == 3 and list(r["throughput"]) == ["3"] and r["sweep"] == {}
            assert q[name] == r["latency"]["p50"]
            assert throughput["pairs"][k - 1][name] == r["throughput"]["3"]["sentences_per_s"]
        assert q["ratio"] == pytest.approx(q["ort_fp32_kv_cache"] / q["transformers"])
    assert p["median_ratio"] == pytest.approx(float(np.median([q["ratio"] for q in p["pairs"]])))
    assert throughput["figure"] == "batch-3 sentences/s" and throughput["n"] == 3
    target = next(t for t in results["targets"] if "generate(num_beams=2)" in t["target"])
    assert target["decided_by"] == "paired" and target["value"] == p["median_ratio"]
    assert target["held"] == (p["median_ratio"] <= 0.6)
    assert any(m.startswith("paired check ort_fp32_kv_cache/transformers (batch-1 p50 ms): median pair") for m in lines)
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "## Paired target checks" in md and f"| {p['median_ratio']:.2f}x | {p['ours_ahead']} of 3 |" in md


# --- --num-beams: every runtime, ours and the peers, at one beam size --------------------------


@pytest.mark.parametrize("value", ["0", "-1", str(MAX_BEAMS + 1), "two", "1.5"])
def test_num_beams_out_of_range_is_an_argparse_error(value, capsys):
    from bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["speed", "--num-beams", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--num-beams" in err and f"1..{MAX_BEAMS}" in err and "'model'" in err


@pytest.mark.parametrize("argv, message", [
    (["--num-beams", "2", "--sweep", "4,8"], "greedy"),  # the sweep is a greedy measurement: refused, not relabelled
    (["--length-penalty", "0.6"], "beam search only"),  # greedy: a beam option is refused
    (["--num-beams", "1", "--early-stopping", "never"], "beam search only"),
    (["--paired-rounds", "4"], "add --peers"),  # nothing to pair a backend with: refused, not silently skipped
])
def test_speed_refuses_options_that_do_not_fit_the_search(argv, message, capsys):
    from bench.__main__ import main

    assert main(["speed", "--model", "/nonexistent", *argv]) == 2  # refused before the model is even looked at
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_decoding_options_reach_every_worker_command():
    from bench import peers
    from bench.speed import decode_args

    greedy = {"search": "greedy", "num_beams": 1, "label": "greedy"}
    beam = {"search": "beam", "num_beams": 4, "label": "beam 4", "length_penalty": 1.0, "early_stopping": False,
            "given": {}}
    assert decode_args(greedy) == decode_args(greedy, ct2=True) == ["--num-beams", "1"]
    assert decode_args(beam) == ["--num-beams", "4"]  # the rest: the export's generation config decides
    assert decode_args(beam, ct2=True) == ["--num-beams", "4", "--length-penalty", "1.0"]  # ct2 reads no config
    given = {**beam, "length_penalty": 0.6, "early_stopping": "never", "given": {"length_penalty": 0.6, "early_stopping": "never"}}
    assert decode_args(given) == ["--num-beams", "4", "--length-penalty", "0.6", "--early-stopping", "never"]
    assert decode_args(given, ct2=True) == ["--num-beams", "4", "--length-penalty", "0.6"]
    # ... and what each peer does with them.
    assert peers.generate_kwargs({"num_beams": 1}) == {"num_beams": 1, "do_sample": False, "num_return_sequences": 1,
                                                       "forced_eos_token_id": None}
    assert peers.generate_kwargs({"num_beams": 4, "early_stopping": "never"}) == {
        "num_beams": 4, "do_sample": False, "num_return_sequences": 1, "early_stopping": "never"}
    assert peers.ct2_kwargs({"num_beams": 4, "length_penalty": 0.6}) == {"beam_size": 4, "length_penalty": 0.6}
    assert peers.ct2_kwargs(None) == {"beam_size": 1}
    # The model's repetition control: CTranslate2 reads no generation config, so it is given it.
    ruled = {**beam, "repetition_penalty": 1.2, "no_repeat_ngram_size": 2}
    assert decode_args(ruled) == ["--num-beams", "4"]
    assert decode_args(ruled, ct2=True) == ["--num-beams", "4", "--repetition-penalty", "1.2",
                                            "--no-repeat-ngram-size", "2", "--length-penalty", "1.0"]
    assert decode_args({**greedy, "repetition_penalty": 1.2, "no_repeat_ngram_size": 0}, ct2=True) == [
        "--num-beams", "1", "--repetition-penalty", "1.2"]
    assert peers.ct2_kwargs({"num_beams": 4, "repetition_penalty": 1.2, "no_repeat_ngram_size": 2}) == {
        "beam_size": 4, "repetition_penalty": 1.2, "no_repeat_ngram_size": 2}


def test_num_beams_model_takes_the_export_generation_config(tiny_export_dir):
    from backends import load_manifest
    from bench.speed import resolve_decoding

    manifest = load_manifest(tiny_export_dir)
    assert manifest.generation.num_beams == 1  # the fixture's config: greedy
    d = resolve_decoding(manifest, "model")
    assert (d["label"], d["num_beams_from"]) == ("greedy", "the export's generation config (--num-beams model)")
    d = resolve_decoding(manifest, 3, early_stopping="never")
    assert (d["label"], d["length_penalty"], d["early_stopping"], d["given"]) == ("beam 3", 1.0, "never",
                                                                                   {"early_stopping": "never"})
    for bad in (0, MAX_BEAMS + 1, "3", True):
        with pytest.raises(ValueError, match=rf"1\.\.{MAX_BEAMS}"):
            resolve_decoding(manifest, bad)
    with pytest.raises(ValueError, match="beam search only"):
        resolve_decoding(manifest, "model", length_penalty=0.6)


def _generate_ids(model, tokenizer, text: str, **kwargs) -> list[int]:
    """generate() called directly: ids after the decoder start, up to and with eos, padding dropped."""
    import torch

    with torch.inference_mode():
        row = model.generate(**tokenizer([text], return_tensors="pt"), **kwargs)[0, 1:].tolist()
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    ids = []
    for t in row:
        if t == pad:
            break
        ids.append(t)
        if t == eos:
            break
    return ids


@pytest.fixture(scope="module")
def beam_run(tiny_export_dir, tmp_path_factory):
    from bench.speed import run
    from service.speedrun import SpeedOptions

    out = tmp_path_factory.mktemp("beam")
    lines = []
    options = SpeedOptions(max_new_tokens=6, batch_sizes=(3,), warmup=1, floor=False)  # default sweep lengths
    results = run(tiny_export_dir, default_sample(3), options, out / "run",
                  backend_names=["pytorch", "ort_fp32_kv_cache"], peer_names=["transformers"],
                  peer_cache=out / "peers", log=lines.append, num_beams=2)
    return out / "run", results, lines


def test_speed_at_beam_2_runs_every_runtime_at_beam_2(beam_run, tiny_model_dir):
    out, results, lines = beam_run
    assert results["failed"] == {}
    assert results["options"]["num_beams"] == 2
    assert results["decoding"] == {"search": "beam", "num_beams": 2, "label": "beam 2", "num_beams_from": "the command line",
                                   "length_penalty": 1.0, "early_stopping": False, "given": {},
                                   "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
    assert list(results["runtimes"]) == ["pytorch", "ort_fp32_kv_cache", "transformers"]
    for name, r in results["runtimes"].items():
        assert r["decoding"] == {"num_beams": 2}, name
        cmd = r["command"]
        assert cmd[cmd.index("--num-beams") + 1] == "2", name
        assert r["latency"]["n"] == 3 and r["throughput"]["3"]["sentences"] == 3
    assert results["runtimes"]["transformers"]["call"]["num_beams"] == 2
    assert results["runtimes"]["transformers"]["command"][2:4] == ["bench.peers", "worker"]
    # Our beam search decodes exactly as generate(): the KV cache and transformers agree with PyTorch.
    for name in ("ort_fp32_kv_cache", "transformers"):
        assert results["runtimes"][name]["comparison"]["identical_to_reference"] == 1.0, name
    # The sweep, a greedy measurement, is skipped and said to be, not run and mislabelled.
    assert results["options"]["sweep_lengths"] == [] and "greedy" in results["sweep_skipped"]
    assert all(r["sweep"] == {} for r in results["runtimes"].values())
    assert any(m.startswith("length sweep skipped:") for m in lines) and "decoding: beam 2 for every runtime" in lines
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "Decoding: beam 2. Beam search with 2 beams for every runtime" in md and "Greedy search" not in md
    assert "No output-length sweep" in md
    not_measured = next(x for x in md.splitlines() if x.startswith("Not measured:"))
    assert "beam search" not in not_measured
    assert "Beam search with 2 beams" in results["what_is_timed"]
    # Beam targets against generate(num_beams=2), the transformers peer; CTranslate2 did not run.
    targets = {t["target"]: t for t in results["targets"]}
    rt = results["runtimes"]
    vs_generate = targets["ort_fp32_kv_cache, batch 1, beam 2: at most 0.6x generate(num_beams=2)'s latency"]
    assert vs_generate["value"] == pytest.approx(rt["ort_fp32_kv_cache"]["latency"]["p50"] / rt["transformers"]["latency"]["p50"])
    assert vs_generate["held"] == (vs_generate["value"] <= 0.6)
    assert targets["ort_int8, batch 1, beam 2: no slower than CTranslate2 int8 beam_size=2"]["held"] is None
    assert not any("floor" in t for t in targets)  # a greedy measurement
    # Batch-3 throughput against CTranslate2 at beam 2 is a target too: not measured without CTranslate2.
    for ours, label in (("ort_fp32_kv_cache", "float32"), ("ort_int8", "int8")):
        assert targets[f"{ours}, batch 3, beam 2: at least CTranslate2 {label}'s throughput"]["held"] is None


def test_the_transformers_peer_at_beam_2_is_generate_at_beam_2(beam_run, tiny_model_dir):
    from transformers import MarianMTModel, MarianTokenizer

    _, results, _ = beam_run
    model = MarianMTModel.from_pretrained(tiny_model_dir).eval()
    tokenizer = MarianTokenizer.from_pretrained(tiny_model_dir)
    direct = [_generate_ids(model, tokenizer, p.en, num_beams=2, max_new_tokens=6) for p in default_sample(3)]
    assert [o["ids"] for o in results["runtimes"]["transformers"]["outputs"]] == direct  # the runner's batch-1 outputs


def test_table_of_a_beam_run_says_beam(beam_run, capsys):
    from bench.__main__ import main

    out, _, _ = beam_run
    assert main(["table", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| runtime, beam 2 |")
    assert "beam search with 2 beams (length_penalty 1.0, early_stopping False)" in lines[-1]
    assert "greedy" not in "\n".join(lines)


# --- peers (only where the peer environment exists: `make bench-venv`) ---------------------------


@pytest.mark.skipif(not PEER_PYTHON.is_file(), reason="no peer environment (.venv-bench); `make bench-venv` creates it")
def test_ctranslate2_peer_matches_pytorch(tiny_export_dir, peer_cache, tmp_path):
    from bench import peers
    from bench.speed import run
    from service.speedrun import SpeedOptions

    pairs = default_sample(4)
    options = SpeedOptions(forced_tokens=4, batch_sizes=(2,), sweep_lengths=(), warmup=1, paired_rounds=2,
                           ct2_probe_rounds=1)
    results = run(tiny_export_dir, pairs, options, tmp_path / "out", backend_names=["pytorch", "ort_fp32_kv_cache"],
                  peer_names=["ct2_float32", "ct2_int8"], peer_python=PEER_PYTHON, peer_cache=peer_cache,
                  log=lambda m: None)
    assert results["failed"] == {}
    # Each CTranslate2 peer: its four settings probed once each, in its own process, the chosen one
    # the one with the lowest latency per throughput, and every round and pair ran with it.
    logs = tmp_path / "out" / "logs"
    for name in ("ct2_float32", "ct2_int8"):
        probe = results["ct2_settings"][name]
        assert [r["setting"] for r in probe["settings"]] == peers.ct2_settings(2) and probe["errors"] == []
        for row in probe["settings"]:
            st = row["setting"]
            own = json.loads((logs / f"probe.{name}.{st['gemm']}-{st['threads']}.1.json").read_text())
            assert own["info"]["ct2_setting"] == st and own["info"]["threads"] == st["threads"]
            # CTranslate2's own load log says the GEMM library asked for is the one it took
            assert own["info"]["dispatch"]["Use Intel MKL"] == ("true" if st["gemm"] == "mkl" else "false")
            assert own["info"]["dispatch"]["SGEMM backend"].startswith("MKL" if st["gemm"] == "mkl" else "DNNL")
            assert row["latency_p50_ms"] == own["latency"]["p50"] and own["latency"]["n"] == 4
        assert probe["chosen"] == min(probe["settings"], key=lambda r: r["latency_p50_ms"] / r["sentences_per_s"])["setting"]
        assert results["runtimes"][name]["info"]["ct2_setting"] == probe["chosen"]
        assert results["runtimes"][name]["command"][-4:] == peers.ct2_setting_args(probe["chosen"])
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "## CTranslate2 settings, probed on this machine" in md and md.count("| **yes** |") == 2
    # The batch target against CTranslate2, decided by the paired check (ort_int8 did not run: its
    # target is not paired), with the round-robin ratio and the ORT graphs' own throughput beside it.
    rt = results["runtimes"]
    assert list(results["paired"]) == ["ort_fp32_kv_cache/ct2_float32"]
    paired = results["paired"]["ort_fp32_kv_cache/ct2_float32"]
    assert paired["figure"] == "batch-2 sentences/s" and [q["first"] for q in paired["pairs"]] == ["ort_fp32_kv_cache", "ct2_float32"]
    assert all(q["ratio"] == pytest.approx(q["ort_fp32_kv_cache"] / q["ct2_float32"]) for q in paired["pairs"])
    target = next(t for t in results["targets"] if t["target"] == "ort_fp32_kv_cache, batch 2: at least CTranslate2 float32's throughput")
    kv, ct2 = rt["ort_fp32_kv_cache"]["throughput"]["2"], rt["ct2_float32"]["throughput"]["2"]
    assert target["value"] == paired["median_ratio"] and target["held"] == (paired["median_ratio"] >= 1.0)
    assert target["round_robin_value"] == pytest.approx(kv["sentences_per_s"] / ct2["sentences_per_s"])
    graphs = kv["sentences"] / kv["engine_seconds"]
    assert graphs > kv["sentences_per_s"] and "engine_seconds" not in ct2  # a peer's loop cannot be told apart
    assert f"the ORT graphs alone: {graphs:.1f} sentences/s = {graphs / ct2['sentences_per_s']:.2f}x" in target["measured"]
    for name in ("ct2_float32", "ct2_int8"):
        r = results["runtimes"][name]
        assert r["kind"] == "peer" and r["latency"]["n"] == 4 and r["latency"]["tokens_mean"] == 4.0
        _ordered(r["latency"])
        assert r["throughput"]["2"]["generated_tokens"] == 16 and r["size_bytes"] > 0
    assert results["runtimes"]["ct2_float32"]["comparison"]["identical_to_reference"] == 1.0
    assert all(results["runtimes"][n]["tokenization_mismatches"] == [] for n in ("ct2_float32", "ct2_int8"))
    assert "ctranslate2" in results["environment"]["peer_environment"]["versions"]


@pytest.mark.skipif(not PEER_PYTHON.is_file(), reason="no peer environment (.venv-bench); `make bench-venv` creates it")
def test_peers_in_their_environment_run_at_the_beam_size(tiny_export_dir, peer_cache, tmp_path):
    from bench.speed import run
    from service.speedrun import SpeedOptions

    options = SpeedOptions(max_new_tokens=6, batch_sizes=(2,), sweep_lengths=(), warmup=1, floor=False,
                           ct2_probe_rounds=0)
    peers = ["optimum_fp32", "ct2_float32"]
    results = run(tiny_export_dir, default_sample(2), options, tmp_path / "out", backend_names=["pytorch"],
                  peer_names=peers, peer_python=PEER_PYTHON, peer_cache=peer_cache, log=lambda m: None,
                  num_beams=2)
    assert results["failed"] == {}
    optimum, ct2 = (results["runtimes"][n] for n in peers)
    assert optimum["call"]["num_beams"] == 2 and optimum["decoding"] == {"num_beams": 2}
    # CTranslate2 reads no generation config: the export's length_penalty is passed to it.
    assert ct2["call"] == {"beam_size": 2, "length_penalty": 1.0}
    # No probe: CTranslate2's own GEMM choice with the run's threads, as the command says.
    assert "ct2_settings" not in results and ct2["info"]["ct2_setting"] == {"gemm": "auto", "threads": 2}
    assert "--ct2-gemm" not in ct2["command"]
    assert optimum["comparison"]["identical_to_reference"] == 1.0  # generate() at beam 2, as our backends
    assert 0.0 <= ct2["comparison"]["identical_to_reference"] <= 1.0  # its own scoring: agreement, not identity


def test_a_workers_peak_rss_is_its_own_not_its_launchers():
    """Linux keeps getrusage's ru_maxrss across fork and exec, so a worker launched by a process
    that once held 800 MB reported 800 MB whatever it ran (every runtime "3396 MB" after an export in
    the benchmark's own process). The worker's figure must be its own address space's peak."""
    child = ("import json, resource; import runtime.memory as p; p.reset_peak_rss(); "
             "print(json.dumps({'peak': p.peak_rss_mb(), 'ru_maxrss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6}))")
    parent = (
        "import subprocess, sys\n"
        "big = bytearray(800 * 10**6)\n"
        "for i in range(0, len(big), 4096): big[i] = 1  # resident, not just reserved\n"
        "del big\n"
        f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True, check=True).stdout)\n"
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    figures = json.loads(out.stdout.strip())
    assert 5 < figures["peak"] < 200, figures  # a bare interpreter and numpy: tens of MB
    # What the old measurement read in the same child: the launcher's 800 MB (shows the test can fail).
    assert figures["ru_maxrss"] > 800, figures


def test_a_sidecar_without_a_graph_leaves_its_backend_out_by_name(tiny_export_dir):
    """An export whose sidecar lists no full graph (older, or edited) runs the other backends by
    default, and the benchmarks name why the single-step one is not among them."""
    from backends import load_manifest, runnable_backends

    manifest = load_manifest(tiny_export_dir)
    assert "ort_fp32_single_step" in runnable_backends(manifest)
    del manifest.data["graphs"]["full"]
    names, skipped = default_backends(manifest)
    assert "ort_fp32_single_step" not in names and names[:2] == ["pytorch", "ort_fp32_kv_cache"]
    assert skipped == {"ort_fp32_single_step": "it needs graph 'full', which is not in this export"}
