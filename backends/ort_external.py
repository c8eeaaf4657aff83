"""Someone else's ONNX export as a backend: a Hugging Face Optimum-layout folder run by ORT
through the project's own decoding loop, next to the reference it claims to be.

    encoder_model.onnx            input_ids, attention_mask (b, s) -> last_hidden_state (b, s, d_model)
    decoder_model_merged.onnx     one graph, an If on `use_cache_branch` (Optimum's default output), or
    decoder_model.onnx            the first step: input_ids (b, t), encoder_hidden_states,
                                  encoder_attention_mask -> logits, present.{i}.decoder.key/value and
                                  present.{i}.encoder.key/value (cross-attention, made here once)
    decoder_with_past_model.onnx  later steps: the newest token, past_key_values.{i}.decoder.* (b, h, p, d)
                                  and past_key_values.{i}.encoder.* (b, h, s, d) -> logits, present.{i}.decoder.*

(`optimum-cli export onnx --task text2text-generation-with-past` writes all four; the merged graph is
used when present.) Variants with a suffix (`encoder_model_quantized.onnx`, `*_fp16.onnx`) are picked
by naming the encoder file instead of the folder. Graphs may keep their weights in external data
files. Every IO name, the layer count and the cache layout are read from the graphs themselves;
heads and head size from the past inputs' shapes (config.json when those are symbolic).

Before anything runs, the folder must belong to the reference export (`check`): config.json's
vocabulary size, special ids and model type, the graph's logits width, and the tokenizer (every
id's piece, special ids, sentencepiece files, the encoding of probe sentences) are compared with
the reference's sidecar and tokenizer; every difference is named in one `ExternalExportError`.
The backend then tokenizes with the reference's own tokenizer, and decodes with the reference's
generation rules: what differs between the two is the graphs' numbers.

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

from .manifest import Manifest, sha256_file
from .ort_session import SessionConfig, create_session, gather_rows_graph, session_info

LAYOUT = "Hugging Face Optimum (text2text-generation-with-past)"
ENCODER, MERGED = "encoder_model", "decoder_model_merged"
DECODER, WITH_PAST = "decoder_model", "decoder_with_past_model"
_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
# Graph inputs by what they carry, with the names Optimum (and older exporters) give them.
_ROLES = {
    "ids": ("input_ids", "decoder_input_ids"),
    "encoder_mask": ("encoder_attention_mask",),
    "hidden": ("encoder_hidden_states",),
    "decoder_mask": ("decoder_attention_mask", "attention_mask"),
    "cache_position": ("cache_position",),
    "branch": ("use_cache_branch",),
}
_QUANTIZED_OPS = {
    "MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul", "QuantizeLinear", "DequantizeLinear",
    "DynamicQuantizeMatMul", "MatMulNBits", "QAttention", "QGemm", "ConvInteger", "QLinearConv",
}
# Sentences whose encodings must agree token for token: words, numbers, punctuation, accents, symbols.
PROBE_TEXTS = (
    "Hello world.",
    "Click outside the spreadsheet to view the slide.",
    "On 3 May 2024 the 12 cats' owner paid $1,250.75 (tax included), didn't she?",
    "Naïve café façades — “quoted” — and e-mail@example.com.",
)


class ExternalExportError(ValueError):
    """The folder is not a runnable export of the reference model; the message names what differs."""


def _value(array: np.ndarray) -> ort.OrtValue:
    # The OrtValue wraps the array's buffer and holds a reference to it.
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


def parse_external(values: list[str]) -> dict[str, str]:
    """Command-line `--external NAME=DIR` values (app.py, bench.parity) as {NAME: DIR}; ValueError
    naming a malformed or repeated one."""
    external: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--external: expected NAME=DIR, got {value!r}")
        if name.strip() in external:
            raise ValueError(f"--external: the name {name.strip()!r} is given twice")
        external[name.strip()] = path.strip()
    return external


# --- the folder --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Which graph files of a folder are run."""

    folder: Path  # the graphs' folder
    meta: Path  # config.json and the tokenizer files: the graphs' folder, or its parent (an onnx/ subfolder)
    encoder: Path
    merged: Path | None  # decoder_model_merged{suffix}.onnx, used when present
    decoder: Path | None  # decoder_model{suffix}.onnx (first step) when not merged
    with_past: Path | None  # decoder_with_past_model{suffix}.onnx when not merged

    @property
    def graphs(self) -> list[Path]:
        return [p for p in (self.encoder, self.merged, self.decoder, self.with_past) if p is not None]

    @property
    def kind(self) -> str:
        return "merged decoder" if self.merged else "decoder + decoder with past"


def find_layout(path: str | Path) -> Layout:
    """`path`: an Optimum export folder (or its onnx/ subfolder), or one variant's encoder file
    (`DIR/encoder_model_quantized.onnx` runs the `_quantized` graphs). Raises ExternalExportError."""
    path = Path(path)
    if path.is_file():
        m = re.fullmatch(rf"{ENCODER}(.*)\.onnx", path.name)
        if not m:
            raise ExternalExportError(f"{path}: expected a folder or an {ENCODER}*.onnx file")
        folder, suffixes = path.parent, [m[1]]
    elif path.is_dir():
        folder = path
        if not list(folder.glob(f"{ENCODER}*.onnx")) and (folder / "onnx").is_dir():
            folder = folder / "onnx"  # transformers.js-style: config and tokenizer above, graphs in onnx/
        suffixes = sorted(p.name[len(ENCODER) : -len(".onnx")] for p in folder.glob(f"{ENCODER}*.onnx"))
    else:
        raise ExternalExportError(f"{path}: no such folder or file")
    if not suffixes:
        raise ExternalExportError(
            f"{path}: no {ENCODER}.onnx: not an Optimum-layout export (expected {ENCODER}.onnx with "
            f"{MERGED}.onnx, or with {DECODER}.onnx and {WITH_PAST}.onnx, as `optimum-cli export onnx "
            "--task text2text-generation-with-past` writes)"
        )
    if len(suffixes) > 1:
        variants = ", ".join(f"{ENCODER}{s}.onnx" for s in suffixes)
        raise ExternalExportError(
            f"{path} holds several variants ({variants}); name the one to run by its encoder file, "
            f"e.g. {folder / (ENCODER + suffixes[-1] + '.onnx')}"
        )
    suffix = suffixes[0]

    def graph(stem: str) -> Path | None:
        p = folder / f"{stem}{suffix}.onnx"
        return p if p.is_file() else None

    merged, decoder, with_past = graph(MERGED), graph(DECODER), graph(WITH_PAST)
    if merged is None and (decoder is None or with_past is None):
        present = ", ".join(sorted(p.name for p in folder.glob("*.onnx"))) or "no .onnx files"
        raise ExternalExportError(
            f"{folder}: {ENCODER}{suffix}.onnx needs {MERGED}{suffix}.onnx, or both {DECODER}{suffix}.onnx "
            f"and {WITH_PAST}{suffix}.onnx (a decoder with a KV cache: --task text2text-generation-with-past); "
            f"found: {present}"
        )
    above = not (folder / "config.json").is_file() and (folder.parent / "config.json").is_file()
    meta = folder.parent if above else folder
    return Layout(folder, meta, folder / f"{ENCODER}{suffix}.onnx", merged,
                  None if merged else decoder, None if merged else with_past)


# --- provenance: what the graphs are, read without their weights -------------------------------------


def _graph_tensors(graph) -> list:
    """Every initializer of a graph and of its subgraphs (a merged decoder's If branches)."""
    from onnx import AttributeProto

    tensors = list(graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                tensors += _graph_tensors(attr.g)
            elif attr.type == AttributeProto.GRAPHS:
                for g in attr.graphs:
                    tensors += _graph_tensors(g)
    return tensors


def _op_types(graph) -> set[str]:
    from onnx import AttributeProto

    ops = set()
    for node in graph.node:
        ops.add(node.op_type)
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == AttributeProto.GRAPH else list(attr.graphs)
            for g in subgraphs:
                ops |= _op_types(g)
    return ops


def _shape(value_info) -> list[int | str]:
    dims = value_info.type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]


def _locations(tensors) -> list[str]:
    """The external data files the tensors' weights are in, relative to the graph's folder."""
    import onnx

    return sorted({
        entry.value
        for t in tensors
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    })


def files_read(layout: Layout, manifest: Manifest) -> list[Path]:
    """Every file `load` reads from the folder: config.json, the tokenizer files the reference's
    sidecar lists (compared with its own), each graph and its external data. What a copy of the
    export elsewhere (bench/engine/model_files.py) must hold."""
    import onnx

    files = [layout.meta / "config.json", *(layout.meta / f for f in manifest.tokenizer_files)]
    for graph in layout.graphs:
        tensors = _graph_tensors(onnx.load(str(graph), load_external_data=False).graph)
        files += [graph, *(graph.parent / f for f in _locations(tensors))]
    return list(dict.fromkeys(files))


def describe_graph(path: Path) -> dict[str, Any]:
    """A graph file's provenance and the facts `check` needs: {file, bytes, sha256, opset, producer,
    ir_version, external_data: [{file, bytes, sha256}], precision, logits_shape}. Reads the graph
    without its external data (the weights stay on disk)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    tensors = _graph_tensors(model.graph)
    locations = _locations(tensors)
    elements = {onnx.TensorProto.FLOAT: 0, onnx.TensorProto.FLOAT16: 0}
    for t in tensors:
        if t.data_type in elements:
            elements[t.data_type] += int(np.prod(t.dims)) if len(t.dims) else 1
    if _op_types(model.graph) & _QUANTIZED_OPS:
        precision = "int8"
    elif elements[onnx.TensorProto.FLOAT16] > elements[onnx.TensorProto.FLOAT]:
        precision = "fp16"
    else:
        precision = "fp32"
    outputs = {o.name: o for o in model.graph.output}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    data = []
    for location in locations:
        file = path.parent / location
        data.append({"file": location, "bytes": file.stat().st_size if file.is_file() else None,
                     "sha256": sha256_file(file) if file.is_file() else None})
    return {
        "file": path.name,
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
        "opset": opset,
        "producer": f"{model.producer_name} {model.producer_version}".strip() or None,
        "ir_version": model.ir_version,
        "external_data": data,
        "precision": precision,
        "logits_shape": _shape(outputs["logits"]) if "logits" in outputs else None,
    }


# --- does it belong to the reference? -------------------------------------------------------------


def _config_differences(config: dict[str, Any], manifest: Manifest) -> list[str]:
    special = manifest.special
    out = []
    for key, want in (("model_type", manifest.family), ("vocab_size", manifest.vocab_size),
                      ("pad_token_id", special.pad), ("eos_token_id", special.eos),
                      ("decoder_start_token_id", special.decoder_start)):
        got = config.get(key)
        if key == "decoder_start_token_id" and got is None:
            continue  # not recorded: the model's config falls back to its own rule, which the logits check covers
        if got != want and not (isinstance(got, list) and want in got):
            out.append(f"config.json {key} is {got!r}, the reference's {want!r}")
    return out


def _tokenizer_differences(folder: Path, manifest: Manifest, reference) -> list[str]:
    """Compare the folder's tokenizer with the reference's (a `TokenizerWrapper`)."""
    from .tokenizer import TokenizerWrapper

    wanted = manifest.tokenizer_files
    missing = [f for f in wanted if not (folder / f).is_file()]
    if missing:
        return [f"tokenizer files missing: {', '.join(missing)} (the reference has {', '.join(wanted)}; "
                "copy the tokenizer the model was exported with next to the graphs)"]
    out = []
    for name in wanted:  # sentencepiece models are copied byte for byte by save_pretrained
        if name.endswith((".spm", ".model")) and sha256_file(folder / name) != sha256_file(manifest.root / name):
            out.append(f"{name} differs from the reference's (sha256)")
    try:
        theirs = TokenizerWrapper(folder, src_lang=reference.src_lang, tokenizer_class=manifest.tokenizer_class)
    except Exception as e:  # reported as a difference: the message is what the user needs
        return [*out, f"its tokenizer does not load as {manifest.tokenizer_class}: {type(e).__name__}: {e}"]
    for what in ("pad_id", "eos_id"):
        if getattr(theirs, what) != getattr(reference, what):
            out.append(f"tokenizer {what} is {getattr(theirs, what)}, the reference's {getattr(reference, what)}")
    ids = list(range(manifest.vocab_size))
    mine, yours = reference.pieces(ids), theirs.pieces(ids)
    differing = [i for i, (a, b) in enumerate(zip(mine, yours)) if a != b]
    if differing:
        i = differing[0]
        out.append(f"tokenizer: {len(differing)} of {len(ids)} ids map to other pieces (id {i}: "
                   f"{yours[i]!r} here, {mine[i]!r} in the reference)")
    for text in PROBE_TEXTS:
        a = reference.encode([text], 10_000).input_ids[0].tolist()
        b = theirs.encode([text], 10_000).input_ids[0].tolist()
        if a != b:
            out.append(f"tokenizer: {text!r} encodes to {b[:12]}… here, {a[:12]}… in the reference")
            break
    return out


def check(layout: Layout, manifest: Manifest, reference_tokenizer, graphs: list[dict[str, Any]]) -> dict[str, Any]:
    """Raise ExternalExportError naming every difference from the reference; return what was checked."""
    problems = []
    config_path = layout.meta / "config.json"
    config: dict[str, Any] = {}
    if not config_path.is_file():
        problems.append(f"no config.json in {layout.meta} (Optimum writes the model's config next to the graphs)")
    else:
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            problems.append(f"{config_path} is not valid JSON: {e}")
        problems += _config_differences(config, manifest)
    for g in graphs:
        shape = g["logits_shape"]
        if shape is not None and isinstance(shape[-1], int) and shape[-1] != manifest.vocab_size:
            problems.append(f"{g['file']} outputs logits over {shape[-1]} ids, the reference's vocabulary has "
                            f"{manifest.vocab_size}")
    problems += _tokenizer_differences(layout.meta, manifest, reference_tokenizer)
    if problems:
        raise ExternalExportError(
            f"{layout.folder} is not an export of the reference model ({manifest.root}): " + "; ".join(problems)
        )
    return {
        "config": {k: config.get(k) for k in ("model_type", "architectures", "vocab_size", "d_model",
                                              "decoder_layers", "transformers_version") if k in config},
        "checked": [
            f"vocabulary: {manifest.vocab_size} ids (config.json and the logits)",
            "special ids: pad, eos, decoder start",
            f"tokenizer: every id's piece, pad/eos ids, sentencepiece files, {len(PROBE_TEXTS)} probe sentences",
        ],
    }


# --- the engine -------------------------------------------------------------------------------------


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

    def keep(self, state: _State, rows: np.ndarray) -> None:
        """Only `rows` go on; the caches, the mask and the encoder output shrink."""
        if state.past is not None:
            state.past, state.cross = self._gather(state.past, rows), self._gather(state.cross, rows)
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
        if n > 1 and not np.array_equal(decoder_ids, np.repeat(decoder_ids[::n], n, axis=0)):
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
