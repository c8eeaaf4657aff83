"""Export-friendly forward passes over a T5 model's own weights: the KV-cache graph pair of the
families whose layout is `families/t5.py`'s, with the same inputs and outputs as BART's
(`export/wrappers.py`), so every backend, the fp16 and int8 conversions and the attention fusion
read them unchanged.

What is T5's own: no position table, but a learned bias per head and relative-position bucket,
added to the attention scores (one table per stack, in its first block, shared by the others);
scores not scaled; RMS LayerNorm before each sub-layer and after the stack; the output layer's
input rescaled by `d_model ** -0.5` when it is the tied embedding. The bucket of every relative
position is computed here once, at export, by transformers' own `_relative_position_bucket` and
stored as a lookup table: the graph never recomputes the logarithm that decides a bucket, so a
last-bit difference in ONNX Runtime's `Log` cannot move a position to another bucket. Past
`max_distance` the bucket no longer changes, so the table clamps the distance and has no length limit.

Shapes use b = batch, s = source length, p = past length, h = heads, d = head dim (T5's `d_kv`), V = vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from families import Family

from .wrappers import _attend, _padding_bias


def _split_heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, heads, head_dim).transpose(1, 2)  # (b, h, t, d)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (b, t, h*d)


def _bucket_table(attention: nn.Module, bidirectional: bool) -> tuple[torch.Tensor, int]:
    """(buckets of the relative positions -reach .. reach, reach): beyond `max_distance` every
    distance shares the last bucket on its side, so clamping to `reach` changes nothing."""
    reach = attention.relative_attention_max_distance + 1
    relative = torch.arange(-reach, reach + 1, dtype=torch.long)
    buckets = attention._relative_position_bucket(
        relative, bidirectional=bidirectional, num_buckets=attention.relative_attention_num_buckets,
        max_distance=attention.relative_attention_max_distance,
    )
    return buckets, reach


class _Stack(nn.Module):
    """What the encoder and decoder wrappers share. Submodules keep HF's names (`block.N.layer.M...`,
    `embed_tokens`, `final_layer_norm`): the exporter records them, and service/locate_graph.py maps
    them back to the HF model (families/t5.py's naming)."""

    def _init_stack(self, stack: nn.Module, config, bidirectional: bool) -> None:
        self.embed_tokens = stack.embed_tokens
        self.block = stack.block
        self.final_layer_norm = stack.final_layer_norm
        self.heads = config.num_heads
        self.head_dim = config.d_kv
        first = stack.block[0].layer[0].SelfAttention
        buckets, self.reach = _bucket_table(first, bidirectional)
        self.register_buffer("buckets", buckets, persistent=False)

    def position_bias(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (..., k) of indices into the bucket table -> the first block's bias (..., k, h)."""
        return self.block[0].layer[0].SelfAttention.relative_attention_bias(self.buckets[rows])

    def sublayer(self, sub: nn.Module, x: torch.Tensor, fn) -> torch.Tensor:
        return x + fn(sub.layer_norm(x))

    def feed_forward(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        ff = block.layer[-1]
        return self.sublayer(ff, x, ff.DenseReluDense)

    def attention(self, attn: nn.Module, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias):
        """Unscaled attention of h's queries over k, v (b, h, s, d) with the additive bias."""
        q = _split_heads(attn.q(h), self.heads, self.head_dim)
        return attn.o(_merge_heads(_attend(q, k, v, bias)))


class EncoderWithCrossKV(_Stack):
    """input_ids, attention_mask -> encoder_hidden_states and every decoder layer's cross K/V."""

    def __init__(self, model: nn.Module, family: Family):
        super().__init__()
        self._init_stack(model.encoder, model.config, bidirectional=True)
        self.cross_attn = nn.ModuleList(block.layer[1].EncDecAttention for block in model.decoder.block)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        # input_ids, attention_mask: (b, s) int64
        x = self.embed_tokens(input_ids)  # (b, s, D)
        b, s = input_ids.shape
        positions = torch.arange(s, dtype=torch.long, device=input_ids.device)
        rows = (positions[None, :] - positions[:, None]).clamp(-self.reach, self.reach) + self.reach  # (s, s)
        position_bias = self.position_bias(rows).permute(2, 0, 1).unsqueeze(0)  # (1, h, s, s)
        # Position bias and padding in one (b, h, s, s) bias, added once per layer: MultiHeadAttention's
        # attention_bias takes it in that shape (export/attention.fuse_attention).
        bias = position_bias + _padding_bias(attention_mask, x.dtype)
        for block in self.block:
            attn = block.layer[0].SelfAttention

            def self_attention(h, attn=attn):
                k = _split_heads(attn.k(h), self.heads, self.head_dim)
                v = _split_heads(attn.v(h), self.heads, self.head_dim)
                return self.attention(attn, h, k, v, bias)

            x = self.sublayer(block.layer[0], x, self_attention)
            x = self.feed_forward(block, x)
        x = self.final_layer_norm(x)
        outputs = [x]  # (b, s, D)
        for attn in self.cross_attn:
            outputs.append(_split_heads(attn.k(x), self.heads, self.head_dim))  # (b, h, s, d)
            outputs.append(_split_heads(attn.v(x), self.heads, self.head_dim))
        return tuple(outputs)


class DecoderStepWithCache(_Stack):
    """One decoder step: the newest token plus caches -> logits and the grown self-attention cache.
    Inputs and outputs as `export/wrappers.DecoderStepWithCache`."""

    def __init__(self, model: nn.Module, family: Family):
        super().__init__()
        self._init_stack(model.decoder, model.config, bidirectional=False)
        self.lm_head = model.lm_head
        self.num_layers = len(model.decoder.block)
        scaled = bool(getattr(model.config, "scale_decoder_outputs", False))
        self.output_scale = model.config.d_model**-0.5 if scaled else None

    def forward(self, input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor, *cache: torch.Tensor):
        n = self.num_layers
        cross, past = cache[: 2 * n], cache[2 * n :]
        past_len = past[0].shape[2]
        x = self.embed_tokens(input_ids)  # (b, 1, D)
        # The query sits at position p and sees keys 0..p: distances p .. 0 (bucket table index reach - distance).
        distance = (past_len - torch.arange(past_len + 1, dtype=torch.long, device=input_ids.device)).clamp(max=self.reach)
        self_bias = self.position_bias(self.reach - distance).transpose(0, 1)[None, :, None, :]  # (1, h, 1, p+1)
        cross_bias = _padding_bias(encoder_attention_mask, x.dtype)  # (b, 1, 1, s)
        presents = []
        for i, block in enumerate(self.block):

            def self_attention(h, attn=block.layer[0].SelfAttention, i=i):
                k = torch.cat([past[2 * i], _split_heads(attn.k(h), self.heads, self.head_dim)], dim=2)  # (b, h, p+1, d)
                v = torch.cat([past[2 * i + 1], _split_heads(attn.v(h), self.heads, self.head_dim)], dim=2)
                presents.extend([k, v])
                return self.attention(attn, h, k, v, self_bias)

            def cross_attention(h, attn=block.layer[1].EncDecAttention, i=i):
                return self.attention(attn, h, cross[2 * i], cross[2 * i + 1], cross_bias)

            x = self.sublayer(block.layer[0], x, self_attention)
            x = self.sublayer(block.layer[1], x, cross_attention)
            x = self.feed_forward(block, x)
        x = self.final_layer_norm(x)
        if self.output_scale is not None:
            x = x * self.output_scale
        return (self.lm_head(x), *presents)


__all__ = ["DecoderStepWithCache", "EncoderWithCrossKV"]
