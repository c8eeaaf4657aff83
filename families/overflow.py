"""A fixture whose fp32 activations pass fp16's range while its function stays the same.

One decoder layer's feed-forward block, with ReLU (which commutes with a positive scale), gets
fc1 scaled up by s and fc2 down by s: relu(s·(xW1 + b1))·W2/s = relu(xW1 + b1)·W2, so fp32 decodes
as before, but fc1's output, the ReLU's and fc2's input peak at `peak` on the fixture's own text,
far past fp16's 65504: the overflow users meet on trained models (T5's feed-forward above all),
made on purpose. T5's gated block scales its linear branch instead (`_feed_forward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OverflowFixture:
    base: str  # the fixture it scales (any family's, registered in families/)
    layer: int = -1  # the decoder layer whose feed-forward block is scaled
    peak: float = 2e5  # fc1's largest |output| after scaling, measured on the sample's sources

    @property
    def sample_pairs(self) -> int:
        from . import fixtures

        return fixtures()[self.base].sample_pairs

    def build(self, out: Path, pairs: list[tuple[str, str]], seed: int) -> None:
        import torch
        import transformers

        from . import fixtures

        fixtures()[self.base].build(out, pairs, seed)
        config = transformers.AutoConfig.from_pretrained(out)
        decoder_class = getattr(transformers, config.architectures[0])
        if config.model_type != "t5":
            config.activation_function = "relu"  # positively homogeneous: the scale passes through it
        model = decoder_class.from_pretrained(out, config=config).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        up, down, biased = _feed_forward(model.get_decoder(), self.layer)
        peaks = []
        hook = up.register_forward_hook(lambda m, i, o: peaks.append(float(o.abs().max())))
        with torch.no_grad():
            for en, zh in pairs[:64]:
                source = tokenizer(en, return_tensors="pt", truncation=True, max_length=128)
                target = tokenizer(text_target=zh, return_tensors="pt", truncation=True, max_length=128).input_ids
                model(**source, decoder_input_ids=target)
        hook.remove()
        scale = self.peak / max(peaks)
        with torch.no_grad():
            up.weight.mul_(scale)
            if biased:
                up.bias.mul_(scale)
            down.weight.div_(scale)
        model.save_pretrained(out, safe_serialization=True)


def _feed_forward(decoder, layer: int):
    """(the projection scaled up, the one scaled down, whether the first has a bias) of one decoder
    layer's feed-forward block: BART's fc1 and fc2 (with ReLU); T5's wi (ReLU) or, gated, the linear
    branch wi_1 (act(x wi_0) * s (x wi_1) is s times the product whatever the activation) and wo."""
    if hasattr(decoder, "layers"):
        block = decoder.layers[layer]
        return block.fc1, block.fc2, True
    ff = decoder.block[layer].layer[-1].DenseReluDense
    return getattr(ff, "wi_1", None) or ff.wi, ff.wo, False
