"""The compiled row passes (`rows.c`): built with the machine's C compiler on first use, loaded
with ctypes.

A step's log-sum-exp, finite check and top-k over every logit are most of the decoding loop's own
time at beam search; `scoring.py` runs them here when it can and keeps the numpy versions, which
define the results, for everywhere else: no C compiler (a Space image without one), a build that
fails, or `ROW_KERNELS=numpy` in the environment. The library is built for this CPU and cached
under the user's cache folder, keyed by the source, the compiler and the CPU, so a second process
loads it at once. ctypes releases the GIL during a call, so the scoring's row blocks still run on
their threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

logger = logging.getLogger("backends")

ENV = "ROW_KERNELS"  # "numpy": never build or load the compiled passes
SOURCE = Path(__file__).with_name("rows.c")
_FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-fopenmp-simd", "-fno-math-errno"]
_MAX_K = 256  # rows.c keeps the best k in a fixed buffer

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library or None, "why": why not


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "translation-migration" / "native"


def _cpu() -> str:
    # -march=native builds for this CPU: a cache folder shared between machines must not hand one
    # machine's build to another
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, version.encode(), _cpu().encode(), platform.machine().encode(),
                                     " ".join(_FLAGS).encode()])).hexdigest()[:16]
    target = _cache_dir() / f"rows-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for arch in (["-march=native"], []):  # some compilers or targets have no -march=native
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            done = subprocess.run([compiler, *_FLAGS, *arch, str(SOURCE), "-o", str(out), "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(out, target)  # atomic: two processes building at once both succeed
                return target
            errors.append(done.stderr.strip()[-500:])
    raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {errors[-1]}")


def _load():
    if os.environ.get(ENV, "").lower() == "numpy":
        return None, f"{ENV}=numpy"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        return None, "no C compiler (cc, gcc or clang) on PATH"
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, str(e)
    # Arrays go in as bare addresses (`_address` checks them): ndpointer's checks cost more than a
    # small step's whole scoring.
    f32 = f64 = i64 = u8 = ctypes.c_void_p
    lib.row_log_normalizer.argtypes = [f32, ctypes.c_int64, ctypes.c_int64, f64, u8]
    lib.row_log_normalizer.restype = None
    lib.row_top_k.argtypes = [f32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, i64, i64]
    lib.row_top_k.restype = None
    lib.beam_rows.argtypes = [f32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, i64, ctypes.c_int64, i64, i64, i64,
                              i64, ctypes.c_double, ctypes.c_int64, u8, i64, f64, i64]
    lib.beam_rows.restype = None
    lib.beam_select.argtypes = [ctypes.c_int64] * 5 + [f64, i64, f64, ctypes.c_int64, ctypes.c_int64, f64, i64, i64,
                                                       f64, u8, i64]
    lib.beam_select.restype = None
    return lib, None


def library():
    """The loaded library, or None (then `why_not()` says why); built at most once per process."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["why"] = _load()
            if _state["lib"] is None:
                logger.warning("scoring with numpy, not the compiled row passes: %s", _state["why"])
        return _state["lib"]


def why_not() -> str | None:
    library()
    return _state["why"]


def describe() -> str:
    """What scores a step's logits, for the backend's info."""
    return "compiled row passes (rows.c)" if library() is not None else f"numpy ({why_not()})"


def reset() -> None:
    """Forget the loaded state, so the next call reads ROW_KERNELS again (tests)."""
    with _lock:
        _state.clear()


def usable(logits: np.ndarray) -> bool:
    return logits.dtype == np.float32 and logits.ndim == 2 and logits.flags.c_contiguous and library() is not None


def _address(array: np.ndarray, dtype) -> int:
    """The address of a C-contiguous array of `dtype`, as rows.c reads it."""
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise TypeError(f"rows.c takes C-contiguous {np.dtype(dtype).name} arrays, got {array.dtype} "
                        f"(C-contiguous: {array.flags.c_contiguous})")
    return array.__array_interface__["data"][0]


def log_normalizer(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """logits (r, V) float32 C-contiguous -> log-sum-exp (r,) float64 (NaN where the row is not
    finite) and the non-finite rows (r,) bool."""
    rows, v = logits.shape
    lse, non_finite = np.empty(rows), np.empty(rows, dtype=np.uint8)
    library().row_log_normalizer(_address(logits, np.float32), rows, v, _address(lse, np.float64),
                                 _address(non_finite, np.uint8))
    return lse, non_finite.view(bool)


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """logits (r, V) -> ids (r, k) best first (ties: the lower id) and how many each row found
    (NaN and -inf never count); None when k is beyond the compiled buffer."""
    if not 1 <= k <= _MAX_K:
        return None
    rows, v = logits.shape
    ids, found = np.empty((rows, k), dtype=np.int64), np.empty(rows, dtype=np.int64)
    library().row_top_k(_address(logits, np.float32), rows, v, k, _address(ids, np.int64), _address(found, np.int64))
    return ids, found


def beam_rows(logits: np.ndarray, k: int, shared: np.ndarray, masked: tuple[np.ndarray, np.ndarray],
              penalised: tuple[np.ndarray, np.ndarray], penalty: float, threads: int):
    """A beam-search step's scoring in one call (rows.c `beam_rows`): logits (r, V) float32, the ids
    masked in every row (ascending), the per-row masked and penalised ids as (offsets (r + 1,),
    ids ascending within each row) -> the non-finite rows (r,), ids (r, k), processed
    log-probs (r, k) float64, and how many ids each row found (a row with fewer than k, or a
    non-finite one, is left for the caller); None when k is beyond the compiled buffer."""
    if not 1 <= k <= _MAX_K:
        return None
    rows, v = logits.shape
    non_finite = np.zeros(rows, dtype=np.uint8)
    ids, values, found = np.zeros((rows, k), dtype=np.int64), np.zeros((rows, k)), np.zeros(rows, dtype=np.int64)
    i64 = np.int64
    library().beam_rows(_address(logits, np.float32), rows, v, k, _address(shared, i64), len(shared),
                        _address(masked[0], i64), _address(masked[1], i64), _address(penalised[0], i64),
                        _address(penalised[1], i64), penalty, threads, _address(non_finite, np.uint8),
                        _address(ids, i64), _address(values, np.float64), _address(found, i64))
    return non_finite.view(bool), ids, values, found


def beam_select(running: np.ndarray, ids: np.ndarray, values: np.ndarray, keep: int, vocab: int, eos: int,
                capped: bool):
    """Beam search's choice of a step's continuations (rows.c `beam_select`): running (b, n) float64,
    ids (b * n, K) int64 and values (b * n, K) float64 best first -> the best `keep` continuations of
    each sentence, (b, keep) each: scores, beams, tokens, log-probs, hits (bool), and which n of
    them go on (b, n); None when the library is not loaded or `keep` is beyond its buffer."""
    lib = library()
    b, n = running.shape
    if lib is None or not n <= keep <= 512 or ids.shape[1] < keep:
        return None
    ids, values = np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(values, dtype=np.float64)
    running = np.ascontiguousarray(running, dtype=np.float64)
    scores, logprobs = np.empty((b, keep)), np.empty((b, keep))
    beams, tokens = np.empty((b, keep), dtype=np.int64), np.empty((b, keep), dtype=np.int64)
    hits, chosen = np.empty((b, keep), dtype=np.uint8), np.empty((b, n), dtype=np.int64)
    i64 = np.int64
    lib.beam_select(b, n, keep, ids.shape[1], vocab, _address(running, np.float64), _address(ids, i64),
                    _address(values, np.float64), eos, int(capped), _address(scores, np.float64),
                    _address(beams, i64), _address(tokens, i64), _address(logprobs, np.float64),
                    _address(hits, np.uint8), _address(chosen, i64))
    return scores, beams, tokens, logprobs, hits.view(bool), chosen
