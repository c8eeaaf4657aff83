"""The corpus engine (bench/engine): local and Ray give the same per-sentence results and reports.

On the tiny export, over the first dev sentences, in small shards: the local engine's sums equal
`compare_outputs` over the same outputs; the Ray engine on a local cluster and on a two-node
cluster simulated here (`ray.cluster_utils.Cluster`, the export shipped to the nodes) writes
byte-for-byte the same per-sentence tables; an interrupted run resumes; a killed actor loses and
duplicates nothing; bad rows are named; the app, the backends and the request layer never
import ray. One local Ray runtime serves the module's tests; the two-node test runs last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from corpus import DEV_TSV, dev_pairs

REPO = Path(__file__).resolve().parent.parent
N, SHARD = 24, 6  # sentences, shard size: four shards


def _tables(out: Path) -> dict:
    """Every shard's per-sentence table, without the metadata (which names the worker and its times)."""
    import pyarrow.parquet as pq

    return {p.stem: pq.read_table(p).replace_schema_metadata(None) for p in sorted((out / "shards").glob("*.parquet"))}


def _same_results(a: dict, b: dict) -> None:
    """Equal but for who ran it, when, and how fast."""
    assert a.keys() == b.keys()
    for key in a.keys() - {"environment", "engine", "workers"}:
        if key == "backends":
            for name in a[key]:
                strip = lambda e: {k: v for k, v in e.items() if k not in ("seconds", "info")}  # noqa: E731
                assert strip(a[key][name]) == strip(b[key][name]), name
        else:
            assert a[key] == b[key], key


def _run(export, out, engine="local", limit=N, **kw):
    from bench import quality
    from bench.engine import EngineOptions

    on_shard, input_path = kw.pop("on_shard", None), kw.pop("input_path", DEV_TSV)
    options = EngineOptions(engine=engine, shard_size=kw.pop("shard_size", SHARD), progress=False, **kw)
    return quality.run(export, input_path, out, options=options, limit=limit, max_new_tokens=32,
                       on_shard=on_shard, log=lambda m: None)


@pytest.fixture(scope="module")
def local_run(tiny_export_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    return out, _run(tiny_export_dir, out)


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        # "local": another test file's Cluster on this machine (test_serve.py, on the other xdist
        # worker) would otherwise be joined, and num_cpus refused
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def test_the_sums_over_shards_equal_compare_outputs(local_run):
    """The engine adds shards up; compare_outputs takes every output at once: the same numbers."""
    from service.spotcheck import compare_outputs

    out, results = local_run
    tables = list(_tables(out).values())
    rows = [r for t in tables for r in t.to_pylist()]
    assert [r["row"] for r in rows] == list(range(N))
    names = list(results["backends"])
    outputs = {n: [SimpleNamespace(token_ids=r[f"{n}_ids"], text=r[f"{n}_text"]) for r in rows] for n in names}
    expected = json.loads(json.dumps(compare_outputs(outputs, [r["en"] for r in rows], [r["zh"] for r in rows], "pytorch")))
    got = json.loads(json.dumps(results["backends"]))
    for name in names:
        for extra in ("seconds", "info", "hit_max_new_tokens", "differing_total"):
            got[name].pop(extra)
        assert got[name] == expected[name], name
        assert results["outputs"][name] == [r[f"{name}_text"] for r in rows]
    assert results["sentences"] == N and results["engine"]["shards"] == N // SHARD
    assert results["backends"]["ort_fp32_kv_cache"]["agreement"]["identical"] == N  # fp32: exact


def test_the_ray_engine_gives_the_local_engines_results(local_run, ray_local, tmp_path):
    from bench.__main__ import main

    out_local, local = local_run
    out = tmp_path / "ray"
    assert main(["quality", "--model", str(local["model"]["export"]), "--sentences", str(N), "--shard-size",
                 str(SHARD), "--max-new-tokens", "32", "--engine", "ray", "--out", str(out)]) == 0
    ray_results = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert _tables(out) == _tables(out_local)
    _same_results(json.loads(json.dumps(local)), ray_results)
    e = ray_results["engine"]
    assert (e["name"], e["nodes"], e["actors"], e["threads_per_actor"], e["model_transfer"]) == ("ray", 1, 2, 1, "shared")
    assert e["sentences_translated"] == N and e["shards"] == N // SHARD and e["duplicate_shards_dropped"] == 0
    assert sum(w["shards"] for w in ray_results["workers"]) == N // SHARD
    md = (out / "report.md").read_text(encoding="utf-8")
    assert md.startswith("# Quality") and "- Engine: ray (ray " in md and "2 actor(s) x 1 thread(s)" in md
    assert f"| `ort_fp32_kv_cache` | {N}/{N} (100.0%)" in md


def test_an_interrupted_run_resumes_where_it_stopped(local_run, ray_local, tiny_export_dir, tmp_path):
    out_local, _ = local_run
    out = tmp_path / "resume"

    class Stop(Exception):
        pass

    def stop_after_two(summary, seen=[]):  # noqa: B006  (counts across calls)
        seen.append(summary["shard"])
        if len(seen) == 2:
            raise Stop

    with pytest.raises(Stop):
        _run(tiny_export_dir, out, engine="ray", on_shard=stop_after_two)
    assert len(list((out / "shards").glob("*.parquet"))) == 2
    with pytest.raises(ValueError, match="shard_size"):  # the folder belongs to that run
        _run(tiny_export_dir, out, engine="ray", shard_size=SHARD + 1)
    results = _run(tiny_export_dir, out, engine="ray")
    e = results["engine"]
    assert (e["shards_resumed"], e["sentences_translated"]) == (2, N - 2 * SHARD)
    assert _tables(out) == _tables(out_local)
    assert results["backends"]["pytorch"]["agreement"]["n"] == N


def test_a_killed_actor_loses_and_duplicates_nothing(local_run, ray_local, tiny_export_dir, tmp_path):
    out_local, _ = local_run
    out = tmp_path / "kill"
    killed = []

    def kill_first_worker(summary):
        if not killed:  # that actor is already translating its next shard
            killed.append(summary["worker"]["pid"])
            os.kill(killed[0], signal.SIGKILL)

    results = _run(tiny_export_dir, out, engine="ray", on_shard=kill_first_worker)
    tables = _tables(out)
    rows = [r for t in tables.values() for r in t.column("row").to_pylist()]
    assert sorted(rows) == list(range(N)) and len(rows) == N  # every sentence, once
    local_rows = {r["row"]: r for t in _tables(out_local).values() for r in t.to_pylist()}
    assert all(r == local_rows[r["row"]] for t in tables.values() for r in t.to_pylist())
    assert sum(w["shards"] for w in results["workers"]) == N // SHARD == results["engine"]["shards"]
    assert len({w["pid"] for w in results["workers"]}) >= 2 and killed[0] in {w["pid"] for w in results["workers"]}


@pytest.mark.parametrize("name,content,where", [
    ("bad.tsv", "en\tzh\nHello.\t你好。\nOne field only\nBye.\t再见。\n", "bad.tsv:3: expected 2 tab-separated fields"),
    ("bad.jsonl", '{"en": "Hello.", "zh": "你好。"}\n{"en": "", "zh": "空"}\n', "bad.jsonl:2: the `en` field is empty"),
    ("bad.parquet", None, "bad.parquet: row 2: the `zh` field is missing"),
])
def test_bad_rows_are_named_before_anything_runs(name, content, where, tiny_export_dir, tmp_path, capsys):
    from bench.__main__ import main

    path = tmp_path / name
    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"en": ["Hello.", "Bye."], "zh": ["你好。", None]}), path)
    else:
        path.write_text(content, encoding="utf-8")
    assert main(["quality", "--model", str(tiny_export_dir), "--input", str(path), "--engine", "ray",
                 "--out", str(tmp_path / "out")]) == 2
    assert where in capsys.readouterr().err
    assert not (tmp_path / "out" / "shards").exists()


def test_jsonl_and_parquet_give_the_tsv_results(local_run, tiny_export_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_local, _ = local_run
    pairs = dev_pairs(N)
    folder = tmp_path / "corpus"
    folder.mkdir()
    half = N // 2  # a multiple of SHARD: the same shards as the TSV run, so the same batches
    with open(folder / "a.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"en": p.en, "zh": p.zh}, ensure_ascii=False) + "\n" for p in pairs[:half])
    pq.write_table(pa.table({"en": [p.en for p in pairs[half:]], "zh": [p.zh for p in pairs[half:]]}),
                   folder / "b.parquet")
    out = tmp_path / "formats"
    results = _run(tiny_export_dir, out, input_path=folder, limit=None)
    assert results["input"]["rows"] == [half, half] and results["sentences"] == N
    strip = lambda tables: [t.drop_columns(["file", "row"]) for t in tables.values()]  # noqa: E731
    assert strip(_tables(out)) == strip(_tables(out_local))
    assert results["backends"]["ort_int8"]["differing"] == local_run[1]["backends"]["ort_int8"]["differing"]


def test_the_shipped_export_is_checked_on_the_node(tiny_export_dir, tmp_path):
    from backends import ManifestError, load_backends
    from bench.engine.model_files import digests, materialize, shipment_files

    names = ["pytorch", "ort_int8"]
    files = shipment_files(tiny_export_dir, names)
    assert {"export/manifest.json", "export/encoder_int8.onnx", "export/decoder_int8.onnx", "export/source.spm"} <= set(files)
    assert "export/full.onnx" not in files and any(n.startswith("source/model.") for n in files)
    digest = digests(files)
    export, info = materialize(tmp_path / "node", digest, lambda name: files[name].read_bytes())
    assert info["written_here"] and info["checked"] == len(files)
    again, info2 = materialize(tmp_path / "node", digest, lambda name: pytest.fail("fetched twice"))
    assert again == export and not info2["written_here"]
    backends = load_backends(export, names=tuple(names))  # the copy's sidecar points at the copied weights
    assert json.loads((export / "manifest.json").read_text())["source_model"]["path"].startswith(str(tmp_path))
    assert backends["ort_int8"].translate(["Hello."], max_new_tokens=4)[0].token_ids

    def corrupt(name):
        data = bytearray(files[name].read_bytes())
        if name == "export/decoder_int8.onnx":
            data[len(data) // 2] ^= 0xFF
        return bytes(data)

    with pytest.raises(ManifestError, match="decoder_int8.onnx was modified after export"):
        materialize(tmp_path / "other-node", digest, corrupt)
    assert not list((tmp_path / "other-node").glob("*/ready"))


def test_the_app_backends_and_service_never_import_ray():
    code = ("import sys; import app, backends, service, bench.quality, bench.engine, bench.__main__; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_without_ray_the_ray_engine_says_what_to_install(tiny_export_dir, tmp_path):
    code = ("import sys; sys.modules['ray'] = None; from bench.__main__ import main; "
            f"sys.exit(main(['quality', '--model', {str(tiny_export_dir)!r}, '--sentences', '2', '--engine', 'ray', "
            f"'--out', {str(tmp_path / 'out')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr
    assert "pip install -r requirements-engine.txt (ray[data]==2.60.0" in out.stderr


@pytest.mark.ray
def test_a_two_node_cluster_gets_the_export_shipped(local_run, tiny_export_dir, tmp_path):
    """Last: it replaces the module's local runtime with a simulated cluster of two 1-CPU nodes."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    ray.shutdown()
    out_local, local = local_run
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        out = tmp_path / "two-nodes"
        results = _run(tiny_export_dir, out, engine="ray", address=cluster.address, node_cache=str(tmp_path / "cache"))
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert _tables(out) == _tables(out_local)
    _same_results(json.loads(json.dumps(local)), results)
    e = results["engine"]
    assert (e["nodes"], e["cluster_cpus"], e["actors"], e["model_transfer"]) == (2, 2, 2, "ship")
    for w in results["workers"]:
        assert w["model_files"]["mode"] == "ship" and w["model_files"]["path"].startswith(str(tmp_path / "cache"))
    assert len(list((tmp_path / "cache").glob("*/ready"))) == 1  # one copy (both nodes share this disk)
