"""Inputs of the benchmarks: sentence files, the model folder, the backends an export can serve.

The default sentences are `corpus.default_sample` (10-40-word dev pairs drawn with seed 0); the
machine recorded beside every result is `service.environment`.
"""

from __future__ import annotations

from pathlib import Path

from backends import left_out_backends, runnable_backends
from corpus import DEV_TSV, Pair, default_sample, read_sentences

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TSV = DEV_TSV
DEFAULT_MODEL = REPO / "assets" / "marian-en-zh-small"
EXPORTS = REPO / "exports"
RESULTS = REPO / "bench-results"


def sentences_arg(value: str | None) -> list[Pair]:
    """--sentences: a file, or a count drawn by `default_sample`."""
    if value is None:
        return default_sample()
    if value.isdigit():
        if int(value) < 1:
            raise ValueError("--sentences must be at least 1")
        return default_sample(int(value))
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--sentences takes a count or a file; {value!r} is neither")
    return read_sentences(path)


def resolve_model(model: str | Path | None, threads: int | None = None, log=print) -> Path:
    """An export folder for `model`: used as is when it holds manifest.json, else exported (or reused)."""
    model = str(model or DEFAULT_MODEL)
    if (Path(model) / "manifest.json").is_file():
        return Path(model)
    from export.ensure import ensure_export  # torch and the exporter: only when exporting

    name = Path(model).name if Path(model).exists() else model.replace("/", "--")
    return ensure_export(model, EXPORTS / name, log=lambda msg, **_: log(msg), threads=threads)


def default_backends(manifest) -> tuple[list[str], dict[str, str]]:
    """(every backend this export can serve, {left-out backend: why}), in `BACKEND_NAMES` order."""
    return list(runnable_backends(manifest)), left_out_backends(manifest)
