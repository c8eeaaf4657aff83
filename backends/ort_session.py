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

    def __post_init__(self):
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be a positive integer or None, got {self.threads!r}")
        if self.provider not in ("auto", "cpu", "cuda"):
            raise ValueError(f"unknown provider {self.provider!r}; expected one of: auto, cpu, cuda")

    def providers(self) -> list[str]:
        available = ort.get_available_providers()
        if self.provider == "cuda" or (self.provider == "auto" and "CUDAExecutionProvider" in available):
            if "CUDAExecutionProvider" not in available:
                raise ValueError(f"provider 'cuda' asked for, but this onnxruntime offers: {', '.join(available)}")
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def resolved_threads(self) -> int:
        return self.threads or physical_cores()


def create_session(
    path: Path, config: SessionConfig, memory_arena: bool = True, tables=None
) -> "ort.InferenceSession":
    """`tables`: a `shared_tables.SharedTables`; the graph's large lookup tables then use its copies."""
    options = ort.SessionOptions()
    shared = []
    if tables is not None:
        for name, array in tables.for_graph(path).items():
            value = ort.OrtValue.ortvalue_from_numpy(array)  # a view; the OrtValue keeps `array` alive
            options.add_initializer(name, value)
            shared.append(value)
    # The arena keeps every block it ever grew to; off where tensor sizes grow with each call.
    options.enable_cpu_mem_arena = memory_arena
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = config.resolved_threads()
    # One request at a time per process: a second inter-op pool would only compete for the cores.
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    # ORT's idle workers otherwise spin after each run, holding a core the decoding loop then
    # wants for its own threads (decoding.score_step): at batch 32, int8, scoring a step took
    # 6.4 ms on 1 thread, 6.7-7.4 ms on 2 with spinning, 4.2-4.7 ms on 2 without. Batch-1 step
    # times did not move measurably either way.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), sess_options=options, providers=config.providers())
    session._shared_initializers = shared  # must outlive the session (ORT does not own them)
    return session


def session_info(session: "ort.InferenceSession", path: Path, config: SessionConfig, precision: str) -> dict:
    return {
        "runtime": f"ONNX Runtime {ort.__version__}",
        "provider": session.get_providers()[0],
        "precision": precision,
        "graph": path.name,
        "threads": config.resolved_threads(),
    }
