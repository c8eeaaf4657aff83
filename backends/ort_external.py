"""Someone else's ONNX export as a backend: a Hugging Face Optimum-layout folder (`external_layout`)
run by ORT through the project's own decoding loop, next to the reference it claims to be.

Every IO name, the layer count and the cache layout are read from the graphs themselves; heads and
head size from the past inputs' shapes (config.json when those are symbolic). Before anything
runs, the folder must belong to the reference export (`external_check.check`). The backend then
tokenizes with the reference's own tokenizer, and decodes with the reference's generation rules:
what differs between the two is the graphs' numbers.

Beam search: the first step runs once per sentence (its rows are identical: the start token) and
its caches are then repeated per beam, so cross-attention keys/values are computed once per
sentence; later reorders gather the self-attention cache's rows with a small ORT Gather graph on
the OrtValues themselves (as `ort_kv_cache` does). Cross-attention rows are the same for every beam
of a sentence and are never reordered.

Imports numpy, onnxruntime and onnx (graph metadata only), never torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from .base import beams_are_copies
from .external_check import PROBE_TEXTS, check  # noqa: F401  (this module's API too)
from .external_layout import (  # noqa: F401  (this module's API too)
    LAYOUT,
    ExternalExportError,
    Layout,
    describe_graph,
    files_read,
    find_layout,
    parse_external,
)
from .manifest import Manifest
from .ort_session import SessionConfig, create_session, gather_rows_graph, session_info

_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
# Graph inputs by what they carry, with the names Optimum and other exporters give them.
_ROLES = {
    "ids": ("input_ids", "decoder_input_ids"),
    "encoder_mask": ("encoder_attention_mask",),
    "hidden": ("encoder_hidden_states",),
    "decoder_mask": ("decoder_attention_mask", "attention_mask"),
    "cache_position": ("cache_position",),
    "branch": ("use_cache_branch",),
}


def _value(array: np.ndarray) -> ort.OrtValue:
    # The OrtValue wraps the array's buffer and holds a reference to it.
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


def _kv_names(names: list[str], prefix: str, where: str) -> tuple[list[str], list[str]]:
    """(self-attention, cross-attention) cache names among `names`, layer by layer, key then value:
    `{prefix}.{i}.decoder.key` ... and `{prefix}.{i}.encoder.key` ...; ([], []) when there are none."""
    found: dict[tuple[str, int, str], str] = {}
    for n in names:
        m = re.fullmatch(rf"{re.escape(prefix)}\.(\d+)\.(decoder|encoder)\.(key|value)", n)
        if m:
            found[(m[2], int(m[1]), m[3])] = n
    result = []
    for kind in ("decoder", "encoder"):
        count = 1 + max((layer for k, layer, _ in found if k == kind), default=-1)
        expected = [(kind, layer, kv) for layer in range(count) for kv in ("key", "value")]
        missing = [f"{prefix}.{layer}.{k}.{kv}" for k, layer, kv in expected if (k, layer, kv) not in found]
        if missing:
            raise ExternalExportError(f"{where}: cache names incomplete, missing {', '.join(missing)}")
        result.append([found[e] for e in expected])
    return result[0], result[1]


@dataclass
class _Decoder:
    """One decoder graph and what each of its inputs carries."""

    session: Any
    path: Path
    roles: dict[str, str]  # role -> input name
    past_self: list[str]  # past_key_values.{i}.decoder.key/value
    past_cross: list[str]  # past_key_values.{i}.encoder.key/value
    present_self: list[str]  # present.{i}.decoder.key/value
    present_cross: list[str]  # present.{i}.encoder.key/value (from the first step only)
    cache_dtype: Any
    heads: int | None
    head_dim: int | None


def _decoder(path: Path, config: SessionConfig) -> _Decoder:
    session = create_session(path, config)
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = [o.name for o in session.get_outputs()]
    where = path.name
    past_self, past_cross = _kv_names(list(inputs), "past_key_values", where)
    present_self, present_cross = _kv_names(outputs, "present", where)
    roles = {}
    for role, names in _ROLES.items():
        name = next((n for n in names if n in inputs), None)
        if name is not None:
            roles[role] = name
    unknown = [n for n in inputs if n not in {*roles.values(), *past_self, *past_cross}]
    missing = [f"{' or '.join(_ROLES[r])}" for r in ("ids", "encoder_mask") if r not in roles]
    if unknown or missing or "logits" not in outputs or not present_self:
        raise ExternalExportError(
            f"{where}: not a seq2seq decoder this backend can feed"
            + (f"; unknown inputs: {', '.join(unknown)}" if unknown else "")
            + (f"; no input {', '.join(missing)}" if missing else "")
            + ("; no 'logits' output" if "logits" not in outputs else "")
            + ("; no present.{i}.decoder.key/value outputs (export with --task text2text-generation-with-past)"
               if not present_self else "")
            + f". Its inputs: {', '.join(inputs)}; outputs: {', '.join(outputs)}"
        )
    heads = head_dim = None
    cache_dtype = np.float32
    if past_self:
        first = inputs[past_self[0]]
        cache_dtype = _NP_TYPES.get(first.type, np.float32)
        if len(first.shape) == 4:
            heads = first.shape[1] if isinstance(first.shape[1], int) else None
            head_dim = first.shape[3] if isinstance(first.shape[3], int) else None
    return _Decoder(
        session, path, roles, past_self, past_cross, present_self, present_cross, cache_dtype, heads, head_dim
    )


@dataclass
class _State:
    mask: np.ndarray  # (rows, s) int64, the buffer behind attention_mask
    attention_mask: ort.OrtValue
    hidden: ort.OrtValue  # (rows, s, d_model): the encoder's output, read by the first step
    repeat: int = 1  # from expand: rows per sentence, made right after the first step
    cross: list = field(default_factory=list)  # per layer key, value: (rows, h, s, d), from the first step
    past: list | None = None  # per layer key, value: (rows, h, p, d); None before the first step
    length: int = 0  # p, the positions in the self-attention cache


class ExternalStepModel:
    """A `StepModel` over an Optimum-layout folder (see the module docstring)."""

    def __init__(self, layout: Layout, config: SessionConfig, model_config: dict[str, Any] | None = None):
        self.layout = layout
        self.encoder = create_session(layout.encoder, config)
        enc_inputs = [i.name for i in self.encoder.get_inputs()]
        unknown = [n for n in enc_inputs if n not in ("input_ids", "attention_mask")]
        if "input_ids" not in enc_inputs or unknown:
            raise ExternalExportError(
                f"{layout.encoder.name}: expected inputs input_ids and attention_mask, got {', '.join(enc_inputs)}"
            )
        self.encoder_inputs = enc_inputs
        enc_outputs = [o.name for o in self.encoder.get_outputs()]
        self.hidden_name = "last_hidden_state" if "last_hidden_state" in enc_outputs else enc_outputs[0]
        if layout.merged is not None:
            self.first = self.later = _decoder(layout.merged, config)
            if "branch" not in self.first.roles:
                raise ExternalExportError(f"{layout.merged.name}: a merged decoder without a use_cache_branch input")
        else:
            self.first, self.later = _decoder(layout.decoder, config), _decoder(layout.with_past, config)
            if self.first.past_self:
                raise ExternalExportError(f"{layout.decoder.name}: the first-step decoder takes a past cache; "
                                          f"expected none (the cache comes from {layout.with_past.name})")
        later = self.later
        if (not later.past_self or len(later.past_self) != len(self.first.present_self)
                or len(later.past_cross) != len(self.first.present_cross)):
            raise ExternalExportError(
                f"{later.path.name}: its past inputs ({len(later.past_self)} self-attention, {len(later.past_cross)} "
                f"cross-attention) do not match {self.first.path.name}'s outputs ({len(self.first.present_self)}, "
                f"{len(self.first.present_cross)})"
            )
        if "hidden" not in self.first.roles:
            raise ExternalExportError(f"{self.first.path.name}: no encoder_hidden_states input for the first step")
        model_config = model_config or {}
        heads = later.heads or model_config.get("decoder_attention_heads")
        d_model = model_config.get("d_model")
        head_dim = later.head_dim or (d_model // heads if heads and d_model else None)
        if not heads or not head_dim:
            raise ExternalExportError(f"{later.path.name}: the cache's heads and head size are symbolic, and "
                                      "config.json has no decoder_attention_heads/d_model to take them from")
        self.heads, self.head_dim = int(heads), int(head_dim)
        self.layers = len(later.past_self) // 2
        self._config = config
        self._gathers: dict[tuple[int, str], Any] = {}

    # -- beam search's row gathers, on OrtValues (as ort_kv_cache.KVCacheStepModel._gather) --

    def _gather(self, values: list[ort.OrtValue], index: np.ndarray) -> list[ort.OrtValue]:
        if not values:
            return []
        key = (len(values), values[0].data_type())
        if key not in self._gathers:
            # No arena: the cache grows every step, and an arena would keep its largest size.
            self._gathers[key] = create_session(gather_rows_graph(*key), self._config, memory_arena=False)
        feeds = {"index": _value(index.astype(np.int64))}
        feeds.update((f"x{i}", v) for i, v in enumerate(values))
        return list(self._gathers[key].run_with_ort_values([f"y{i}" for i in range(len(values))], feeds))

    # -- StepModel --

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> _State:
        mask = np.ascontiguousarray(attention_mask, dtype=np.int64)
        mask_value = _value(mask)
        feeds = {"input_ids": _value(np.asarray(input_ids, dtype=np.int64))}
        if "attention_mask" in self.encoder_inputs:
            feeds["attention_mask"] = mask_value
        (hidden,) = self.encoder.run_with_ort_values([self.hidden_name], feeds)  # (b, s, d_model)
        return _State(mask, mask_value, hidden)

    def expand(self, state: _State, n: int) -> None:
        """n rows per sentence ([s0 x n, s1 x n, ...]): made after the first step, which runs once per
        sentence, so each sentence's cross-attention keys/values are computed once."""
        if state.past is None:
            state.repeat = n
            return
        index = np.repeat(np.arange(state.mask.shape[0]), n)  # after a first step: repeat the caches now
        state.past, state.cross = self._gather(state.past, index), self._gather(state.cross, index)
        self._repeat_source(state, n)

    def reorder(self, state: _State, beam_idx: np.ndarray) -> None:
        """Row i of the self-attention cache continues from row beam_idx[i]; the cross-attention rows
        are the same for every beam of a sentence and stay where they are."""
        state.past = self._gather(state.past, beam_idx)  # (rows, h, p, d) each

    def keep(self, state: _State, rows: np.ndarray, parents: np.ndarray | None = None) -> None:
        """Only `rows` go on; the caches, the mask and the encoder output shrink. With `parents`,
        kept row i continues from row parents[i] (a row of the same sentence, so the same source)."""
        if state.past is not None:
            index = rows if parents is None else parents
            state.past, state.cross = self._gather(state.past, index), self._gather(state.cross, index)
        state.mask = np.ascontiguousarray(state.mask[rows])
        state.attention_mask = _value(state.mask)
        state.hidden = _value(np.ascontiguousarray(state.hidden.numpy()[rows]))

    def _repeat_source(self, state: _State, n: int) -> None:
        """The encoder's mask and output, n rows per sentence."""
        state.mask = np.repeat(state.mask, n, axis=0)  # (b * n, s)
        state.attention_mask = _value(state.mask)
        state.hidden = _value(np.repeat(state.hidden.numpy(), n, axis=0))  # (b * n, s, d_model)

    def _feeds(self, graph: _Decoder, state: _State, ids: np.ndarray, cached: bool) -> dict[str, ort.OrtValue]:
        rows, t = ids.shape
        feeds = {graph.roles["ids"]: _value(ids), graph.roles["encoder_mask"]: state.attention_mask}
        if "hidden" in graph.roles:
            feeds[graph.roles["hidden"]] = state.hidden
        if "branch" in graph.roles:
            feeds[graph.roles["branch"]] = _value(np.array([cached]))
        if "cache_position" in graph.roles:
            feeds[graph.roles["cache_position"]] = _value(np.arange(state.length, state.length + t, dtype=np.int64))
        if "decoder_mask" in graph.roles:
            feeds[graph.roles["decoder_mask"]] = _value(np.ones((rows, state.length + t), dtype=np.int64))
        if cached:
            feeds.update(zip(graph.past_self, state.past))
            feeds.update(zip(graph.past_cross, state.cross))
        elif graph.past_self:  # a merged graph's no-cache branch still takes (ignored) empty pasts
            empty = _value(np.zeros((rows, self.heads, 0, self.head_dim), dtype=graph.cache_dtype))  # (rows, h, 0, d)
            feeds.update((name, empty) for name in [*graph.past_self, *graph.past_cross])
        return feeds

    def _first_step(self, state: _State, decoder_ids: np.ndarray) -> np.ndarray:
        n = state.repeat
        if n > 1 and not beams_are_copies(decoder_ids, n):
            self._repeat_source(state, n)  # beams already differ: no row to share, run them all
            n = 1
        graph = self.first
        ids = np.ascontiguousarray(decoder_ids[::n], dtype=np.int64)  # (b, t): one row per sentence
        names = ["logits", *graph.present_self, *graph.present_cross]
        logits, *present = graph.session.run_with_ort_values(names, self._feeds(graph, state, ids, cached=False))
        past, cross = present[: len(graph.present_self)], present[len(graph.present_self) :]
        logits = logits.numpy()[:, -1, :]  # (b, V)
        if n > 1:
            index = np.repeat(np.arange(ids.shape[0]), n)  # rows [s0 x n, s1 x n, ...]
            past, cross = self._gather(past, index), self._gather(cross, index)
            logits = np.repeat(logits, n, axis=0)  # (b * n, V)
            self._repeat_source(state, n)
        state.past, state.cross, state.length, state.repeat = list(past), list(cross), ids.shape[1], 1
        return logits

    def step(self, state: _State, decoder_ids: np.ndarray) -> np.ndarray:
        if state.past is None:
            return self._first_step(state, decoder_ids)
        graph = self.later
        ids = np.ascontiguousarray(decoder_ids[:, -1:], dtype=np.int64)  # (rows, 1): the newest token
        logits, *present = graph.session.run_with_ort_values(
            ["logits", *graph.present_self], self._feeds(graph, state, ids, cached=True)
        )
        state.past = present  # (rows, h, p + 1, d) each
        state.length += 1
        return logits.numpy()[:, -1, :]  # (rows, V)


def _probe_vocab(model: ExternalStepModel, special) -> int:
    """The logits width, by running one step (for graphs whose vocabulary axis is symbolic)."""
    state = model.encode(np.array([[special.eos]], dtype=np.int64), np.ones((1, 1), dtype=np.int64))
    return int(model.step(state, np.array([[special.decoder_start]], dtype=np.int64)).shape[-1])


def load(name: str, path: str | Path, manifest: Manifest, tokenizer, session: SessionConfig):
    """The `Backend` named `name` over the Optimum-layout export at `path`, checked against the
    reference export (`manifest`, its `tokenizer`). Raises ExternalExportError naming what differs."""
    from .backend import Backend

    layout = find_layout(path)
    graphs = [describe_graph(p) for p in layout.graphs]
    checked = check(layout, manifest, tokenizer, graphs)
    config = json.loads((layout.meta / "config.json").read_text(encoding="utf-8"))
    model = ExternalStepModel(layout, session, config)
    widths = [g["logits_shape"][-1] for g in graphs if g["logits_shape"]]
    vocab = next((w for w in widths if isinstance(w, int)), None)
    if vocab is None:
        vocab = _probe_vocab(model, manifest.special)
        if vocab != manifest.vocab_size:
            raise ExternalExportError(f"{layout.folder}: its logits cover {vocab} ids, the reference's vocabulary "
                                      f"has {manifest.vocab_size}")
    precisions = {g["precision"] for g in graphs}
    precision = next(p for p in ("int8", "fp16", "fp32") if p in precisions)
    info = session_info(model.later.session, model.later.path, session, precision)
    info["graph"] = " + ".join(p.name for p in layout.graphs)
    info["source"] = {
        "layout": f"{LAYOUT}, {layout.kind}",
        "folder": str(layout.folder),
        "files": graphs,
        "cache": {"layers": model.layers, "heads": model.heads, "head_dim": model.head_dim,
                  "dtype": np.dtype(model.later.cache_dtype).name},
        "reorder": "ORT Gather of the self-attention cache rows; cross-attention once per sentence",
        "decoding": "the reference's tokenizer and generation rules (its sidecar), this folder's graphs",
        **checked,
    }
    return Backend(name, model, tokenizer, manifest, info)
