"""One copy of each large lookup table that several engines hold bit-for-bit.

The app holds five backends of one model, and the same tables recur across them: the tied
(d, V) output/embedding matrix is in both the single-step and the KV-cache decoder graphs, and
the (V, d) token embedding is in PyTorch's model and the fp32 encoder graph: 127 MiB each at
opus-mt-en-zh's size. ONNX Runtime frees a MatMul's weight once it has packed its own copy, but a
table that a Gather reads stays resident in every session that loads it. Handing ORT one shared
buffer (`SessionOptions.add_initializer`) keeps a single copy.

Tables are matched by dtype, shape and content digest, never by name, so a table is only shared
with another that holds exactly the same numbers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

# Smaller tables are not worth a digest: biases and layer norms are a few KB each.
MIN_BYTES = 4 * 2**20


def _digest(array: np.ndarray) -> str:
    return hashlib.blake2b(memoryview(np.ascontiguousarray(array)).cast("B"), digest_size=16).hexdigest()


class SharedTables:
    """Per `load_backends` call: arrays offered by loaded engines, found again by content."""

    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._offered: list[np.ndarray] = []  # not yet hashed: hashing waits until a shape matches
        self._by_key: dict[tuple[str, tuple[int, ...], str], np.ndarray] = {}

    def offer(self, array: np.ndarray) -> None:
        """Make an array (kept alive here) available to engines loaded later."""
        if array.nbytes >= self.min_bytes and array.flags.c_contiguous:
            self._offered.append(array)

    def _key(self, array: np.ndarray) -> tuple[str, tuple[int, ...], str]:
        return (array.dtype.str, array.shape, _digest(array))

    def canonical(self, array: np.ndarray) -> np.ndarray:
        """The shared array holding the same numbers as `array`, or `array` itself, now shared."""
        key = self._key(array)
        if key in self._by_key:
            return self._by_key[key]
        matches = [a for a in self._offered if a.dtype == array.dtype and a.shape == array.shape]
        self._offered = [a for a in self._offered if not any(a is m for m in matches)]
        for other in matches:
            self._by_key.setdefault(self._key(other), other)
        return self._by_key.setdefault(key, np.ascontiguousarray(array))

    def for_graph(self, path: Path) -> dict[str, np.ndarray]:
        """name -> shared array, for every large initializer of the graph that a Gather reads.

        MatMul-only weights are left to ORT: it packs them and frees the original, and a shared
        buffer would stop it freeing.
        """
        import onnx
        from onnx import numpy_helper

        try:
            model = onnx.load(str(path))
        except Exception as e:  # protobuf's DecodeError names no file
            raise ValueError(f"{path} is not a readable ONNX graph: {type(e).__name__}: {e}") from e
        graph = model.graph
        gathered = {n.input[0] for n in graph.node if n.op_type == "Gather"}
        out = {}
        for init in graph.initializer:
            if init.name not in gathered:
                continue
            size = int(np.prod(init.dims)) if init.dims else 1
            if size * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize < self.min_bytes:
                continue
            out[init.name] = self.canonical(numpy_helper.to_array(init))
        return out

    def held_bytes(self) -> int:
        return sum(a.nbytes for a in self._by_key.values())
