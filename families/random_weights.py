"""Random initial weights written straight to a safetensors file, one block at a time.

A fixture at a published model's full size (MADLAD-400-3B: 11.8 GB of fp32 weights) cannot be
built the way the tiny ones are, by instantiating the model and calling `save_pretrained`: that
holds the weights once in the model and again while serialising. Here the model is built on the
meta device (shapes, no storage), the file's header is written from those shapes, and each
block (a layer's attention, its feed-forward, the embedding, the output layer) is materialised,
initialised by the model's own `_init_weights`, written at its offset and dropped. Peak memory is
the largest block (the embedding or the output layer), never the model.
"""

from __future__ import annotations

import json
from pathlib import Path

_ALIGN = 8  # safetensors pads its header so the data starts 8-byte aligned
_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16", "torch.int64": "I64"}


def _blocks(model, units: tuple[str, ...]) -> list:
    """The modules to materialise one at a time: each module whose class is one of `units` (the
    classes whose init sets their children's weights, such as T5's attention and feed-forward
    sub-layers), then each other module that holds parameters of its own (the embedding, the
    output layer, the final norms). Each parameter belongs to exactly one."""
    blocks, taken = [], set()
    for module in model.modules():
        if type(module).__name__ in units:
            blocks.append(module)
            taken.update(id(p) for p in module.parameters())
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in taken]
        if own:
            blocks.append(module)
            taken.update(id(p) for p in own)
    return blocks


def write(model_class, config, path: Path, seed: int, units: tuple[str, ...], untie: dict[str, float]) -> int:
    """Write `model_class(config)`'s initial weights (the model's own init, seeded) to `path` as
    safetensors, shared (tied) parameters once under their first name as `save_pretrained` does;
    `units` as in `_blocks`; `untie` names modules (such as T5's lm_head, which transformers ties
    whatever the config says) that get a weight of their own, normal with the given std. Returns
    the file's size in bytes."""
    import torch

    with torch.device("meta"):
        model = model_class(config)
        for attr in untie:
            module = getattr(model, attr)
            module.weight = torch.nn.Parameter(torch.empty_like(module.weight))
    params = dict(model.named_parameters())  # each shared parameter once, under its first name
    buffers = [n for n, _ in model.named_buffers() if n in model.state_dict()]
    if buffers:
        raise ValueError(f"{model_class.__name__} saves buffers, which this writer does not: {buffers[:5]}")
    header, offset = {}, 0
    for name, p in params.items():
        size = p.numel() * p.element_size()
        header[name] = {"dtype": _DTYPES[str(p.dtype)], "shape": list(p.shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % _ALIGN)
    start = 8 + len(raw)
    torch.manual_seed(seed)
    prefixes = {id(m): name for name, m in model.named_modules()}
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(start + offset)
        for block in _blocks(model, units):
            _write_block(model, prefixes[id(block)], block, header, f, start, untie)
    return start + offset


def _write_block(model, prefix: str, block, header: dict, f, start: int, untie: dict[str, float]) -> None:
    import torch

    top_level = {id(p) for p in _top_level(model)}
    sets_top_level = block is not model and any(id(p) in top_level for p in block.parameters())
    block.to_empty(device="cpu", recurse=True)
    with torch.no_grad():
        # The model's init dispatches on the module type, parents after children (as `apply`):
        # a T5Attention sets its own q/k/v/o after nn.Linear's default init of each. The model
        # itself sets the embedding and the output layer, so it is applied too where this block
        # holds either (its other parameters are still on the meta device, where init does nothing).
        block.apply(model._init_weights)
        if sets_top_level:
            model._init_weights(model)
        for attr, std in untie.items():
            if getattr(model, attr) is block:
                block.weight.normal_(0.0, std)
    for name, p in block.named_parameters(prefix=prefix, remove_duplicate=False):
        if name not in header:
            continue  # a tied alias, written under its first name
        lo, hi = header[name]["data_offsets"]
        data = p.detach().contiguous().numpy()
        if data.nbytes != hi - lo:
            raise AssertionError(f"{name}: {data.nbytes} bytes against the header's {hi - lo}")
        f.seek(start + lo)
        f.write(memoryview(data).cast("B"))
    block.to(device="meta")


def _top_level(model) -> list:
    # the parameters the model's own _init_weights branch sets (shared embedding, untied output layer)
    out = []
    for attr in ("shared", "lm_head"):
        module = getattr(model, attr, None)
        if module is not None:
            out.extend(module.parameters())
    return out
