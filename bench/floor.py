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

And the rest of the step on its own (`others_alone`): the decoder graph as ONNX Runtime optimizes
it for the backends, with every weight product taken out and its result fed in as an input
instead: attention, layer norms, residual adds, activations, the embedding lookup, and ORT's own
per-node and per-run work, at batch 1 with a cache of OTHERS_PAST positions and a source of
OTHERS_SOURCE tokens (the middle of a 40-token benchmark decode). Products alone plus the rest
alone is what ORT's kernels need for the step without any loop around it: where that sum is above
a target, no change to our decoding loop can reach it with this graph.
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
    return {**_time_runs(lambda: session.run([out], {"x": x}), passes, min_seconds), "products": count}


OTHERS_PAST, OTHERS_SOURCE = 20, 24
_PRODUCTS = ("MatMul", "DynamicQuantizeMatMul")  # what ORT's optimizer leaves of a weight product


def _without_products(path: Path, threads: int, workdir: Path):
    """ORT's optimized graph of `path` with each weight product (MatMul / DynamicQuantizeMatMul on an
    initializer) taken out, its output a graph input: (model, {input: (1, 1, N)}, products taken)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from backends.ort_session import SessionConfig, session_options

    options = session_options(SessionConfig(threads=threads))
    options.optimized_model_filepath = str(workdir / "optimized.onnx")
    # external data: a 600M-parameter decoder is near protobuf's 2 GB limit
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    model = onnx.load(str(workdir / "optimized.onnx"), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    nodes, fed, taken = [], {}, 0
    for node in model.graph.node:
        if node.op_type in _PRODUCTS and node.input[1] in inits:
            name = node.output[0]
            if name in outputs:  # the logits: an input cannot also be the output, so copy it there
                nodes.append(helper.make_node("Identity", [name + ".product"], [name]))
                name += ".product"
            fed[name] = (1, 1, int(inits[node.input[1]].dims[-1]))
            taken += 1
        else:
            nodes.append(node)
    if not taken:
        raise ValueError(f"{Path(path).name}: no weight products (MatMul or DynamicQuantizeMatMul on an initializer)")
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(
        nodes, "others_alone",
        [*model.graph.input, *(helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in fed.items())],
        list(model.graph.output), [i for i in model.graph.initializer if i.name in used],
    )
    out = helper.make_model(graph, opset_imports=model.opset_import)
    out.ir_version = model.ir_version
    onnx.load_external_data_for_model(out, str(workdir))
    return out, fed, taken


def _decoder_feeds(session, past: int, source: int, rng) -> dict:
    """Batch-1 feeds for a decoder session: symbolic dims named like a source length get `source`,
    other symbolic dims but the batch (rows, or sentences for the cross-attention inputs) get `past`;
    ids 0 and a mask of ones."""
    from backends.manifest import CROSS_BATCH

    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 if d in ("batch", CROSS_BATCH) else source if "src" in str(d) else past
                 for d in i.shape]
        if i.type == "tensor(int64)":
            feeds[i.name] = (np.ones if "mask" in i.name else np.zeros)(shape, dtype=np.int64)
        else:
            dtype = np.float16 if i.type == "tensor(float16)" else np.float32
            feeds[i.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def others_alone_ms(path: Path, threads: int, passes: int = 7, min_seconds: float = 0.2) -> dict:
    """Median ms of the decoder step without its weight products (see the module docstring)."""
    import tempfile

    import onnxruntime as ort

    from backends.ort_session import SessionConfig, session_options

    with tempfile.TemporaryDirectory(prefix="others-alone-") as tmp:
        model, fed, taken = _without_products(Path(path), threads, Path(tmp))
    session = ort.InferenceSession(model.SerializeToString(), session_options(SessionConfig(threads=threads)),
                                   providers=["CPUExecutionProvider"])
    feeds = _decoder_feeds(session, OTHERS_PAST, OTHERS_SOURCE, np.random.default_rng(0))
    out = [o.name for o in session.get_outputs()]
    timing = _time_runs(lambda: session.run(out, feeds), passes, min_seconds)
    return {**timing, "products_taken": taken, "nodes": len(model.graph.node), "past": OTHERS_PAST,
            "source": OTHERS_SOURCE}


def _time_runs(run, passes: int, min_seconds: float) -> dict:
    run()  # warm-up: weights pre-packed, pages faulted in
    start, runs = time.perf_counter(), 0
    while time.perf_counter() - start < min_seconds or runs < 3:
        run()
        runs += 1
    ms = []
    for _ in range(passes):
        time.sleep(0.05)  # the bandwidth probes' BLAS threads may still spin: let them settle
        start = time.perf_counter()
        for _ in range(runs):
            run()
        ms.append((time.perf_counter() - start) / runs * 1e3)
    return {"ms": round(statistics.median(ms), 4), "best_ms": round(min(ms), 4), "runs_per_pass": runs,
            "passes": passes}


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
        others = others_alone_ms(path, threads)
        out["graphs"][name] = {
            "weight_mb": round(nbytes / 2**20, 3),
            "floor_ms_per_token": round(floor_ms, 4),
            "matmuls_alone": {**alone, "x_floor": round(alone["ms"] / floor_ms, 3)},
            "others_alone": {**others, "x_floor": round(others["ms"] / floor_ms, 3)},
            # the step's kernels without a loop around them: no ORT backend of this graph goes lower
            "kernels_x_floor": round((alone["ms"] + others["ms"]) / floor_ms, 3),
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
