"""What one request may ask for, checked before any model runs: input, size, time, batches.

Empty text, text with nothing visible (only control or format characters) and text over
`RequestLimits` (characters, segments) raise `InputError` before any model is called: nothing is
ever truncated. A backend still busy after `RequestLimits.max_seconds` stops with
`TimeLimitExceeded` (decoding time grows with output length, unknown up front); the caller shows
that as the backend's error and runs the next one. Messages count segments from 1.
"""

from __future__ import annotations

import time
import unicodedata
from dataclasses import dataclass
from typing import Any

from backends import REFERENCE, Backend, DecodeOptions, InputError
from backends.options import MAX_BEAMS

from .segment import Segment, clean, split_text

MAX_REPEAT = 20


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; more is refused with the numbers, never truncated."""

    # Checked before tokenizing, so a pasted book is refused at once instead of split for seconds.
    max_chars: int = 20_000
    # Every backend translates every segment: this bounds a request's work.
    max_segments: int = 128
    # Wall-clock seconds one backend may spend on one request (every run and its teacher-forced
    # scoring); past it, that backend reports an error and the next one runs. Output length is
    # unknown up front: a degenerate decode of 511 tokens on a 512-token chunk takes the
    # single-step graph (everything recomputed per token) many minutes on a small CPU.
    max_seconds: float = 60.0
    # Beam width one request may ask for: every beam is a decoder row at every step.
    max_beams: int = 8
    # Decoder rows x steps one request may cause: beams x segments x the output cap. The default
    # is what greedy decoding of the largest request (128 segments x 512 tokens) costs, so beam
    # search never makes a request more expensive than greedy could be; more is refused with
    # the numbers before any model runs.
    max_work: int = 65_536

    def __post_init__(self):
        if self.max_chars < 1 or self.max_segments < 1 or not self.max_seconds > 0:
            raise ValueError(
                "max_chars and max_segments must be >= 1 and max_seconds > 0, got "
                f"{self.max_chars}, {self.max_segments}, {self.max_seconds}"
            )
        if not 1 <= self.max_beams <= MAX_BEAMS or self.max_work < 1:
            raise ValueError(
                f"max_beams must be in 1..{MAX_BEAMS} and max_work >= 1, got {self.max_beams}, {self.max_work}"
            )


class TimeLimitExceeded(RuntimeError):
    """A backend ran past `RequestLimits.max_seconds` on one request."""


class _Timed:
    """A backend's engine with a deadline: the first call past it raises, between two steps."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds = inner, seconds
        self.deadline = time.monotonic() + seconds
        if callable(getattr(inner, "keep", None)):  # greedy search's dropping of finished rows
            self.keep = inner.keep

    def _check(self) -> None:
        if time.monotonic() > self.deadline:
            raise TimeLimitExceeded(
                f"did not finish within {self.seconds:g} s, the time limit for one backend on one request; "
                "a shorter text (or fewer runs) fits"
            )

    def encode(self, input_ids, attention_mask):
        self._check()
        return self.inner.encode(input_ids, attention_mask)

    def step(self, state, decoder_ids):
        self._check()
        return self.inner.step(state, decoder_ids)

    def expand(self, state, n):
        return self.inner.expand(state, n)

    def reorder(self, state, beam_idx):
        self._check()
        return self.inner.reorder(state, beam_idx)


def timed(backend: Backend, seconds: float) -> Backend:
    """The same backend, its engine under a deadline starting now."""
    return Backend(backend.name, _Timed(backend.model, seconds), backend.tokenizer, backend.manifest, backend.info)


# Source tokens per translate call, rows × longest row: bounds the single-step graph's
# (rows, steps, vocab) logits and the padding, while short sentences still go MAX_BATCH at once.
BATCH_TOKENS = 2048
MAX_BATCH = 16
def check_text(text: Any) -> str:
    """Reject what cannot be translated before any model is called (InputError, a ValueError)."""
    if not isinstance(text, str):
        raise InputError(f"expected text, got {type(text).__name__}")
    if not text.strip():
        raise InputError("the input is empty: type an English sentence to translate")
    return text


def split_input(text: str, count_tokens, max_tokens: int, limits: RequestLimits = RequestLimits()) -> list[Segment]:
    """The segments to translate: cleaned, split at sentences, each within `max_tokens`."""
    check_text(text)
    if len(text) > limits.max_chars:
        raise InputError(
            f"the input is {len(text):,} characters long; one request takes at most {limits.max_chars:,}: "
            "translate it in parts"
        )
    cleaned = clean(text)
    if all(ch.isspace() or unicodedata.category(ch) == "Cf" for ch in cleaned):
        raise InputError("the input holds no visible text, only control or format characters: nothing to translate")
    segments = split_text(cleaned, count_tokens, max_tokens)
    if len(segments) > limits.max_segments:
        raise InputError(
            f"the input splits into {len(segments)} sentences or chunks; one request translates at most "
            f"{limits.max_segments}: translate it in parts"
        )
    return segments


def plan(backends: dict[str, Backend], text: Any, limits: RequestLimits = RequestLimits()) -> list[Segment]:
    """`split_input` with the backends' shared tokenizer and source limit; [] when none loaded."""
    check_text(text)
    if not backends:
        return []
    backend = backends.get(REFERENCE) or next(iter(backends.values()))
    return split_input(text, backend.tokenizer.count_tokens, backend.manifest.max_source_tokens, limits)


def batches(lengths: list[int], budget: int = BATCH_TOKENS, max_rows: int = MAX_BATCH) -> list[list[int]]:
    """Segment indices, one list per translate call: longest first, so a batch's rows have similar
    lengths (little padding), and rows × longest row within `budget` (at least one row)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group and len(group) < max_rows and (len(group) + 1) * lengths[group[0]] <= budget:
            group.append(i)
        else:
            groups.append([i])
    return groups


def check_repeat(repeat: Any) -> int:
    if isinstance(repeat, float) and repeat.is_integer():
        repeat = int(repeat)  # number widgets send floats
    if not isinstance(repeat, int) or isinstance(repeat, bool) or not 1 <= repeat <= MAX_REPEAT:
        raise ValueError(f"repeat must be an integer in 1..{MAX_REPEAT}, got {repeat!r}")
    return repeat


def decoding_for(
    backends: dict[str, Backend],
    segments: list[Segment],
    *,
    num_beams: int | None,
    max_new_tokens: int | None,
    limits: RequestLimits = RequestLimits(),
) -> DecodeOptions:
    """The decoding this request runs, validated once: the model's own generation config (the
    export's sidecar) where the request leaves an option unset. Beams over `limits.max_beams` and
    work over `limits.max_work` (beams x segments x output cap) raise InputError with the numbers."""
    if isinstance(num_beams, float) and num_beams.is_integer():
        num_beams = int(num_beams)  # number widgets send floats
    if num_beams is not None and (isinstance(num_beams, bool) or not isinstance(num_beams, int)
                                  or not 1 <= num_beams <= limits.max_beams):
        raise InputError(f"num_beams must be an integer in 1..{limits.max_beams} (1: greedy search), got {num_beams!r}")
    backend = backends.get(REFERENCE) or next(iter(backends.values()), None)
    if backend is None:
        return DecodeOptions(max_new_tokens=max_new_tokens, num_beams=num_beams)
    manifest = backend.manifest
    try:
        options = DecodeOptions(max_new_tokens=max_new_tokens, num_beams=num_beams).resolved(
            manifest.max_new_tokens, manifest.generation
        )
    except ValueError as e:
        raise InputError(str(e)) from e
    if options.num_beams > limits.max_beams:  # the model's own default can be wider than the app allows
        raise InputError(
            f"the model decodes with {options.num_beams} beams; this app allows at most {limits.max_beams}: "
            "choose fewer beams"
        )
    work = options.num_beams * len(segments) * options.max_new_tokens
    if work > limits.max_work:
        raise InputError(
            f"{options.num_beams} beams x {len(segments)} segments x {options.max_new_tokens} tokens = {work:,} "
            f"decoder rows x steps; one request may cause at most {limits.max_work:,}: "
            "translate it in parts, or with fewer beams"
        )
    return options

