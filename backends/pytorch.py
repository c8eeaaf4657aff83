"""The reference: the HF model (its family's transformers class, as the sidecar names it) in
PyTorch eager mode, with transformers' own KV cache.

The only backend module that imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover
    raise RuntimeError("the pytorch backend requires torch (pip install torch==2.13.0)") from e

from families import DEFAULT_FAMILY, FAMILIES, architectures

SUPPORTED_ARCHITECTURES = architectures()


@dataclass
class _State:
    encoder_outputs: Any
    attention_mask: "torch.Tensor"
    cache: Any


class TorchStepModel:
    def __init__(self, model_source: str | Path, threads: int | None = None,
                 architecture: str = FAMILIES[DEFAULT_FAMILY].architecture):
        import transformers

        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r}; expected one of: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if threads:
            torch.set_num_threads(threads)
        self.architecture = architecture
        self.model = getattr(transformers, architecture).from_pretrained(str(model_source)).eval()
        self.threads = torch.get_num_threads()

    @torch.inference_mode()
    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> _State:
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        mask = torch.from_numpy(attention_mask)
        enc = self.model.get_encoder()(input_ids=torch.from_numpy(input_ids), attention_mask=mask)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        return _State(encoder_outputs=enc, attention_mask=mask, cache=cache)

    @torch.inference_mode()
    def expand(self, state: _State, n: int) -> None:
        """Each sentence n times ([s0 x n, s1 x n, ...]), as generate()'s `_expand_inputs_for_generation`
        does: every tensor of the encoder outputs and the mask repeat_interleave'd on the batch axis."""
        for key, value in list(state.encoder_outputs.items()):
            if isinstance(value, torch.Tensor):
                state.encoder_outputs[key] = value.repeat_interleave(n, dim=0)  # (b * n, s, d)
        state.attention_mask = state.attention_mask.repeat_interleave(n, dim=0)  # (b * n, s)
        # The cache is still empty here: the first step fills it with b * n rows.

    @torch.inference_mode()
    def reorder(self, state: _State, beam_idx: np.ndarray) -> None:
        """transformers' own cache reorder, as generate() calls it (`EncoderDecoderCache.reorder_cache`)."""
        state.cache.reorder_cache(torch.from_numpy(np.ascontiguousarray(beam_idx, dtype=np.int64)))

    @torch.inference_mode()
    def keep(self, state: _State, rows: np.ndarray, parents: np.ndarray | None = None) -> None:
        """Only `rows` go on: the encoder outputs, the mask and both caches shrink. With `parents`,
        kept row i continues from row parents[i], a row of the same sentence (same source)."""
        index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
        for key, value in list(state.encoder_outputs.items()):
            if isinstance(value, torch.Tensor):
                state.encoder_outputs[key] = value.index_select(0, index)
        state.attention_mask = state.attention_mask.index_select(0, index)
        cache_index = index if parents is None else torch.from_numpy(np.ascontiguousarray(parents, dtype=np.int64))
        state.cache.reorder_cache(cache_index)  # self- and cross-attention caches alike

    @torch.inference_mode()
    def step(self, state: _State, decoder_ids: np.ndarray) -> np.ndarray:
        out = self.model(
            encoder_outputs=state.encoder_outputs,
            attention_mask=state.attention_mask,
            decoder_input_ids=torch.from_numpy(decoder_ids[:, -1:]),  # (b, 1): the cache holds the rest
            cache=state.cache,
            use_cache=True,
            return_dict=True,
        )
        state.cache = out.cache if hasattr(out, "cache") else out.past_key_values
        return out.logits[:, -1, :].float().numpy()  # (b, V)


def offer_tables(step_model: TorchStepModel, tables) -> None:
    """Offer the model's large parameters (the (V, d) embedding) to ORT graphs holding the same numbers."""
    seen = set()
    for p in step_model.model.parameters():
        if p.dtype == torch.float32 and p.is_contiguous() and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            tables.offer(p.detach().numpy())  # a view of the weights, no copy


def source_model_of(manifest) -> Path | str:
    """The PyTorch weights behind an export: the folder recorded at export, or its hub id."""
    source = manifest.data["source_model"]
    local = Path(source["path"]) if source.get("path") else None
    if local is not None and local.is_dir():
        return local
    if source.get("hub_id"):
        return source["hub_id"]
    raise FileNotFoundError(
        f"the PyTorch backend needs the source model {source}: the folder is gone and no hub id is recorded"
    )


def info(step_model: TorchStepModel, source) -> dict[str, Any]:
    return {
        "runtime": f"PyTorch {torch.__version__} eager",
        "provider": "CPU",
        "precision": "fp32",
        "graph": f"{source} (transformers {step_model.architecture})",
        "threads": step_model.threads,
        "interop_threads": torch.get_num_interop_threads(),
    }
