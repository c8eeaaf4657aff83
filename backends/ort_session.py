"""ONNX Runtime session settings, in one place for every ORT backend."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

try:
    import onnxruntime as ort
except ImportError as e:  # pragma: no cover - the pinned environment has it
    raise RuntimeError("the ONNX Runtime backends require the onnxruntime package") from e


def physical_cores() -> int:
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except ImportError:
        n = None
    return max(1, n or os.cpu_count() or 1)


@dataclass(frozen=True)
class SessionConfig:
    # Intra-op threads; None = the machine's physical cores (more only oversubscribes them).
    threads: int | None = None
    # "auto" takes CUDA when onnxruntime-gpu and a GPU are present, else the CPU.
    provider: str = "auto"
    # Load for the least memory rather than the most speed: MatMul weights are not pre-packed (a
    # packed copy sits beside any weight that a Gather also reads, such as a tied output table),
    # nodes run in the graph's own order so values are freed as soon as their readers have run,
    # `load_backends` leaves each session its own memory-mapped tables instead of copies shared
    # between backends, and a KV engine holds one graph of its pair at a time (reopening the other
    # when its turn comes: slow if encodes and steps alternate). fp32 numbers move by rounding
    # only; int8's unpacked kernels compute different numbers (docs/export.md).
    low_memory: bool = False

    def __post_init__(self):
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer or None, got {self.threads!r}")
        if self.provider not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown provider {self.provider!r}; expected one of: auto, cpu, cuda")
        if not isinstance(self.low_memory, bool):
            raise ValueError(f"low_memory must be True or False, got {self.low_memory!r}")

    def providers(self) -> list[str]:
        available = ort.get_available_providers()
        if self.provider == "cuda" or (self.provider == "auto" and "CUDAExecutionProvider" in available):
            if "CUDAExecutionProvider" not in available:
                raise ValueError(f"provider 'cuda' asked for, but this onnxruntime offers: {', '.join(available)}")
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def resolved_threads(self) -> int:
        return self.threads or physical_cores()


# ORT's fusion of a residual Add and the LayerNormalization after it into one
# SkipLayerNormalization kernel is slower on the CPU than the two ops it replaces, with the same
# numbers to within rounding (docs/benchmarks.md has the timings, and the other fusions tried).
CPU_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion",)


def disabled_optimizers(config: SessionConfig) -> list[str]:
    """The ORT graph optimizers every session of ours turns off for `config`'s provider."""
    return [] if "CUDAExecutionProvider" in config.providers() else list(CPU_DISABLED_OPTIMIZERS)


def session_options(config: SessionConfig, memory_arena: bool = True) -> "ort.SessionOptions":
    """The settings of every backend session (and of `service.locate`'s, which must compute the
    same numbers)."""
    options = ort.SessionOptions()
    # The arena keeps every block it ever grew to; off where tensor sizes grow with each call.
    options.enable_cpu_mem_arena = memory_arena
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = config.resolved_threads()
    # One request at a time per process: a second inter-op pool would only compete for the cores.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # Workers spin inside a run, and stop when it ends. Without spinning, each of a step's many
    # small parallel kernels waits for a sleeping worker to wake; spinning on after the run (ORT's
    # default) holds a core that the next session or the decoding loop's own threads want.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    if config.low_memory:
        options.add_session_config_entry("session.disable_prepacking", "1")
        options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return options


def open_session(graph: str | bytes, options: "ort.SessionOptions", config: SessionConfig) -> "ort.InferenceSession":
    """Every ORT session of ours is opened here: `config`'s providers, our disabled optimizers."""
    return ort.InferenceSession(
        graph, sess_options=options, providers=config.providers(), disabled_optimizers=disabled_optimizers(config)
    )


def create_session(
    path: Path | bytes, config: SessionConfig, memory_arena: bool = True, tables=None
) -> "ort.InferenceSession":
    """`path`: a graph file, or a serialized graph (bytes).

    `tables`: a `shared_tables.SharedTables`; the graph's large lookup tables then use its copies."""
    options = session_options(config, memory_arena)
    shared = []
    if tables is not None:
        for name, array in tables.for_graph(path).items():
            value = ort.OrtValue.ortvalue_from_numpy(array)  # a view; the OrtValue keeps `array` alive
            options.add_initializer(name, value)
            shared.append(value)
    graph = path if isinstance(path, bytes) else str(path)
    session = open_session(graph, options, config)
    session._shared_initializers = shared  # must outlive the session (ORT does not own them)
    return session


def gather_rows_graph(count: int, elem_type: str) -> bytes:
    """A graph taking `index` (n,) int64 and x0..x{count-1}, returning y_i = x_i[index] (Gather on
    axis 0): beam search's cache reorder and per-beam expansion, run on OrtValues so the tensors
    never leave ORT. `elem_type`: an ORT type string such as "tensor(float)"."""
    import onnx
    from onnx import TensorProto, helper

    types = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16, "tensor(int64)": TensorProto.INT64}
    if elem_type not in types:
        raise ValueError(f"no gather graph for {elem_type}; expected one of: {', '.join(types)}")
    dims = ["rows", "d1", "d2", "d3"]
    inputs = [helper.make_tensor_value_info("index", TensorProto.INT64, ["n"])]
    inputs += [helper.make_tensor_value_info(f"x{i}", types[elem_type], dims) for i in range(count)]
    outputs = [helper.make_tensor_value_info(f"y{i}", types[elem_type], ["n", "d1", "d2", "d3"]) for i in range(count)]
    nodes = [helper.make_node("Gather", [f"x{i}", "index"], [f"y{i}"], axis=0) for i in range(count)]
    model = helper.make_model(
        helper.make_graph(nodes, "gather_rows", inputs, outputs), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def session_info(session: "ort.InferenceSession", path: Path, config: SessionConfig, precision: str) -> dict:
    return {
        "runtime": f"ONNX Runtime {ort.__version__}",
        "provider": session.get_providers()[0],
        "precision": precision,
        "graph": path.name,
        "threads": config.resolved_threads(),
    }
