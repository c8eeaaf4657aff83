"""Several ways to run one translation model behind one decoding contract.

`load_backends(export_dir)` returns them by name, in the order of `registry.BACKENDS` (the table
that names, labels and builds every backend; pytorch, the reference, first). Heavy imports happen inside the loaders, so
importing this package (or an ORT backend) never imports torch. `external={NAME: DIR}` adds exports made
elsewhere (Hugging Face Optimum's layout) of the same model, checked against it first (ort_external.py).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from .backend import Backend
from .options import MAX_BEAMS, DecodeOptions
from .results import ForcedScores, Hypothesis, StepScore, Translation
from .manifest import GenerationDefaults, Manifest, ManifestError, UnsupportedGeneration, load_manifest
from .ort_session import SessionConfig
from .registry import APPROXIMATE, BACKEND_NAMES, BACKENDS, GRAPHS, REFERENCE, BackendSpec, spec_of
from .shared_tables import SharedTables
from .tokenizer import InputError, TokenizerWrapper

logger = logging.getLogger("backends")


def left_out_backends(manifest: Manifest) -> dict[str, str]:
    """{built-in backend: why this export cannot run it}: a graph it needs was left out at export
    (the sidecar says why), or is missing from an older export's sidecar."""
    why = {}
    for name in BACKEND_NAMES:
        for graph in GRAPHS.get(name, ()):
            if graph in manifest.graphs_left_out:
                why[name] = f"it needs graph {graph!r}, which was {manifest.graphs_left_out[graph]}"
            elif graph not in manifest.data["graphs"]:
                why[name] = f"it needs graph {graph!r}, which is not in this export"
            else:
                continue
            break
    return why


def runnable_backends(manifest: Manifest) -> tuple[str, ...]:
    """The built-in backends this export can run, in `BACKEND_NAMES` order."""
    left_out = left_out_backends(manifest)
    return tuple(n for n in BACKEND_NAMES if n not in left_out)


def _build(
    name: str, manifest: Manifest, tokenizer: TokenizerWrapper, session: SessionConfig, tables: SharedTables
) -> Backend:
    why = left_out_backends(manifest).get(name)
    if why:
        raise ValueError(f"backend {name} cannot run here: {why}; this export runs: {', '.join(runnable_backends(manifest))}")
    return spec_of(name).build(manifest, tokenizer, session, tables)


def check_external(external) -> dict[str, str]:
    """{NAME: DIR} of external exports (backends/ort_external.py): names must be new and plain."""
    external = dict(external or {})
    clash = [n for n in external if n in BACKEND_NAMES or n == "generate"]
    if clash:
        raise ValueError(f"external backend name(s) {', '.join(clash)} taken by a built-in backend; "
                         f"choose others than: {', '.join(BACKEND_NAMES)}, generate")
    bad = [n for n in external if not isinstance(n, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", n)]
    if bad:
        raise ValueError(f"external backend name(s) {bad!r}: use letters, digits, '_', '.' or '-'")
    return external


def _build_external(
    name: str, path, manifest: Manifest, tokenizer: TokenizerWrapper, session: SessionConfig
) -> Backend:
    from . import ort_external

    return ort_external.load(name, path, manifest, tokenizer, session)


def _check_names(names) -> None:
    unknown = [n for n in names if n not in BACKEND_NAMES]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; expected any of: {', '.join(BACKEND_NAMES)}")


def _prepare(export_dir, names, src_lang=None, tgt_lang=None):
    _check_names(names)
    manifest = load_manifest(export_dir).with_languages(src_lang, tgt_lang)
    manifest.verify_tokenizer()
    languages = manifest.languages or {}
    return manifest, TokenizerWrapper(Path(export_dir), src_lang=languages.get("src_lang"),
                                      source_prefix=manifest.source_prefix)


def _source_weight_bytes(manifest: Manifest) -> int:
    """The PyTorch reference's weights: the source's weight file, else 4 bytes per parameter."""
    folder = manifest.data["source_model"].get("path")
    for name in ("model.safetensors", "pytorch_model.bin"):
        if folder and (Path(folder) / name).is_file():
            return (Path(folder) / name).stat().st_size
    return 4 * int(manifest.data["model"]["parameters"])


def memory_needs(export_dir: str | Path, names: tuple[str, ...] = BACKEND_NAMES, cpu: bool = True) -> dict[str, int]:
    """Bytes each named backend is expected to hold once loaded: its weights as stored on disk
    (graph files with their external data; the source model's weights for pytorch) and, on the
    CPU, the fp32 copy ORT makes of each fp16 weight that is not only gathered from (its CPU
    kernels compute in fp32), less the fp16 originals that copy replaces, as the sidecar counts
    them; an embedding table that several of its graphs gather counts once (`shared_tables` holds
    one copy). An estimate, not a bound either way: activations, ORT's packed weight copies and the KV
    caches come on top, while a weight file that is mapped rather than read becomes resident only
    where a decode reads it, and a gathered table (an embedding) is read a few rows at a time
    (peak RSS against these figures is measured in docs/export.md). A backend whose graphs the
    export left out is not counted: it will not load."""
    _check_names(names)
    manifest = load_manifest(export_dir)
    files = manifest.data["files"]
    runnable = runnable_backends(manifest)
    needs = {}
    for name in names:
        if name not in runnable:
            continue  # refused by name when loaded
        if not GRAPHS.get(name):
            needs[name] = _source_weight_bytes(manifest)
            continue
        total, tables = 0, set()
        for graph in GRAPHS[name]:
            entry = manifest.graph(graph)
            total += sum(files[f]["bytes"] for f in [entry["file"], *entry.get("external_data", [])] if f in files)
            for digest, size in entry.get("gathered_tables", {}).items():
                total -= size if digest in tables else 0  # the same table in another of its graphs: held once
                tables.add(digest)
            if cpu:  # an older sidecar without the replaced bytes: the files and the copies, both
                total += 2 * entry.get("fp16_bytes_widened_on_cpu", 0) - entry.get("fp16_bytes_replaced_on_cpu", 0)
        needs[name] = total
    return needs


def load_backends(
    export_dir: str | Path,
    names: tuple[str, ...] = BACKEND_NAMES,
    session: SessionConfig = SessionConfig(),
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    external: dict[str, str | Path] | None = None,
) -> dict[str, Backend]:
    """Load the named backends in `BACKEND_NAMES` order; any failure raises.

    Backends loaded together share identical lookup tables (`shared_tables`), unless
    `session.low_memory` asks each to map its own. `src_lang`,
    `tgt_lang`: language codes overriding the export's (models with codes: NLLB, M2M100, mBART-50);
    an unknown code raises ValueError listing the known ones. `external`: {NAME: DIR} of
    Optimum-layout exports of the same model, loaded after the built-in ones as backends NAME
    (backends/ort_external.py); one that is not an export of this model raises, naming what differs.
    """
    external = check_external(external)
    manifest, tokenizer = _prepare(export_dir, names, src_lang, tgt_lang)
    tables = None if session.low_memory else SharedTables()
    loaded = {n: _build(n, manifest, tokenizer, session, tables) for n in BACKEND_NAMES if n in names}
    for n, path in external.items():
        loaded[n] = _build_external(n, path, manifest, tokenizer, session)
    return loaded


def try_load_backends(
    export_dir: str | Path,
    names: tuple[str, ...] = BACKEND_NAMES,
    session: SessionConfig = SessionConfig(),
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    external: dict[str, str | Path] | None = None,
) -> tuple[dict[str, Backend], dict[str, str]]:
    """Load what can be loaded; return (backends, {name: error message}) so an app can start anyway.

    A broken manifest or tokenizer, or an unknown language code, still raises: no backend can run
    without them. An `external` export (see `load_backends`) that fails to load or to match fails alone.
    """
    external = check_external(external)
    manifest, tokenizer = _prepare(export_dir, names, src_lang, tgt_lang)
    tables = None if session.low_memory else SharedTables()
    loaded, failed = {}, {}
    for n in BACKEND_NAMES:
        if n not in names:
            continue
        try:
            loaded[n] = _build(n, manifest, tokenizer, session, tables)
        except Exception as e:  # reported to the user per backend, never swallowed
            logger.warning("backend %s failed to load: %s", n, e)
            failed[n] = f"{type(e).__name__}: {e}"
    for n, path in external.items():
        try:
            loaded[n] = _build_external(n, path, manifest, tokenizer, session)
        except Exception as e:  # reported to the user per backend, never swallowed
            logger.warning("external backend %s (%s) failed to load: %s", n, path, e)
            failed[n] = f"{type(e).__name__}: {e}"
    return loaded, failed


__all__ = [
    "APPROXIMATE",
    "BACKENDS",
    "BACKEND_NAMES",
    "GRAPHS",
    "REFERENCE",
    "Backend",
    "BackendSpec",
    "DecodeOptions",
    "ForcedScores",
    "GenerationDefaults",
    "Hypothesis",
    "InputError",
    "MAX_BEAMS",
    "Manifest",
    "ManifestError",
    "SessionConfig",
    "StepScore",
    "Translation",
    "UnsupportedGeneration",
    "check_external",
    "load_backends",
    "load_manifest",
    "memory_needs",
    "runnable_backends",
    "try_load_backends",
]
