"""The one table of backends: every place that lists, labels, colours or builds a backend reads it.

Adding a backend is one `BackendSpec` here and the module of its engine; nothing else branches on
a backend's name. Builders import their engine when called, so reading the table imports neither
torch nor onnxruntime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.spec import RuntimeSpec, expect_one_of

from .backend import Backend

if TYPE_CHECKING:
    from .manifest import Manifest
    from .ort_session import SessionConfig
    from .shared_tables import SharedTables
    from .tokenizer import TokenizerWrapper


@dataclass(frozen=True)
class BackendSpec(RuntimeSpec):
    graphs: tuple[str, ...]  # the export's graphs it runs, encoder first; empty: the source weights
    # (spec, manifest, tokenizer, session, tables) -> Backend
    load: Callable[..., Backend]
    # (spec, manifest, session, tables) -> its StepModel alone, for the export's own parity check;
    # None for the reference, which that check compares against
    engine: Callable[..., Any] | None = None
    logits_key: str = ""  # its engine's name in the sidecar's logits parity ("kv_cache_fp16", ...)

    def build(self, manifest: Manifest, tokenizer: TokenizerWrapper, session: SessionConfig,
              tables: SharedTables) -> Backend:
        return self.load(self, manifest, tokenizer, session, tables)


def _torch_backend(spec, manifest, tokenizer, session, tables):
    from . import pytorch

    source = pytorch.source_model_of(manifest)
    model = pytorch.TorchStepModel(source, threads=session.threads, architecture=manifest.architecture)
    if tables is not None:
        pytorch.offer_tables(model, tables)
    return Backend(spec.name, model, tokenizer, manifest, pytorch.info(model, source))


def _ort_backend(spec, manifest, tokenizer, session, tables):
    model = spec.engine(spec, manifest, session, tables)
    return Backend(spec.name, model, tokenizer, manifest, model.info)


def _full_graph(spec, manifest, session, tables=None):
    from .ort_single_step import FullGraphStepModel

    return FullGraphStepModel(manifest, session, tables)


def _kv_cache(spec, manifest, session, tables=None):
    from .ort_kv_cache import KVCacheStepModel

    encoder, decoder = spec.graphs
    return KVCacheStepModel(manifest, session, encoder, decoder, tables)


def _ort(name, label, colour, precision, exact, graphs, engine, logits_key) -> BackendSpec:
    return BackendSpec(name, label, colour, precision, exact, graphs, _ort_backend, engine, logits_key)


# In display order: the reference first, then the ORT backends from the naive migration onwards.
BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in (
        BackendSpec("pytorch", "PyTorch (reference)", "#444444", "fp32", True, (), _torch_backend),
        _ort("ort_fp32_single_step", "ORT fp32 · single step", "#1f77b4", "fp32", True, ("full",), _full_graph,
             "full"),
        _ort("ort_fp32_kv_cache", "ORT fp32 · KV cache", "#2ca02c", "fp32", True, ("encoder", "decoder"), _kv_cache,
             "kv_cache"),
        _ort("ort_fp16", "ORT fp16 · KV cache", "#d62728", "fp16", False, ("encoder_fp16", "decoder_fp16"),
             _kv_cache, "kv_cache_fp16"),
        _ort("ort_int8", "ORT int8 · KV cache", "#9467bd", "int8", False, ("encoder_int8", "decoder_int8"),
             _kv_cache, "kv_cache_int8"),
    )
}

BACKEND_NAMES = tuple(BACKENDS)
REFERENCE = "pytorch"
# Backends whose outputs may differ from the reference by design (reduced precision).
APPROXIMATE = tuple(name for name, spec in BACKENDS.items() if not spec.exact)
# Which graphs each ORT backend runs, encoder first (the reference runs the source weights).
GRAPHS = {name: spec.graphs for name, spec in BACKENDS.items() if spec.graphs}
LABELS = {name: spec.label for name, spec in BACKENDS.items()}
COLOURS = {name: spec.colour for name, spec in BACKENDS.items()}


def spec_of(name: str) -> BackendSpec:
    """The spec of a built-in backend; ValueError naming the valid choices otherwise."""
    expect_one_of("backend", name, BACKEND_NAMES)
    return BACKENDS[name]
