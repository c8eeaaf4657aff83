"""families/random_weights.py: the block-by-block safetensors writer behind the full-size fixtures
(`madlad-3b-random`) writes what `save_pretrained` would, with the model's own initialisation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from families import random_weights
from families.t5 import _T5_UNITS, MADLAD_IDS

CONFIG = {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
          "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "vocab_size": 300,
          "feed_forward_proj": "gated-gelu", **MADLAD_IDS.config}


def _eager(config, tmp_path):
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    model.save_pretrained(tmp_path / "eager", safe_serialization=True)
    with safe_open(str(tmp_path / "eager" / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("untie", [False, True])
def test_streamed_weights_match_save_pretrained_names_shapes_and_init(tmp_path, untie):
    config = transformers.T5Config(**CONFIG)
    path = tmp_path / "model.safetensors"
    size = random_weights.write(transformers.T5ForConditionalGeneration, config, path, seed=1, units=_T5_UNITS,
                                untie={"lm_head": 1.0} if untie else {})
    assert path.stat().st_size == size
    with safe_open(str(path), "pt") as f:
        streamed = {k: f.get_tensor(k) for k in f.keys()}
    eager = _eager(config, tmp_path)
    expected = set(eager) | ({"lm_head.weight"} if untie else set())
    assert set(streamed) == expected
    for name, tensor in streamed.items():
        if name == "lm_head.weight":
            assert tensor.shape == streamed["shared.weight"].shape
            assert not torch.equal(tensor, streamed["shared.weight"])
            assert abs(float(tensor.std()) - 1.0) < 0.05
            continue
        reference = eager[name]
        assert tensor.shape == reference.shape and tensor.dtype == reference.dtype, name
        assert torch.isfinite(tensor).all(), name
        if "layer_norm" in name:  # initialised to ones
            assert torch.equal(tensor, reference), name
        else:  # the same distribution as the model's own init: T5's std depends on the module and its size
            ratio = float(tensor.std()) / float(reference.std())
            assert 0.8 < ratio < 1.25, f"{name}: std {float(tensor.std()):.4g} against {float(reference.std()):.4g}"
            assert not torch.equal(tensor, reference)


def test_streamed_weights_load_into_the_model_and_decode(tmp_path):
    config = transformers.T5Config(**CONFIG)
    folder = tmp_path / "model"
    folder.mkdir()
    config.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    data["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(data))
    random_weights.write(transformers.T5ForConditionalGeneration, config, folder / "model.safetensors", seed=1,
                         units=_T5_UNITS, untie={"lm_head": 1.0})
    model, info = transformers.T5ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert torch.equal(model.lm_head.weight, f.get_tensor("lm_head.weight"))
        assert torch.equal(model.decoder.block[1].layer[2].DenseReluDense.wo.weight,
                           f.get_tensor("decoder.block.1.layer.2.DenseReluDense.wo.weight"))
    out = model.generate(torch.tensor([[5, 6, 7, MADLAD_IDS.config["eos_token_id"]]]), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > 1 and np.isfinite(out.numpy()).all()
