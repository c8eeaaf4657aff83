"""BART's layout, which Marian, M2M100/NLLB and mBART-50 share: one graph wrapper, one attention
core, one module naming; the entries' flags say where the norms sit and whether the extra ones exist."""

from __future__ import annotations

import re

from .family import Layout

_POST_NORM_PARTS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn", "self_attn_layer_norm",
     "fc1", "activation_fn", "fc2", "final_layer_norm"),
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn", "self_attn_layer_norm",
     "encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj", "encoder_attn", "encoder_attn_layer_norm",
     "fc1", "activation_fn", "fc2", "final_layer_norm"),
)
# Pre-norm: each sub-layer's LayerNorm runs before it, on its input.
_PRE_NORM_PARTS = (
    ("self_attn_layer_norm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn",
     "final_layer_norm", "fc1", "activation_fn", "fc2"),
    ("self_attn_layer_norm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn",
     "encoder_attn_layer_norm", "encoder_attn.q_proj", "encoder_attn.k_proj", "encoder_attn.v_proj", "encoder_attn",
     "final_layer_norm", "fc1", "activation_fn", "fc2"),
)


class BartNaming:
    """HF's module paths below the model's `.model`: `encoder.layers.N.fc1`, `decoder.layer_norm`, `lm_head`."""

    # Scopes of the wrappers (export/wrappers.py) -> HF paths; their submodules keep HF's names.
    wrapper_scopes = {
        "export.wrappers.EncoderWithCrossKV": (
            (r"^layers\.", "encoder.layers."),
            (r"^cross_attn\.(\d+)(?=\.|$)", r"decoder.layers.\1.encoder_attn"),
            (r"^embed_tokens$", "encoder.embed_tokens"),
            (r"^layernorm_embedding$", "encoder.layernorm_embedding"),
            (r"^layer_norm$", "encoder.layer_norm"),
        ),
        "export.wrappers.DecoderStepWithCache": (
            (r"^layers\.", "decoder.layers."),
            (r"^embed_tokens$", "decoder.embed_tokens"),
            (r"^layernorm_embedding$", "decoder.layernorm_embedding"),
            (r"^layer_norm$", "decoder.layer_norm"),
            (r"^lm_head$", "lm_head"),
        ),
    }
    # Anything else (HF's own forward, other exporters' wrappers): the HF path inside the scope.
    hf_path = re.compile(
        r"(?:^|\.)((?:encoder|decoder)\.(?:layers\.\d+(?:\.\w+)*|embed_tokens|layernorm_embedding|layer_norm)|lm_head)$"
    )
    # The cross-attention keys and values: decoder modules computed over the source.
    over_source = re.compile(r"^decoder\.layers\.\d+\.encoder_attn\.[kv]_proj$")

    def order(self, family, encoder_layers: int, decoder_layers: int) -> list[str]:
        """Every module locate compares, in execution order. `family`: anything with the entry's
        `pre_norm`, `embedding_norm` and `final_norm` flags (a Family, or the sidecar's section)."""
        flags = family if isinstance(family, dict) else vars(family)
        enc_parts, dec_parts = _PRE_NORM_PARTS if flags.get("pre_norm", False) else _POST_NORM_PARTS
        emb_norm = flags.get("embedding_norm", False)
        final = flags.get("final_norm", False)

        def stack(side: str, layers: int, parts) -> list[str]:
            return [
                f"{side}.embed_tokens",
                *([f"{side}.layernorm_embedding"] if emb_norm else []),
                *(f"{side}.layers.{i}.{p}" for i in range(layers) for p in parts),
                *([f"{side}.layer_norm"] if final else []),
            ]

        return [*stack("encoder", encoder_layers, enc_parts), *stack("decoder", decoder_layers, dec_parts), "lm_head"]


def bart_shape(config) -> dict:
    """The sidecar's "model" facts, read from a BART-style config's attribute names."""
    return {
        "d_model": config.d_model,
        "encoder_layers": config.encoder_layers,
        "decoder_layers": config.decoder_layers,
        "encoder_attention_heads": config.encoder_attention_heads,
        "decoder_attention_heads": config.decoder_attention_heads,
        "head_dim": config.d_model // config.decoder_attention_heads,
        "encoder_ffn_dim": config.encoder_ffn_dim,
        "decoder_ffn_dim": config.decoder_ffn_dim,
        "activation_function": config.activation_function,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
    }


BART = Layout(name="bart", wrappers="export.wrappers", attention="export.attention", naming=BartNaming(),
              shape=bart_shape)
