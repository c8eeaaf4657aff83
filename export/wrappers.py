"""Export-friendly forward passes over a HF MarianMTModel's own weights.

The KV-cache graphs need tensors in and tensors out (no Cache objects), cross-attention keys and
values computed once by the encoder graph, and the position of the newest token taken from the
past length. Writing that forward here, over the very same submodules, keeps it independent of
transformers' cache API; the export verification compares every graph against the HF model itself.

Shapes use b = batch, s = source length, p = past length, h = heads, d = head dim, V = vocab.
"""

from __future__ import annotations

import torch
from torch import nn

# Additive mask value: finite in fp16 too, so the fp16 graphs never see -inf + x = NaN, and large
# enough that exp() underflows to exactly 0 in fp32 (same probabilities as HF's finfo.min mask).
MASK_VALUE = torch.finfo(torch.float16).min


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, dim = x.shape
    return x.view(b, t, heads, dim // heads).transpose(1, 2)  # (b, h, t, d)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (b, t, h*d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # q (b, h, t, d) already scaled; k, v (b, h, s, d); bias (b, 1, 1, s) or None
    scores = torch.matmul(q, k.transpose(-1, -2))  # (b, h, t, s)
    if bias is not None:
        scores = scores + bias
    return torch.matmul(torch.softmax(scores, dim=-1), v)  # (b, h, t, d)


def _padding_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # mask (b, s) of 1 = token, 0 = pad  ->  (b, 1, 1, s) additive bias
    return (1.0 - mask[:, None, None, :].to(dtype)) * MASK_VALUE


class EncoderWithCrossKV(nn.Module):
    """input_ids, attention_mask -> encoder_hidden_states and every decoder layer's cross K/V."""

    def __init__(self, model: nn.Module):
        super().__init__()
        encoder, decoder = model.model.encoder, model.model.decoder
        self.embed_tokens = encoder.embed_tokens
        self.embed_scale = float(encoder.embed_scale)
        self.positions = encoder.embed_positions
        self.layers = encoder.layers
        self.cross_attn = nn.ModuleList(layer.encoder_attn for layer in decoder.layers)
        self.heads = model.config.encoder_attention_heads
        self.decoder_heads = model.config.decoder_attention_heads

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        # input_ids, attention_mask: (b, s) int64
        seq_len = input_ids.shape[1]
        x = self.embed_tokens(input_ids) * self.embed_scale + self.positions.weight[:seq_len]  # (b, s, D)
        bias = _padding_bias(attention_mask, x.dtype)
        for layer in self.layers:
            attn = layer.self_attn
            q = _split_heads(attn.q_proj(x), self.heads) * attn.scaling
            k = _split_heads(attn.k_proj(x), self.heads)
            v = _split_heads(attn.v_proj(x), self.heads)
            x = layer.self_attn_layer_norm(x + attn.out_proj(_merge_heads(_attend(q, k, v, bias))))
            x = layer.final_layer_norm(x + layer.fc2(layer.activation_fn(layer.fc1(x))))
        outputs = [x]  # (b, s, D)
        for attn in self.cross_attn:
            outputs.append(_split_heads(attn.k_proj(x), self.decoder_heads))  # (b, h, s, d)
            outputs.append(_split_heads(attn.v_proj(x), self.decoder_heads))
        return tuple(outputs)


class DecoderStepWithCache(nn.Module):
    """One decoder step: the newest token plus caches -> logits and the grown self-attention cache.

    Inputs: input_ids (b, 1); encoder_attention_mask (b, s); then for each layer cross key, cross
    value (b, h, s, d); then for each layer past key, past value (b, h, p, d). p = 0 is the first
    step (empty past), so one graph serves every step. Outputs: logits (b, 1, V), then for each
    layer present key, present value (b, h, p + 1, d).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        decoder = model.model.decoder
        self.embed_tokens = decoder.embed_tokens
        self.embed_scale = float(decoder.embed_scale)
        self.positions = decoder.embed_positions
        self.layers = decoder.layers
        self.lm_head = model.lm_head
        self.register_buffer("final_logits_bias", model.final_logits_bias.detach().clone(), persistent=False)
        self.heads = model.config.decoder_attention_heads
        self.num_layers = len(decoder.layers)

    def forward(self, input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor, *cache: torch.Tensor):
        n = self.num_layers
        cross, past = cache[: 2 * n], cache[2 * n :]
        past_len = past[0].shape[2]
        # The newest token sits at position p: the decoder never pads, all rows share one position.
        x = self.embed_tokens(input_ids) * self.embed_scale + self.positions.weight[past_len : past_len + 1]
        bias = _padding_bias(encoder_attention_mask, x.dtype)
        presents = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q = _split_heads(attn.q_proj(x), self.heads) * attn.scaling
            k = torch.cat([past[2 * i], _split_heads(attn.k_proj(x), self.heads)], dim=2)  # (b, h, p+1, d)
            v = torch.cat([past[2 * i + 1], _split_heads(attn.v_proj(x), self.heads)], dim=2)
            presents += [k, v]
            # One query at the last position may see every cached position: no causal mask needed.
            x = layer.self_attn_layer_norm(x + attn.out_proj(_merge_heads(_attend(q, k, v, None))))
            attn = layer.encoder_attn
            q = _split_heads(attn.q_proj(x), self.heads) * attn.scaling
            x = layer.encoder_attn_layer_norm(
                x + attn.out_proj(_merge_heads(_attend(q, cross[2 * i], cross[2 * i + 1], bias)))
            )
            x = layer.final_layer_norm(x + layer.fc2(layer.activation_fn(layer.fc1(x))))
        logits = self.lm_head(x) + self.final_logits_bias  # (b, 1, V)
        return (logits, *presents)


class FullSeq2Seq(nn.Module):
    """The naive migration: HF's own forward, recomputing encoder and decoder at every step."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        # (b, s), (b, s), (b, t) -> logits (b, t, V)
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            use_cache=False,
            return_dict=True,
        ).logits
