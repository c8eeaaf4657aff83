"""Inputs of the benchmarks: sentence files, the default sample, the model folder, the environment."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import random
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TSV = REPO.parent / "shared" / "corpus" / "dev.tsv"
DEFAULT_MODEL = REPO / "assets" / "marian-en-zh-small"
EXPORTS = REPO / "exports"
RESULTS = REPO / "bench-results"

DEFAULT_COUNT = 200
DEFAULT_SEED = 0
WORDS = (10, 40)  # inclusive range of English words per default sentence

VERSIONED = ("numpy", "onnxruntime", "torch", "transformers", "sentencepiece", "sacrebleu", "onnx")


@dataclass
class Pair:
    en: str
    zh: str | None = None  # the reference translation, when the file has one


def read_tsv(path: Path) -> list[Pair]:
    """A TSV with a header naming an `en` column and optionally a `zh` column."""
    with Path(path).open(encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        if "en" not in header:
            raise ValueError(f"{path}: the header has no `en` column (found: {', '.join(header)})")
        en, zh = header.index("en"), header.index("zh") if "zh" in header else None
        pairs = []
        for n, line in enumerate(f, start=2):
            cols = line.rstrip("\n").split("\t")
            if len(cols) <= en or not cols[en].strip():
                raise ValueError(f"{path}:{n}: no `en` text")
            pairs.append(Pair(cols[en].strip(), cols[zh].strip() if zh is not None and len(cols) > zh else None))
    return pairs


def read_sentences(path: Path) -> list[Pair]:
    """A .tsv with an `en` header (and maybe `zh`), or plain text: one English sentence per line."""
    path = Path(path)
    if path.suffix == ".tsv":
        return read_tsv(path)
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    pairs = [Pair(line) for line in lines if line]
    if not pairs:
        raise ValueError(f"{path} holds no sentences")
    return pairs


def default_sample(count: int = DEFAULT_COUNT, tsv: Path = DEFAULT_TSV, seed: int = DEFAULT_SEED) -> list[Pair]:
    """`count` pairs of 10-40 English words, drawn with a fixed seed; fewer if the file has fewer."""
    eligible = [p for p in read_tsv(tsv) if WORDS[0] <= len(p.en.split()) <= WORDS[1]]
    if not eligible:
        raise ValueError(f"{tsv} has no sentence of {WORDS[0]}-{WORDS[1]} words")
    return random.Random(seed).sample(eligible, min(count, len(eligible)))


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


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")


def environment(threads: int) -> dict:
    """CPU, cores, threads, exact versions, date and load: printed beside every result."""
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except ImportError:
        physical = None
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "threads": threads,
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {p: v for p in VERSIONED if (v := _version(p))},
        "git": _git(),
    }


# The graphs each backend reads; a backend whose graphs an export lacks (an export made before
# that backend existed) is left out of the default set and named in the report.
GRAPHS_OF = {
    "ort_fp32_single_step": ("full",),
    "ort_fp32_kv_cache": ("encoder", "decoder"),
    "ort_fp16": ("encoder_fp16", "decoder_fp16"),
    "ort_int8": ("encoder_int8", "decoder_int8"),
}


def default_backends(manifest) -> tuple[list[str], dict[str, str]]:
    """(every backend this export can serve, {left-out backend: why}), in `BACKEND_NAMES` order."""
    from backends import BACKEND_NAMES

    names, skipped = [], {}
    for name in BACKEND_NAMES:
        missing = [g for g in GRAPHS_OF.get(name, ()) if g not in manifest.data["graphs"]]
        if missing:
            skipped[name] = f"not in this export (no {', '.join(missing)} graph)"
        else:
            names.append(name)
    return names, skipped
