"""What a family entry says: its identity, its files, its graph layout, its fixtures.

Standard library only: the backends, the request layer, the UI and the benchmark's peers (whose
environment has another transformers) read these entries, and none of them may pull in torch.
Code that needs torch or onnx is named here by module path and imported where it runs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Layout:
    """How a family's graphs are written and how their modules are named; near relatives share one.

    `wrappers`: the module whose `EncoderWithCrossKV` and `DecoderStepWithCache` write the KV-cache
    graphs over the HF model's own submodules. `attention`: the module whose `fuse_attention_file`
    matches the attention core those wrappers write (a graph without it is left as is). `naming`: what
    `service/locate_graph.py` reads: `order(family, encoder_layers, decoder_layers)` (every module
    it reports, in execution order), `wrapper_scopes` ({wrapper class: ((scope regex, HF path), ...)}),
    `hf_path` (the HF path inside any other scope) and `over_source` (decoder modules computed over
    the source positions). `shape(config)`: the sidecar's "model" facts (layers, heads, head_dim,
    d_model, ffn dims, activation, vocab size, position limit) from the family's HF config, whose
    attribute names differ between layouts; the graph specs and limits are read from those."""

    name: str
    wrappers: str
    attention: str
    naming: Any
    shape: Callable[[Any], dict]

    def wrapper_module(self):
        return importlib.import_module(self.wrappers)

    def attention_module(self):
        return importlib.import_module(self.attention)


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str  # the sidecar's "family"
    title: str  # for messages: "Marian", "M2M100/NLLB", "mBART-50"
    model_type: str  # config.json's model_type
    architecture: str  # the transformers class exported (config.json's architectures)
    tokenizer_classes: tuple[str, ...]  # transformers tokenizer classes this family ships with
    pre_norm: bool  # LayerNorm before each sub-layer (else after the residual sum)
    positions: str  # "sinusoidal" | "sinusoidal_padding_offset" | "learned_offset" | "relative" (T5's buckets)
    position_offset: int  # rows of the position table before position 0 (learned_offset)
    embedding_norm: bool  # LayerNorm right after token + position embedding (mBART)
    final_norm: bool  # LayerNorm after the last encoder layer and after the last decoder layer
    logits_bias: bool  # final_logits_bias added to the output layer
    layout: Layout
    # The model's published name in the app's heading, by tokenizer class where one family serves
    # several published models (`label` for any other class).
    label: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    # A local model folder's tokenizer files: all of a tuple's strings, one of each frozenset.
    tokenizer_files: tuple = ()
    # Tokenizer files the export must hold besides those save_pretrained reports writing, and those
    # it writes that the family's tokenizer never reads back (left out of the export).
    export_tokenizer_files: tuple[str, ...] = ()
    unsaved_tokenizer_files: tuple[str, ...] = ()
    # generate() never emits pad when the config names no bad words (Marian's config default).
    bans_pad: bool = False
    # The tokenizer's language codes (None: the family has none) and the defaults: English in,
    # Chinese out, as the rest of the product; per tokenizer class where its codes differ.
    default_src_lang: str | None = None
    default_tgt_lang: str | None = None
    tokenizer_languages: Mapping[str, tuple[str, str]] = field(default_factory=dict, hash=False)
    # A family whose target language is a token before the source text (MADLAD-400's "<2zh>"): its
    # template. The codes are the vocabulary's tokens of that form; a vocabulary without any has none.
    target_token: str | None = None
    example_hub_ids: tuple[str, ...] = ()
    # Random-weight model folders for tests and benchmarks (export/fixtures.py): name -> recipe,
    # an object with `sample_pairs` and `build(folder, pairs, seed)`.
    fixtures: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def label_for(self, tokenizer_class: str) -> str:
        return self.labels.get(tokenizer_class, self.label)
