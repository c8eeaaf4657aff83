"""A fixture whose fp32 activations pass fp16's range while its function stays the same.

One decoder layer's feed-forward block, with ReLU (which commutes with a positive scale), gets
fc1 scaled up by s and fc2 down by s: relu(s·(xW1 + b1))·W2/s = relu(xW1 + b1)·W2, so fp32 decodes
as before, but fc1's output, the ReLU's and fc2's input peak at `peak` on the fixture's own text,
far past fp16's 65504: the overflow users meet on trained models, made on purpose.
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
        config.activation_function = "relu"  # positively homogeneous: the scale passes through it
        model = getattr(transformers, config.architectures[0]).from_pretrained(out, config=config).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
        layer = model.get_decoder().layers[self.layer]
        peaks = []
        hook = layer.fc1.register_forward_hook(lambda m, i, o: peaks.append(float(o.abs().max())))
        with torch.no_grad():
            for en, zh in pairs[:64]:
                source = tokenizer(en, return_tensors="pt", truncation=True, max_length=128)
                target = tokenizer(text_target=zh, return_tensors="pt", truncation=True, max_length=128).input_ids
                model(**source, decoder_input_ids=target)
        hook.remove()
        scale = self.peak / max(peaks)
        with torch.no_grad():
            layer.fc1.weight.mul_(scale)
            layer.fc1.bias.mul_(scale)
            layer.fc2.weight.div_(scale)
        model.save_pretrained(out, safe_serialization=True)
