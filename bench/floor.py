"""The memory-bandwidth floor of one decode step, measured on this machine.

At batch 1 a decoder step multiplies one vector by every weight matrix of the decoder and the
output layer: each weight byte is read once per token and there is too little arithmetic to hide
the reads. So no runtime can beat (bytes of weights read per step) / (read bandwidth), and how
close a backend's per-token time comes to it says how much is left to gain.

Bandwidth is measured with read-bound kernels over 512 MB of float32 (far more than any cache),
with the benchmark's thread count: ONNX Runtime's ReduceSum, and matrix-vector products through
numpy's BLAS and, when installed, PyTorch (the very shape of a batch-1 decode step). Each is the
median of 7 passes after a warm-up; the fastest sets the floor, so the floor errs on the
demanding side. Bytes per step are the decoder graph's initializers (all of them are read every step,
the tied embedding/output table included; the cross-attention keys/values come from the encoder
once per sentence and are not weights).

What ONNX Runtime's own kernels can do against that floor is measured too (`matmuls_alone`): the
decoder graph's weight products alone, each on its own weights, in the graph's order, each fed
the previous product of matching width (a chain, as in the step), in one ORT session with the
backends' settings: fp32 MatMuls, and for the int8 graph DynamicQuantizeMatMul (what ORT fuses
its quantized MatMuls into). Nothing else of the step runs, so a backend cannot come closer to
the floor than this; a target below it is out of reach of those kernels on this machine.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np

PROBE_MB = 512


def _median_gbps(fn, mb: int, passes: int) -> dict:
    fn()  # warm-up: pages faulted in, threads started
    seconds = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return {"gb_per_s": round(mb / 1024 / statistics.median(seconds), 2),
            "best_gb_per_s": round(mb / 1024 / min(seconds), 2)}


def read_bandwidth_gbps(threads: int, mb: int = PROBE_MB, passes: int = 7) -> dict:
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)],
        "read",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = ort.OrtValue.ortvalue_from_numpy(np.ones(mb * 2**20 // 4, dtype=np.float32))
    probes = {"ort_reduce_sum": _median_gbps(lambda: session.run_with_ort_values(["y"], {"x": x}), mb, passes)}
    del x, session
    w = np.ones((mb * 2**20 // 4 // 2048, 2048), dtype=np.float32)  # (n, 2048)
    v = np.ones(2048, dtype=np.float32)
    probes["numpy_blas_gemv"] = _median_gbps(lambda: w @ v, mb, passes)
    del w
    try:  # PyTorch's matrix-vector product reads faster than numpy's BLAS here; use it when present
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            wt = torch.ones(mb * 2**20 // 4 // 2048, 2048)
            vt = torch.ones(2048)
            probes["torch_mv"] = _median_gbps(lambda: torch.mv(wt, vt), mb, passes)
            del wt
        finally:
            torch.set_num_threads(before)
    best = max(probes.values(), key=lambda p: p["gb_per_s"])
    return {"gb_per_s": best["gb_per_s"], "probes": probes, "probe_mb": mb, "passes": passes, "threads": threads,
            "note": "numpy's BLAS runs with its default thread count (every core); torch and ORT with `threads`"}


def _matmul_chain(path: Path):
    """The graph's weight products alone, chained (see the module docstring): (model, input width)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(path))
    inits = {i.name: i for i in model.graph.initializer}
    nodes, used, width, last = [], [], None, None
    latest: dict[int, str] = {}  # width -> the latest product of that width
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[1] in inits and inits[node.input[1]].data_type == TensorProto.FLOAT:
            weights = [node.input[1]]
            k, n = inits[node.input[1]].dims
            op, domain = "MatMul", ""
        elif node.op_type == "MatMulInteger" and node.input[1] in inits and node.input[1].endswith("_quantized"):
            scale = node.input[1][: -len("_quantized")] + "_scale"
            if scale not in inits or len(node.input) < 4 or node.input[3] not in inits:
                continue
            weights = [node.input[1], scale, node.input[3]]
            k, n = inits[node.input[1]].dims
            op, domain = "DynamicQuantizeMatMul", "com.microsoft"
        else:
            continue
        if width is None:
            width = k
            latest[k] = "x"
        if k not in latest:
            raise ValueError(f"{path.name}: a weight product of width {k} has no input of that width before it")
        last = f"y{len(nodes)}"
        nodes.append(helper.make_node(op, [latest[k], *weights], [last], domain=domain))
        latest[n] = last
        used += weights
    if not nodes:
        raise ValueError(f"{path.name}: no weight products (MatMul or MatMulInteger with initializer weights)")
    graph = helper.make_graph(
        nodes, "matmuls_alone", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, width])],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, None)],
        [inits[name] for name in dict.fromkeys(used)],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets), width, len(nodes)


def matmuls_alone_ms(path: Path, threads: int, passes: int = 7, min_seconds: float = 0.2) -> dict:
    """Median ms of one pass through the graph's weight products alone (ORT, `threads`)."""
    import onnxruntime as ort

    from backends.ort_session import SessionConfig, session_options

    model, width, count = _matmul_chain(Path(path))
    session = ort.InferenceSession(model.SerializeToString(), session_options(SessionConfig(threads=threads)),
                                   providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 1, width)).astype(np.float32)
    out = session.get_outputs()[0].name
    session.run([out], {"x": x})  # warm-up: weights pre-packed, pages faulted in
    start, runs = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds or runs < 3:
        session.run([out], {"x": x})
        runs += 1
    ms = []
    for _ in range(passes):
        time.sleep(0.05)  # the bandwidth probes' BLAS threads may still spin: let them settle
        start = time.perf_counter()
        for _ in range(runs):
            session.run([out], {"x": x})
        ms.append((time.perf_counter() - start) / runs * 1e3)
    return {"ms": round(statistics.median(ms), 4), "best_ms": round(min(ms), 4), "products": count,
            "runs_per_pass": runs, "passes": passes}


def weight_bytes(path: Path) -> int:
    """Bytes of a graph's initializers (weights), from the file without loading the tensors twice."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for init in model.graph.initializer:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
        total += int(np.prod(init.dims, dtype=np.int64)) * itemsize
    return total


FLOOR_GRAPHS = ("decoder", "decoder_int8")


def floors(export_dir: Path, manifest, threads: int, graphs: tuple[str, ...] = FLOOR_GRAPHS) -> dict:
    """Per decoder graph: bytes read per step and the resulting ms/token floor at this bandwidth."""
    bw = read_bandwidth_gbps(threads)
    out = {"bandwidth": bw, "graphs": {}}
    # Not fp16: ONNX Runtime's CPU provider computes it in fp32 through inserted Casts, so its
    # file's bytes are not what a step reads.
    for name in graphs:
        if name not in manifest.data["graphs"]:
            continue
        path = Path(export_dir) / manifest.graph(name)["file"]
        nbytes = weight_bytes(path)
        floor_ms = nbytes / 2**30 / bw["gb_per_s"] * 1e3
        alone = matmuls_alone_ms(path, threads)
        out["graphs"][name] = {
            "weight_mb": round(nbytes / 2**20, 3),
            "floor_ms_per_token": round(floor_ms, 4),
            "matmuls_alone": {**alone, "x_floor": round(alone["ms"] / floor_ms, 3)},
        }
    return out


def update(results_dir: Path, threads: int | None = None) -> dict:
    """Measure the floor again into an existing speed run (results.json, report.md), stamped."""
    import datetime as dt
    import json

    from backends import load_manifest
    from service.reports import write
    from service.speedrun import targets

    path = Path(results_dir) / "results.json"
    results = json.loads(path.read_text(encoding="utf-8"))
    export_dir = Path(results["model"]["export"])
    env = results["environment"]
    env["floor"] = floors(export_dir, load_manifest(export_dir), threads or results["options"]["threads"])
    env["floor"]["measured_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    results["targets"] = targets(results)
    write(results, Path(results_dir))
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="re-measure the memory-bandwidth floor into a speed run")
    parser.add_argument("results_dir", type=Path)
    args = parser.parse_args()
    floor = update(args.results_dir)["environment"]["floor"]
    print({k: v["gb_per_s"] for k, v in floor["bandwidth"]["probes"].items()}, floor["graphs"])
