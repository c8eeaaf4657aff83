"""Five ways to run one Marian model behind one decoding contract.

`load_backends(export_dir)` returns them by name, in this order: pytorch (the reference),
ort_fp32_single_step, ort_fp32_kv_cache, ort_fp16, ort_int8. Heavy imports happen inside the loaders, so
importing this package (or an ORT backend) never imports torch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .base import MAX_BEAMS, Backend, DecodeOptions, ForcedScores, Hypothesis, StepScore, Translation
from .manifest import GenerationDefaults, Manifest, ManifestError, UnsupportedGeneration, load_manifest
from .ort_session import SessionConfig
from .shared_tables import SharedTables
from .tokenizer import InputError, MarianTokenizerWrapper

logger = logging.getLogger("backends")

BACKEND_NAMES = ("pytorch", "ort_fp32_single_step", "ort_fp32_kv_cache", "ort_fp16", "ort_int8")
# Backends whose outputs may differ from the reference by design (reduced precision).
APPROXIMATE = ("ort_fp16", "ort_int8")
REFERENCE = "pytorch"


def _build(
    name: str, manifest: Manifest, tokenizer: MarianTokenizerWrapper, session: SessionConfig, tables: SharedTables
) -> Backend:
    if name == "pytorch":
        from . import pytorch

        source = pytorch.source_model_of(manifest)
        model = pytorch.TorchStepModel(source, threads=session.threads)
        pytorch.offer_tables(model, tables)
        return Backend(name, model, tokenizer, manifest, pytorch.info(model, source))
    if name == "ort_fp32_single_step":
        from .ort_single_step import FullGraphStepModel

        model = FullGraphStepModel(manifest, session, tables)
    elif name == "ort_fp32_kv_cache":
        from .ort_kv_cache import KVCacheStepModel

        model = KVCacheStepModel(manifest, session, "encoder", "decoder", tables)
    elif name == "ort_fp16":
        from .ort_kv_cache import KVCacheStepModel

        model = KVCacheStepModel(manifest, session, "encoder_fp16", "decoder_fp16", tables)
    elif name == "ort_int8":
        from .ort_kv_cache import KVCacheStepModel

        model = KVCacheStepModel(manifest, session, "encoder_int8", "decoder_int8", tables)
    else:
        raise ValueError(f"unknown backend {name!r}; expected one of: {', '.join(BACKEND_NAMES)}")
    return Backend(name, model, tokenizer, manifest, model.info)


def _prepare(export_dir, names):
    unknown = [n for n in names if n not in BACKEND_NAMES]
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)}; expected any of: {', '.join(BACKEND_NAMES)}")
    manifest = load_manifest(export_dir)
    manifest.verify_tokenizer()
    return manifest, MarianTokenizerWrapper(Path(export_dir))


def load_backends(
    export_dir: str | Path, names: tuple[str, ...] = BACKEND_NAMES, session: SessionConfig = SessionConfig()
) -> dict[str, Backend]:
    """Load the named backends in `BACKEND_NAMES` order; any failure raises.

    Backends loaded together share identical lookup tables (`shared_tables`).
    """
    manifest, tokenizer = _prepare(export_dir, names)
    tables = SharedTables()
    return {n: _build(n, manifest, tokenizer, session, tables) for n in BACKEND_NAMES if n in names}


def try_load_backends(
    export_dir: str | Path, names: tuple[str, ...] = BACKEND_NAMES, session: SessionConfig = SessionConfig()
) -> tuple[dict[str, Backend], dict[str, str]]:
    """Load what can be loaded; return (backends, {name: error message}) so an app can start anyway.

    A broken manifest or tokenizer still raises: no backend can run without them.
    """
    manifest, tokenizer = _prepare(export_dir, names)
    tables = SharedTables()
    loaded, failed = {}, {}
    for n in BACKEND_NAMES:
        if n not in names:
            continue
        try:
            loaded[n] = _build(n, manifest, tokenizer, session, tables)
        except Exception as e:  # reported to the user per backend, never swallowed
            logger.warning("backend %s failed to load: %s", n, e)
            failed[n] = f"{type(e).__name__}: {e}"
    return loaded, failed


__all__ = [
    "APPROXIMATE",
    "BACKEND_NAMES",
    "REFERENCE",
    "Backend",
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
    "load_backends",
    "load_manifest",
    "try_load_backends",
]
