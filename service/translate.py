"""The `translate` request: one backend, many concurrent requests decoded together.

The app's `translate` endpoint is batched by `service.batcher.Batcher`: requests that wait together
reach `translate_batch` as lists, one item per request. Each request is checked alone (the same input
rules and limits as `compare`: `limits.plan`, `limits.decoding_for`); a refused one gets its
`error` and takes no part in the decode, the others go on. The accepted requests' sentences are
pooled per (backend, decoding) and translated in as few `Backend.translate` calls as the batch
limits allow (`batches`: similar lengths together), then split back per request and joined.

Each request's answer is the one it gets alone for the exact (fp32) backends: a sentence's rows
never mix with other rows in the decoding loop, and padding changes its logits by far less than
any gap between two tokens (the export's verification checks batch against single decodes).
int8 is batch-dependent: its activations are quantized with one scale per tensor, so a
sentence's int8 logits depend on the other sentences decoded with it, and a few sentences can
decode differently in a batch than alone (as they differ from PyTorch).

The answer, per request (`TranslateAnswer.to_json`):

    {"text", "error", "backend", "decoding", "segments": [{"text", "translation", "stop_reason"}],
     "warnings", "batch": {"requests", "refused", "decoded_together", "sentences", "calls"},
     "timings_ms": {"decode"}}

`text` is null exactly when `error` is set. `batch` says what the request shared: `requests`
were taken together (the batcher's batch), `refused` of them were refused, `decoded_together` went
through the same decode as this one (same backend and decoding), with `sentences` sentences in
`calls` Backend.translate calls; `timings_ms.decode` is the wall time of those calls, which the
request waited for as a whole.

`Traffic` records when translate decodes run, so the Compare view can say when its timings
overlapped with them (on a small CPU two decodes at once slow each other down).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from backends import APPROXIMATE, BACKEND_NAMES, REFERENCE, Backend, DecodeOptions, InputError
from backends.memory import HeapTrimmer

from .batcher import Batcher
from .compare import decoding_json
from .limits import RequestLimits, batches, decoding_for, plan, timed
from .messages import non_finite_error, warnings_for
from .segment import Segment, join_translations

logger = logging.getLogger("service.translate")

# Requests one decode takes (the batcher's cap): the batch size the engines are measured at.
MAX_REQUESTS = 32
# Sentences per Backend.translate call, and decoder rows x longest source row per call: beams
# multiply rows, so 32 sentences of up to 128 tokens fit with 4 beams.
MAX_SENTENCES = 32
ROW_TOKENS = 16_384


class Traffic:
    """When translate decodes ran: a count of decodes started and of those running now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = 0
        self._running = 0

    @contextmanager
    def running(self) -> Iterator[None]:
        with self._lock:
            self._started += 1
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1

    def mark(self) -> tuple[int, int]:
        """A point in time to ask `since` about."""
        with self._lock:
            return self._started, self._running

    def since(self, mark: tuple[int, int]) -> int:
        """Translate decodes that ran at some moment after `mark`: those running then and those started since."""
        started, running = mark
        with self._lock:
            return self._started - started + running


def overlap_warning(decodes: int) -> str | None:
    """The words next to timings taken while `decodes` translate decodes ran; None for none."""
    if decodes <= 0:
        return None
    return (f"timed while {decodes} translate decode{'s' if decodes > 1 else ''} ran on this machine: "
            "slower than alone")


def verified_speed(manifest, name: str) -> float | None:
    """Seconds the export's verification took to decode its sentences with backend `name` (greedy
    plus the model's own decoding), or None when the sidecar does not show it token-identical to
    the reference on every one of them (or records no verification)."""
    verification = manifest.data.get("verification") or {}
    total = 0.0
    runs = [verification.get("greedy"), verification.get("model_decoding")]
    if runs[0] is None:
        return None
    for run in runs:
        if run is None:  # a greedy model: its own decoding is the greedy run
            continue
        if name == REFERENCE:
            total += float(run["reference_seconds"])
            continue
        result = (run.get("backends") or {}).get(name)
        if result is None or result["identical_ids"] != run["sentences"]:
            return None
        total += float(result["seconds"])
    return total


# The verification decodes a few sentences once per backend, a timing that varies by a tenth or two
# run to run: an approximate backend (fp16, int8) is the default only where it took under three
# quarters of the fastest exact one's time (on the CPU, fp16 computes in fp32 and is never that).
APPROXIMATE_MARGIN = 0.75


def default_backend(backends: dict[str, Backend]) -> str | None:
    """The fastest loaded backend whose verification passed (token-identical to the reference on
    every verification sentence, greedy and the model's own decoding), as the export's sidecar
    timed them; an approximate backend must take under `APPROXIMATE_MARGIN` of the fastest exact
    one's time, and ties go to the registry's order. None when the sidecar shows none (an export
    made with --no-verify)."""
    order = {n: i for i, n in enumerate(BACKEND_NAMES)}
    timed_ = []
    for name, backend in backends.items():
        seconds = verified_speed(backend.manifest, name)
        if seconds is not None and name in order:
            timed_.append((seconds, name in APPROXIMATE, order[name], name))
    exact = [t for t in timed_ if not t[1]]
    if exact:
        best = min(exact)
        faster = [t for t in timed_ if t[1] and t[0] < APPROXIMATE_MARGIN * best[0]]
        return min(faster)[-1] if faster else best[-1]
    return min(timed_)[-1] if timed_ else None


@dataclass
class TranslateAnswer:
    """One request's answer; `error` set means refused or failed, and then no text."""

    backend: str | None = None
    segments: list[Segment] = field(default_factory=list)
    translations: list[Any] = field(default_factory=list)
    decoding: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    refused: bool = False  # the request itself was refused (not a failed decode): an HTTP API answers 422
    warnings: list[str] = field(default_factory=list)
    batch: dict[str, int] = field(default_factory=dict)
    decode_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        ok = self.error is None and self.translations
        return {
            "text": join_translations([t.text for t in self.translations]) if ok else None,
            "error": self.error,
            "backend": self.backend,
            "decoding": self.decoding,
            "segments": [
                {"text": s.text, "translation": t.text, "stop_reason": t.stop_reason}
                for s, t in zip(self.segments, self.translations)
            ] if ok else [],
            "warnings": self.warnings,
            "batch": self.batch,
            "timings_ms": {"decode": round(self.decode_ms, 3)},
        }


def _choose(backends: dict[str, Backend], default: str | None, name: Any) -> str:
    if name is None or name == "":
        if default is None:
            raise InputError("no backend is chosen by default (the export's verification shows none token-identical "
                             f"to the reference): name one of: {', '.join(backends)}")
        return default
    if not isinstance(name, str) or name not in backends:
        raise InputError(f"unknown backend {name!r}; expected one of: {', '.join(backends)}")
    return name


def _check(backends, default, text, num_beams, backend, *, limits, max_new_tokens):
    """(backend name, segments, options) for one request, or InputError naming what is wrong."""
    if isinstance(num_beams, float) and num_beams.is_integer():
        num_beams = int(num_beams)
    if num_beams == 0:
        num_beams = None  # the page's "model default"
    name = _choose(backends, default, backend)
    one = {name: backends[name]}
    segments = plan(one, text, limits)
    options = decoding_for(one, segments, num_beams=num_beams, max_new_tokens=max_new_tokens, limits=limits)
    return name, segments, options, num_beams


def translate_batch(
    backends: dict[str, Backend],
    texts: list[Any],
    num_beams: list[Any] | None = None,
    backend_names: list[Any] | None = None,
    *,
    default: str | None = None,
    limits: RequestLimits = RequestLimits(),
    max_new_tokens: int | None = None,
    traffic: Traffic | None = None,
    max_sentences: int = MAX_SENTENCES,
) -> list[TranslateAnswer]:
    """One answer per request, in order. `num_beams[i]` None (or 0) decodes as the model's own
    generation config; `backend_names[i]` None runs `default`. A refused request gets its error and
    the rest still run; a decode that fails answers every request in it with that failure."""
    n = len(texts)
    num_beams = list(num_beams) if num_beams is not None else [None] * n
    backend_names = list(backend_names) if backend_names is not None else [None] * n
    if not len(num_beams) == len(backend_names) == n:
        raise ValueError(f"one value per request: {n} texts, {len(num_beams)} num_beams, {len(backend_names)} backends")
    answers = [TranslateAnswer() for _ in range(n)]
    groups: dict[tuple[str, DecodeOptions], list[int]] = {}
    for i in range(n):
        try:
            name, segments, options, requested = _check(
                backends, default, texts[i], num_beams[i], backend_names[i], limits=limits,
                max_new_tokens=max_new_tokens,
            )
        except (InputError, ValueError) as e:
            answers[i].error, answers[i].refused = str(e), True
            continue
        answers[i].backend, answers[i].segments = name, segments
        answers[i].decoding = decoding_json(options, requested)
        groups.setdefault((name, options), []).append(i)
    arrived = {"requests": n, "refused": n - sum(len(m) for m in groups.values())}
    for a in answers:
        a.batch = dict(arrived)
    for (name, options), members in groups.items():
        _decode(backends[name], options, [answers[i] for i in members], limits, traffic, max_sentences)
    return answers


def _decode(backend: Backend, options: DecodeOptions, answers: list[TranslateAnswer], limits: RequestLimits,
            traffic: Traffic | None, max_sentences: int) -> None:
    """Every sentence of `answers` through `backend` with `options`, then each request's back to it."""
    pooled = [(a, k) for a in answers for k in range(len(a.segments))]
    texts = [a.segments[k].text for a, k in pooled]
    lengths = [backend.tokenizer.count_tokens(t) for t in texts]
    beams = options.num_beams
    calls = batches(lengths, ROW_TOKENS // beams, max_sentences)
    out: list[Any] = [None] * len(texts)
    # As `compare` runs it (the rest from the model's config); ids and text only, as generate() returns.
    decode = dict(max_new_tokens=options.max_new_tokens, num_beams=beams, top_k=1, output_scores=False)
    started = time.perf_counter()
    try:
        with traffic.running() if traffic is not None else _nothing():
            for call in calls:  # each call under its own deadline: a batch is many requests' work
                for i, t in zip(call, timed(backend, limits.max_seconds).translate([texts[i] for i in call], **decode)):
                    out[i] = t
    except Exception as e:  # every request in this decode shares its failure; other groups still run
        logger.exception("translate with %s failed", backend.name)
        for a in answers:
            a.error = f"the decode this request was part of failed: {type(e).__name__}: {e}"
        return
    elapsed = (time.perf_counter() - started) * 1000
    shared = {"decoded_together": len(answers), "sentences": len(texts), "calls": len(calls)}
    for (a, _), t in zip(pooled, out):
        a.translations.append(t)
    for a in answers:
        a.batch.update(shared)
        a.decode_ms = elapsed
        a.warnings = warnings_for(a.translations)
        a.error = non_finite_error(a.translations)


def translate_batcher(backends: dict[str, Backend], policy, *, default: str | None, limits: RequestLimits,
                      max_new_tokens: int | None, traffic: Traffic | None) -> Batcher:
    """The app's one `Batcher` for translate requests: items (text, num_beams, backend), answers
    `TranslateAnswer`s, every batch through `translate_batch`; the heap trimmed after at most one
    batch a second, once its callers have their answers. The Gradio API and the HTTP route share it."""
    def decode(requests: list[tuple]) -> list[TranslateAnswer]:
        texts, beams, names = (list(column) for column in zip(*requests))
        return translate_batch(backends, texts, beams, names, default=default, limits=limits,
                               max_new_tokens=max_new_tokens, traffic=traffic)

    return Batcher(decode, policy, name="translate-batcher", after_batch=HeapTrimmer(1.0))


@contextmanager
def _nothing() -> Iterator[None]:
    yield
