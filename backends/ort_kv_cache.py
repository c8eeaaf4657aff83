"""ORT KV-cache backends: an encoder graph run once, then one decoder step per token.

The encoder graph also returns every decoder layer's cross-attention keys/values, so they are
computed once per sentence. The decoder takes the newest token and the self-attention cache, and
returns the cache grown by one position. The first step feeds an empty past (length 0).
Serves every KV-cache backend of `registry.BACKENDS`, each with its own encoder/decoder graph pair.

Caches stay ORT-owned `OrtValue`s from the step that produced them to the step that reads them
(`run_with_ort_values`): `session.run` would copy every cache tensor into a new numpy array at
each step and back. Only the logits are viewed as numpy, without a copy.

Beam search: an export's decoder takes each sentence's cross-attention keys/values and source mask
once for all of its beams (inputs batched by `CROSS_BATCH`, export/attention.share_cross_attention),
so `expand` only widens the self-attention cache; a decoder without that rewrite gets them
repeated once per beam. The widening waits for the first step: until a beam has chosen a token, a
sentence's beams are copies of one row, so that step runs once per sentence (as CTranslate2's beam
search does) and its cache rows and logits are repeated. `reorder` gathers the
self-attention cache rows by beam index after each step. Both run a tiny Gather graph built at
load time (`ort_session.gather_rows_graph`) on the OrtValues themselves, so the cache stays ORT-owned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from runtime.memory import release_freed_memory

from .base import beams_are_copies, sentences_of
from .manifest import CROSS_BATCH
from .ort_session import SessionConfig, create_session, gather_rows_graph, session_info

_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


@dataclass
class _State:
    attention_mask: ort.OrtValue  # (b, s) int64
    cross: list[ort.OrtValue]  # per layer key, value: (b, h, s, d)
    past: list[ort.OrtValue]  # per layer key, value: (b, h, p, d)
    mask: np.ndarray  # the buffer behind attention_mask (an OrtValue does not own it)
    beams: int = 1  # decoder rows per sentence; cross and mask hold one row per sentence when shared
    widen: int = 1  # from expand: rows per sentence to make after the first step


def _value(array: np.ndarray) -> ort.OrtValue:
    # Wraps the numpy buffer (no copy); the array must stay alive as long as the OrtValue is used.
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


class KVCacheStepModel:
    def __init__(self, manifest, config: SessionConfig, encoder: str = "encoder", decoder: str = "decoder", tables=None):
        enc_path, dec_path = manifest.verify_graph(encoder), manifest.verify_graph(decoder)
        self._paths, self._tables = {"encoder": enc_path, "decoder": dec_path}, tables
        # low_memory: one graph of the pair open at a time. `encode` closes the decoder and opens
        # the encoder, the next `step` the other way round: a caller that encodes every batch
        # before stepping (the export's verification) never holds both sets of weights.
        self._one_graph = config.low_memory
        self.open_seconds = 0.0  # spent opening graphs after load (low_memory's swaps), not decoding
        self.decoder = create_session(dec_path, config, tables=tables)
        self.encoder = None if self._one_graph else create_session(enc_path, config, tables=tables)
        model = manifest.data["model"]
        self.layers = model["decoder_layers"]
        self.heads = model["decoder_attention_heads"]
        self.head_dim = model.get("head_dim") or model["d_model"] // self.heads
        names = [i.name for i in self.decoder.get_inputs()]
        # The encoder's outputs after its hidden states, in its order, are the decoder's cross inputs.
        self.cross_names = [n for n in names if n not in ("input_ids", "encoder_attention_mask") and not n.startswith("past.")]
        self.past_names = [n for n in names if n.startswith("past.")]
        self.present_names = [o.name for o in self.decoder.get_outputs() if o.name.startswith("present.")]
        # The decoder reads each sentence's cross-attention inputs once for all of its beams.
        self.shared_cross = all(i.shape[0] == CROSS_BATCH for i in self.decoder.get_inputs()
                                if i.name in self.cross_names or i.name == "encoder_attention_mask")
        past_type = {i.name: i.type for i in self.decoder.get_inputs()}[self.past_names[0]]
        self.cache_dtype = _NP_TYPES[past_type]
        self.outputs = ["logits", *self.present_names]
        # Beam search's row gathers: one small session per (tensor count, type), made on first use.
        self._config = config
        self._gathers: dict[tuple[int, str], ort.InferenceSession] = {}
        precision = manifest.graph(decoder)["precision"]
        self.info = session_info(self.decoder, dec_path, config, precision)
        self.info["graph"] = f"{enc_path.name} + {dec_path.name}"
        kept = manifest.kept_in_float(precision)
        if kept:
            self.info["kept_in_float"] = kept
        if self.encoder is not None:
            self._check_cross(self.encoder)

    def open_graph(self, graph: str) -> ort.InferenceSession:
        """The session of `graph` ("encoder" or "decoder"); with one graph at a time, the other
        one is closed first."""
        session = getattr(self, graph)
        if session is None:
            other = "decoder" if graph == "encoder" else "encoder"
            setattr(self, other, None)
            start = time.perf_counter()
            release_freed_memory()  # the other graph's weights go before these load
            session = create_session(self._paths[graph], self._config, tables=self._tables)
            setattr(self, graph, session)
            if graph == "encoder":
                self._check_cross(session)
            self.open_seconds += time.perf_counter() - start
        return session

    def _check_cross(self, encoder: ort.InferenceSession) -> None:
        outputs = [o.name for o in encoder.get_outputs()][1:]
        if sorted(outputs) != sorted(self.cross_names):
            raise RuntimeError(f"{self._paths['encoder'].name} returns {', '.join(outputs)}; "
                               f"{self._paths['decoder'].name} takes {', '.join(self.cross_names)}")

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> _State:
        mask_array = np.ascontiguousarray(attention_mask)
        mask = _value(mask_array)
        cross = self.open_graph("encoder").run_with_ort_values(self.cross_names, {"input_ids": _value(input_ids), "attention_mask": mask})
        return _State(mask, list(cross), self._empty_past(input_ids.shape[0]), mask_array)

    def _empty_past(self, rows: int) -> list[ort.OrtValue]:
        empty = np.zeros((rows, self.heads, 0, self.head_dim), dtype=self.cache_dtype)  # (rows, h, 0, d)
        return [_value(empty)] * (2 * self.layers)

    def _gather(self, values: list[ort.OrtValue], index: np.ndarray) -> list[ort.OrtValue]:
        """values[i][index] on axis 0, each an ORT-owned OrtValue (no numpy round trip)."""
        key = (len(values), values[0].data_type())
        if key not in self._gathers:
            # No arena: the cache grows every step, and an arena would keep its largest size.
            self._gathers[key] = create_session(gather_rows_graph(*key), self._config, memory_arena=False)
        session = self._gathers[key]
        feeds = {"index": _value(index.astype(np.int64))}
        feeds.update((f"x{i}", v) for i, v in enumerate(values))
        return list(session.run_with_ort_values([f"y{i}" for i in range(len(values))], feeds))

    def expand(self, state: _State, n: int) -> None:
        """Each sentence's rows n times ([s0 x n, s1 x n, ...]), made by the first `step` (see the
        module docstring)."""
        state.widen = n

    def _widen(self, state: _State) -> None:
        """The self-attention cache, and a cross-attention that is not shared, n rows per sentence:
        gathered, not recomputed."""
        n, index = state.widen, np.repeat(np.arange(state.mask.shape[0]), state.widen)
        state.past = self._gather(state.past, index)  # (b * n, h, p, d)
        if not self.shared_cross:
            state.cross = self._gather(state.cross, index)  # (b * n, h, s, d)
            state.mask = np.repeat(state.mask, n, axis=0)  # (b * n, s)
            state.attention_mask = _value(state.mask)
        state.beams, state.widen = n, 1

    def reorder(self, state: _State, beam_idx: np.ndarray) -> None:
        """Row i of the self-attention cache continues from row beam_idx[i]; cross-attention rows
        are the same for every beam of a sentence and stay where they are."""
        state.past = self._gather(state.past, beam_idx)  # (b * n, h, p, d) each

    def keep(self, state: _State, rows: np.ndarray, parents: np.ndarray | None = None) -> None:
        """Only `rows` go on; every cached tensor and the mask shrink to them (a shared
        cross-attention's to their sentences: rows must then be every beam of each sentence kept).
        With `parents`, kept row i continues from row parents[i]: beam search's reorder in the
        same copy of the self-attention cache."""
        state.past = self._gather(state.past, rows if parents is None else parents)
        sentences = rows
        if self.shared_cross and state.beams > 1:
            sentences = sentences_of(rows, state.beams)
            if sentences is None:
                raise ValueError(f"a shared cross-attention keeps whole sentences: rows must be all {state.beams} "
                                 "beams of each")
        state.cross = self._gather(state.cross, sentences)
        state.mask = np.ascontiguousarray(state.mask[sentences])
        state.attention_mask = _value(state.mask)

    def step(self, state: _State, decoder_ids: np.ndarray) -> np.ndarray:
        n = state.widen
        if n > 1:
            if beams_are_copies(decoder_ids, n):
                logits = self._run(state, decoder_ids[::n])  # (b, V): one row per sentence
                self._widen(state)
                return np.repeat(logits, n, axis=0)  # (b * n, V)
            self._widen(state)  # the beams already differ: every row runs
        return self._run(state, decoder_ids)

    def _run(self, state: _State, decoder_ids: np.ndarray) -> np.ndarray:
        feeds = {"input_ids": _value(decoder_ids[:, -1:]), "encoder_attention_mask": state.attention_mask}  # (b, 1)
        feeds.update(zip(self.cross_names, state.cross))
        feeds.update(zip(self.past_names, state.past))
        logits, *present = self.open_graph("decoder").run_with_ort_values(self.outputs, feeds)
        state.past = present  # (b, h, p + 1, d) each, handed to the next step as they are
        return logits.numpy()[:, -1, :]  # (b, V) float32, a view of ORT's buffer
