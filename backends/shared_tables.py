"""One copy of each large lookup table that several engines hold bit-for-bit.

The app holds five backends of one model, and the same tables recur across them: the tied
(d, V) output/embedding matrix is in both the single-step and the KV-cache decoder graphs, and
the (V, d) token embedding is in PyTorch's model and the fp32 encoder graph, each among the
largest tensors of a model. ONNX Runtime frees a MatMul's weight once it has packed its own copy,
but a table that a Gather reads stays resident in every session that loads it. Handing ORT one
shared buffer (`SessionOptions.add_initializer`) keeps a single copy.

Tables are matched by dtype, shape and bytes, never by name, so a table is only shared with
another that holds exactly the same numbers; only tables of the same dtype and shape are compared.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Smaller tables are not worth sharing: biases and layer norms are a few KB each.
MIN_BYTES = 4 * 2**20


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    # Bit-for-bit, not ==: -0.0 == 0.0 and NaN != NaN would both mislead here.
    return np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


class SharedTables:
    """Per `load_backends` call: the large arrays engines hold, by dtype and shape."""

    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._held: dict[tuple[str, tuple[int, ...]], list[np.ndarray]] = {}

    def offer(self, array: np.ndarray) -> None:
        """Make an array (a view is fine: it is kept alive here) available to engines loaded later."""
        if array.nbytes >= self.min_bytes and array.flags.c_contiguous:
            self._held.setdefault((array.dtype.str, array.shape), []).append(array)

    def canonical(self, array: np.ndarray) -> np.ndarray:
        """The held array with exactly the same bytes as `array`, or `array` itself, now held."""
        same_shape = self._held.setdefault((array.dtype.str, array.shape), [])
        match = next((other for other in same_shape if _same_bytes(other, array)), None)
        if match is not None:
            return match
        array = np.ascontiguousarray(array)
        same_shape.append(array)
        return array

    def for_graph(self, path: Path) -> dict[str, np.ndarray]:
        """name -> shared array, for every large initializer of the graph that a Gather reads.

        MatMul-only weights are left to ORT: it packs them and frees the original, and a shared
        buffer would stop it freeing. A graph with external data is read without it; only the
        tables returned are read from its data file, so a large model's weights are not loaded twice.
        """
        import onnx
        from onnx import numpy_helper

        try:
            model = onnx.load(str(path), load_external_data=False)
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
            # base_dir: a table in external data is read from its file, that tensor's bytes only
            out[init.name] = self.canonical(numpy_helper.to_array(init, base_dir=str(Path(path).parent)))
        return out
