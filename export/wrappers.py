"""Export-friendly forward passes over a BART-style seq2seq model's own weights: the graph
wrappers of the families whose layout is `families/bart.py`'s.

The KV-cache graphs need tensors in and tensors out (no Cache objects), cross-attention keys and
values computed once by the encoder graph, and the position of the newest token taken from the
past length. Writing that forward here, over the very same submodules, keeps it independent of
transformers' cache API; the export verification compares every graph against the HF model itself.

What differs between families (layer-norm order, positions, embedding scale and norm, final
norms, logits bias) is read from the family's registry entry; the forward is written once.

Shapes use b = batch, s = source length, p = past length, h = heads, d = head dim, V = vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from families import Family

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


class _Stack(nn.Module):
    """What the encoder and decoder wrappers share: one side's embeddings, positions, norms and
    layers, as its family has them. Submodules keep HF's names (`embed_tokens`, `layers.N...`):
    the exporter records them, and service/locate_graph.py maps them back to the HF model."""

    def _init_stack(self, stack: nn.Module, family: Family, pad: int) -> None:
        self.family = family
        self.pad = pad
        self.embed_tokens = stack.embed_tokens
        # Some families scale inside their ScaledWordEmbedding, others on the stack.
        self.embed_scale = 1.0 if hasattr(stack.embed_tokens, "embed_scale") else float(stack.embed_scale)
        self.positions = stack.embed_positions
        self.layernorm_embedding = stack.layernorm_embedding if family.embedding_norm else None
        self.layer_norm = stack.layer_norm if family.final_norm else None
        self.layers = stack.layers

    def embed(self, input_ids: torch.Tensor, past_len) -> torch.Tensor:
        """input_ids (b, t) at positions past_len .. past_len + t - 1 -> (b, t, D)."""
        t = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        kind = self.family.positions
        if kind == "sinusoidal":
            pos = self.positions.weight[past_len : past_len + t]  # (t, D)
        elif kind == "learned_offset":
            offset = self.family.position_offset
            pos = self.positions.weight[past_len + offset : past_len + offset + t]  # (t, D)
        else:  # sinusoidal_padding_offset: row pad + 1 + position for tokens, row pad (zeros) for pad
            real = input_ids.ne(self.pad).to(torch.int64)  # (b, t)
            rows = (torch.cumsum(real, dim=1) + past_len) * real + self.pad
            pos = self.positions.weights[rows]  # (b, t, D)
        x = x + pos
        return self.layernorm_embedding(x) if self.layernorm_embedding is not None else x

    def sublayer(self, norm: nn.Module, x: torch.Tensor, fn) -> torch.Tensor:
        """Residual around `fn`, with the family's norm before (pre-LN) or after the sum (post-LN)."""
        if self.family.pre_norm:
            return x + fn(norm(x))
        return norm(x + fn(x))

    def feed_forward(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.sublayer(layer.final_layer_norm, x, lambda h: layer.fc2(layer.activation_fn(layer.fc1(h))))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(x) if self.layer_norm is not None else x


class EncoderWithCrossKV(_Stack):
    """input_ids, attention_mask -> encoder_hidden_states and every decoder layer's cross K/V."""

    def __init__(self, model: nn.Module, family: Family):
        super().__init__()
        encoder, decoder = model.model.encoder, model.model.decoder
        self._init_stack(encoder, family, model.config.pad_token_id)
        self.cross_attn = nn.ModuleList(layer.encoder_attn for layer in decoder.layers)
        self.heads = model.config.encoder_attention_heads
        self.decoder_heads = model.config.decoder_attention_heads

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        # input_ids, attention_mask: (b, s) int64
        x = self.embed(input_ids, 0)  # (b, s, D)
        b, s = input_ids.shape
        # One bias row per query, (b, 1, s, s), not (b, 1, 1, s) broadcast: ONNX Runtime's
        # MultiHeadAttention, which replaces _attend in the graph (export/attention.fuse_attention),
        # takes its attention bias in that shape. Same numbers either way.
        bias = _padding_bias(attention_mask, x.dtype).expand(b, 1, s, s)
        for layer in self.layers:
            attn = layer.self_attn

            def self_attention(h, attn=attn):
                q = _split_heads(attn.q_proj(h), self.heads) * attn.scaling
                k = _split_heads(attn.k_proj(h), self.heads)
                v = _split_heads(attn.v_proj(h), self.heads)
                return attn.out_proj(_merge_heads(_attend(q, k, v, bias)))

            x = self.sublayer(layer.self_attn_layer_norm, x, self_attention)
            x = self.feed_forward(layer, x)
        x = self.finish(x)
        outputs = [x]  # (b, s, D)
        for attn in self.cross_attn:
            outputs.append(_split_heads(attn.k_proj(x), self.decoder_heads))  # (b, h, s, d)
            outputs.append(_split_heads(attn.v_proj(x), self.decoder_heads))
        return tuple(outputs)


class DecoderStepWithCache(_Stack):
    """One decoder step: the newest token plus caches -> logits and the grown self-attention cache.

    Inputs: input_ids (b, 1); encoder_attention_mask (b, s); then for each layer cross key, cross
    value (b, h, s, d); then for each layer past key, past value (b, h, p, d). p = 0 is the first
    step (empty past), so one graph serves every step. Outputs: logits (b, 1, V), then for each
    layer present key, present value (b, h, p + 1, d).
    """

    def __init__(self, model: nn.Module, family: Family):
        super().__init__()
        decoder = model.model.decoder
        self._init_stack(decoder, family, model.config.pad_token_id)
        self.lm_head = model.lm_head
        bias = model.final_logits_bias.detach().clone() if family.logits_bias else None
        # An all-zero bias (a buffer, never trained: our embedded model and random fixtures) adds
        # nothing but a pass over (b, V) each step; x + 0 == x, so leaving it out keeps the logits exact.
        if bias is not None and not bias.any():
            bias = None
        self.register_buffer("final_logits_bias", bias, persistent=False)
        self.heads = model.config.decoder_attention_heads
        self.num_layers = len(decoder.layers)

    def forward(self, input_ids: torch.Tensor, encoder_attention_mask: torch.Tensor, *cache: torch.Tensor):
        n = self.num_layers
        cross, past = cache[: 2 * n], cache[2 * n :]
        past_len = past[0].shape[2]
        # The newest token sits at position p: the decoder never pads, all rows share one position.
        x = self.embed(input_ids, past_len)  # (b, 1, D)
        bias = _padding_bias(encoder_attention_mask, x.dtype)
        presents = []
        for i, layer in enumerate(self.layers):

            def self_attention(h, attn=layer.self_attn, i=i):
                q = _split_heads(attn.q_proj(h), self.heads) * attn.scaling
                k = torch.cat([past[2 * i], _split_heads(attn.k_proj(h), self.heads)], dim=2)  # (b, h, p+1, d)
                v = torch.cat([past[2 * i + 1], _split_heads(attn.v_proj(h), self.heads)], dim=2)
                presents.extend([k, v])
                # One query at the last position may see every cached position: no causal mask needed.
                return attn.out_proj(_merge_heads(_attend(q, k, v, None)))

            def cross_attention(h, attn=layer.encoder_attn, i=i):
                q = _split_heads(attn.q_proj(h), self.heads) * attn.scaling
                return attn.out_proj(_merge_heads(_attend(q, cross[2 * i], cross[2 * i + 1], bias)))

            x = self.sublayer(layer.self_attn_layer_norm, x, self_attention)
            x = self.sublayer(layer.encoder_attn_layer_norm, x, cross_attention)
            x = self.feed_forward(layer, x)
        logits = self.lm_head(self.finish(x))  # (b, 1, V)
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias
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
