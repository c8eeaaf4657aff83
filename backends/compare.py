"""Run several backends on one input, align their tokens to the reference, measure divergence.

The app renders what this module returns and the `compare` API endpoint returns it as JSON:

    {"reference": "pytorch",
     "segments": [{"text", "start", "end", "chunked"}],      # how the input was split, in order
     "backends": {NAME: {"text", "tokens", "token_ids", "segments", "timings_ms", "divergence",
                         "error", "warnings", "info", "stop_reason", "non_finite_steps",
                         "repeated_run", "runs"}}}

Input of any length. The text is cleaned (control characters, NUL included, become spaces) and
split into sentences, a sentence over the model's source limit into chunks (`segment.py`); every
backend translates the same segments, in batches of similar length, and its `text` is the
segment outputs joined in order. `segments` (top level) is the split, with character offsets
into the original text; each backend's `segments[i]` holds segment i's output (`text`,
`tokens`, `token_ids`, `stop_reason`, `non_finite_steps`, `repeated_run`) and its divergence
summary. A backend's `tokens` / `token_ids` are every segment's tokens in order (each segment's
own eos included); `stop_reason` is "eos" only when every segment ended at eos, `repeated_run` is
the longest over segments and `non_finite_steps` lists {"segment", "step"} pairs. Empty text,
text with nothing visible (only control or format characters) and text over `RequestLimits`
(characters, segments) raise `InputError` before any model is called: nothing is ever
truncated. A backend still busy after `RequestLimits.max_seconds` stops with that as its `error`
(decoding time grows with output length, unknown up front); the others still run. Messages
count segments from 1, JSON indices from 0.

Backends run one at a time, never concurrently: on a small CPU two decodes at once slow each
other down and the timings would mean nothing. `compare_iter` yields each backend's result as
soon as it is ready, so a UI can show it before the slower ones finish. Timings cover the whole
text: sums over the batches; `per_token` is decode time per batch step.

Divergence of a backend against the reference has two views:
  * free-running: both decode greedily; tokens are aligned (difflib on token ids), and the first
    step whose token differs is reported with both tokens, their probabilities and the
    top-1/top-2 margin in both backends (a small margin means a near-tie flipped);
  * teacher-forced: the backend is fed the reference's own tokens (`Backend.score`), and per step
    we report max |Δlogit| against the reference's forced logits and the rank and probability
    of the reference token, so numeric drift shows even when the outputs agree.
With several segments, a backend's `divergence` details one segment, named by its `segment`
index (0-based): the first segment whose tokens differ from the reference's, else segment 0.
Its `first`, `alignment`, `matching`, `agreement`, lengths and `teacher_forced` are that
segment's; `identical` (every segment identical), `segments_identical` and `segments` cover the
whole text, and each `segments[i].divergence` has segment i's free-running summary
(`identical`, `first_step`, `matching`, `agreement`, lengths). Teacher forcing runs on that one
segment only: it replays a whole decode per backend, and one segment's drift is what the
divergence view explains.

A result that cannot be trusted is an error, not a translation: logits with NaN or Inf (the
loop ends that row, see `decoding.py`) set `error` to "non-finite logits (NaN/Inf) at step k"
and `text` to null. A run of one repeated token (`REPEATED_RUN_FLAG` or longer) and a decode
that hit the length cap before eos are listed in `warnings`, in words.
No torch here: the reference's numbers come through the same `Backend` interface.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import statistics
import time
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import BACKEND_NAMES, REFERENCE
from .base import Backend, ForcedScores, StepScore, Translation
from .segment import Segment, clean, join_translations, split_text
from .tokenizer import InputError

logger = logging.getLogger("backends.compare")

TIMING_KEYS = ("tokenize", "encode", "first_token", "per_token", "decode", "total")
MAX_REPEAT = 20


# ---------------------------------------------------------------------------------------------
# Alignment of two token sequences


@dataclass(frozen=True)
class AlignedToken:
    """One row of an alignment: `op` is same, changed (both present, differ), missing (only the
    reference has it) or extra (only the backend has it). Steps are 0-based generation steps."""

    op: str
    ref_id: int | None
    ref_step: int | None
    id: int | None
    step: int | None


def align(reference: list[int], other: list[int]) -> list[AlignedToken]:
    """Align `other` to `reference` with a longest-matching-blocks diff (difflib, no junk
    heuristics), so a single inserted token shows as one extra row, not as a shifted tail."""
    rows: list[AlignedToken] = []
    matcher = difflib.SequenceMatcher(a=reference, b=other, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            rows += [AlignedToken("same", reference[i], i, other[j], j) for i, j in zip(range(i1, i2), range(j1, j2))]
        elif op == "replace":
            n = max(i2 - i1, j2 - j1)
            for k in range(n):
                i, j = i1 + k, j1 + k
                has_i, has_j = i < i2, j < j2
                kind = "changed" if has_i and has_j else ("missing" if has_i else "extra")
                rows.append(
                    AlignedToken(
                        kind,
                        reference[i] if has_i else None,
                        i if has_i else None,
                        other[j] if has_j else None,
                        j if has_j else None,
                    )
                )
        elif op == "delete":
            rows += [AlignedToken("missing", reference[i], i, None, None) for i in range(i1, i2)]
        elif op == "insert":
            rows += [AlignedToken("extra", None, None, other[j], j) for j in range(j1, j2)]
    return rows


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """The first generation step at which the two greedy sequences differ, or None if identical.

    Positional on purpose: both decoders saw the same prefix up to that step, so that step is
    where the numbers first tipped a choice. A length difference counts at the shorter length.
    """
    for step, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return step
    if len(reference) != len(other):
        return min(len(reference), len(other))
    return None


# ---------------------------------------------------------------------------------------------
# Per-step statistics


def _prob(logprob: float | None) -> float | None:
    return None if logprob is None or not math.isfinite(logprob) else math.exp(logprob)


def step_view(score: StepScore, pieces, other_id: int | None) -> dict[str, Any]:
    """What one backend decided at one step: its token and probability, the runner-up and the
    top-1/top-2 margin (in log-probability = logit units, and in probability), and the
    probability it gave the other backend's token when that is within its recorded top-k."""
    lps = score.top_logprobs
    second = lps[1] if len(lps) > 1 else None
    other_lp = None
    if other_id is not None and other_id in score.top_ids:
        other_lp = lps[score.top_ids.index(other_id)]
    return {
        "token": pieces([score.token_id])[0],
        "token_id": score.token_id,
        "prob": _prob(score.logprob),
        "runner_up": pieces([score.top_ids[1]])[0] if second is not None else None,
        "runner_up_prob": _prob(second),
        "margin_logprob": None if second is None else _finite(lps[0] - second),
        "margin_prob": None if second is None else _prob(lps[0]) - _prob(second),
        "other_token_prob": _prob(other_lp),  # None: not within this backend's top-k
    }


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def forced_drift(reference: ForcedScores, other: ForcedScores) -> dict[str, Any]:
    """Teacher-forced comparison on the same token sequence: per step max |Δlogit| over the
    vocabulary, and the rank (0 = argmax) and probability of the reference token in `other`."""
    if reference.token_ids != other.token_ids:
        raise ValueError("forced scores were computed on different token sequences")
    a = reference.logits.astype(np.float64)  # (steps, V)
    b = other.logits.astype(np.float64)
    both_finite = np.isfinite(a) & np.isfinite(b)
    # An entry finite in one and not the other (or NaN anywhere) is a real disagreement: count
    # it; equal infinities (e.g. a masked id) are not.
    mismatched = ~both_finite & ~(a == b)
    diff = np.where(both_finite, np.abs(a - b), 0.0).max(axis=1)
    steps = len(other.token_ids)
    return {
        "steps": steps,
        "max_abs_dlogit": [float(x) for x in diff],
        "max_abs_dlogit_overall": float(diff.max()) if steps else 0.0,
        "non_finite_mismatch_steps": [int(s) for s in np.flatnonzero(mismatched.any(axis=1))],
        "ref_token_rank": list(other.ranks),
        "ref_token_prob": [_prob(lp) for lp in other.logprobs],
        "ref_token_prob_reference": [_prob(lp) for lp in reference.logprobs],
        "steps_not_argmax": [i for i, r in enumerate(other.ranks) if r != 0],
    }


def divergence(
    reference: Translation, other: Translation, pieces, forced: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Free-running divergence of `other` against `reference` (plus the forced view if given)."""
    rows = align(reference.token_ids, other.token_ids)
    same = sum(r.op == "same" for r in rows)
    step = first_divergence(reference.token_ids, other.token_ids)
    first = None
    if step is not None and step < len(reference.scores) and step < len(other.scores):
        ref_s, oth_s = reference.scores[step], other.scores[step]
        first = {
            "step": step,
            "reference": step_view(ref_s, pieces, oth_s.token_id),
            "backend": step_view(oth_s, pieces, ref_s.token_id),
        }
    elif step is not None:  # one sequence is a prefix of the other (different length caps)
        first = {"step": step, "reference": None, "backend": None}

    def piece(token_id):
        return None if token_id is None else pieces([token_id])[0]

    return {
        "identical": reference.token_ids == other.token_ids,
        "reference_length": len(reference.token_ids),
        "length": len(other.token_ids),
        "matching": same,
        # Share of aligned rows that match; 1.0 only when the sequences are identical.
        "agreement": same / len(rows) if rows else 1.0,
        "first": first,
        "alignment": [
            {
                "op": r.op,
                "ref": piece(r.ref_id),
                "ref_id": r.ref_id,
                "token": piece(r.id),
                "token_id": r.id,
                "step": r.step,
                "ref_step": r.ref_step,
            }
            for r in rows
        ],
        "teacher_forced": forced,
    }


# ---------------------------------------------------------------------------------------------
# Repeated timing


def summarize_runs(totals: list[float]) -> dict[str, Any]:
    """Run 1 is the cold one (first call on this input: caches, allocator, lazy init); median and
    spread are over the warm runs when there are any, else over the one run."""
    warm = totals[1:] or totals
    return {
        "n": len(totals),
        "totals_ms": totals,
        "cold_ms": totals[0],
        "median_ms": statistics.median(warm),
        "min_ms": min(warm),
        "max_ms": max(warm),
        "spread_ms": max(warm) - min(warm),
        "stdev_ms": statistics.stdev(warm) if len(warm) > 1 else 0.0,
        "over": "warm runs 2..n" if len(totals) > 1 else "the single (cold) run",
    }


def _median_timings(runs: list[dict[str, float]]) -> dict[str, float]:
    warm = runs[1:] or runs
    return {k: statistics.median(r[k] for r in warm) for k in warm[0]}


# ---------------------------------------------------------------------------------------------
# Input: checks, and the split into segments


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

    def __post_init__(self):
        if self.max_chars < 1 or self.max_segments < 1 or not self.max_seconds > 0:
            raise ValueError(
                "max_chars and max_segments must be >= 1 and max_seconds > 0, got "
                f"{self.max_chars}, {self.max_segments}, {self.max_seconds}"
            )


class TimeLimitExceeded(RuntimeError):
    """A backend ran past `RequestLimits.max_seconds` on one request."""


class _Timed:
    """A backend's engine with a deadline: the first call past it raises, between two steps."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds = inner, seconds
        self.deadline = time.monotonic() + seconds

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


def timed(backend: Backend, seconds: float) -> Backend:
    """The same backend, its engine under a deadline starting now."""
    return Backend(backend.name, _Timed(backend.model, seconds), backend.tokenizer, backend.manifest, backend.info)


# Source tokens per translate call, rows × longest row: bounds the single-step graph's
# (rows, steps, vocab) logits and the padding, while short sentences still go MAX_BATCH at once.
BATCH_TOKENS = 2048
MAX_BATCH = 16
# This many equal tokens in a row is flagged: real text rarely repeats a piece 4 times running,
# degenerate decoding ("的的的的…") does.
REPEATED_RUN_FLAG = 4


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


# ---------------------------------------------------------------------------------------------
# Orchestration


@dataclass
class BackendResult:
    name: str
    info: dict[str, Any] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)  # the input's split, shared by all
    translations: list[Translation] = field(default_factory=list)  # one per segment, in order
    runs: dict[str, Any] | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    divergence: dict[str, Any] | None = None
    segment_divergence: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def translation(self) -> Translation | None:
        """The translation of a one-segment input (None when the backend failed)."""
        if len(self.translations) > 1:
            raise ValueError(f"the input has {len(self.translations)} segments: read .translations")
        return self.translations[0] if self.translations else None

    def to_json(self) -> dict[str, Any]:
        ts = self.translations
        segments = [
            {
                "text": None if t.non_finite_steps else t.text,
                "tokens": t.tokens,
                "token_ids": t.token_ids,
                "stop_reason": t.stop_reason,
                "non_finite_steps": t.non_finite_steps,
                "repeated_run": t.repeated_run,
                "divergence": self.segment_divergence[i] if self.segment_divergence else None,
            }
            for i, t in enumerate(ts)
        ]
        return {
            "text": join_translations([t.text for t in ts]) if ts and self.error is None else None,
            "tokens": [p for t in ts for p in t.tokens],
            "token_ids": [i for t in ts for i in t.token_ids],
            "segments": segments,
            "timings_ms": self.timings_ms,
            "divergence": self.divergence,
            "error": self.error,
            "warnings": self.warnings,
            "info": self.info,
            "stop_reason": (
                None if not ts else "eos" if all(t.stop_reason == "eos" for t in ts) else "max_new_tokens"
            ),
            "non_finite_steps": [{"segment": i, "step": s} for i, t in enumerate(ts) for s in t.non_finite_steps],
            "repeated_run": max((t.repeated_run for t in ts), default=0),
            "runs": self.runs,
        }


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _where(indices: list[int], n: int) -> str:
    """' in segments 2, 5' (counted from 1, as the page numbers them); '' for a one-segment input."""
    if n == 1:
        return ""
    shown = ", ".join(str(i + 1) for i in indices[:10])
    more = f" and {len(indices) - 10} more" if len(indices) > 10 else ""
    return f" in segment{'s' if len(indices) > 1 else ''} {shown}{more} of {n}"


def non_finite_error(translations: list[Translation]) -> str | None:
    """The error shown instead of a translation whose logits held NaN or Inf."""
    bad = [i for i, t in enumerate(translations) if t.non_finite_steps]
    if not bad:
        return None
    steps = translations[bad[0]].non_finite_steps  # one: the loop ends a row at its first such step
    more = f" (and {len(bad) - 1} more segments)" if len(bad) > 1 else ""
    return f"non-finite logits (NaN/Inf) at step {steps[0]}{_where(bad[:1], len(translations))}{more}"


def warnings_for(translations: list[Translation]) -> list[str]:
    n, out = len(translations), []
    repeated = [i for i, t in enumerate(translations) if t.repeated_run >= REPEATED_RUN_FLAG]
    if repeated:
        longest = max(translations[i].repeated_run for i in repeated)
        out.append(f"repeated token run of {longest}{_where(repeated, n)}")
    capped = [i for i, t in enumerate(translations) if t.stop_reason != "eos" and not t.non_finite_steps]
    if capped:
        cap = len(translations[capped[0]].token_ids)
        out.append(f"stopped at the {cap}-token cap before eos{_where(capped, n)}")
    return out


def _run(backend: Backend, segments: list[Segment], groups: list[list[int]], **decode) -> tuple[list, dict]:
    """Every segment through one backend, a batch per group; (translations in order, timings)."""
    translations: list[Translation | None] = [None] * len(segments)
    timings = dict.fromkeys(("tokenize", "encode", "first_token", "decode", "total", "steps"), 0.0)
    for k, group in enumerate(groups):
        out = backend.translate([segments[i].text for i in group], **decode)
        for i, t in zip(group, out):
            translations[i] = t
        batch = out[0].timings_ms  # batch-wide: every row of a call shares them
        for key in ("tokenize", "encode", "decode", "total", "steps"):
            timings[key] += batch[key]
        if k == 0:
            timings["first_token"] = batch["first_token"]
    timings["per_token"] = timings["decode"] / max(timings["steps"], 1)
    return translations, timings


def _summary(d: dict[str, Any]) -> dict[str, Any]:
    keys = ("identical", "reference_length", "length", "matching", "agreement")
    return {**{k: d[k] for k in keys}, "first_step": d["first"]["step"] if d["first"] else None}


def compare_iter(
    backends: dict[str, Backend],
    text: str,
    *,
    reference: str = REFERENCE,
    repeat: int = 1,
    max_new_tokens: int | None = None,
    top_k: int = 5,
    load_errors: dict[str, str] | None = None,
    teacher_forced: bool = True,
    limits: RequestLimits = RequestLimits(),
) -> Iterator[BackendResult]:
    """Run each backend alone, in order, and yield its result as soon as it is complete.

    The reference runs first, then the others in `BACKEND_NAMES` order. A backend that raises (or
    failed to load, per `load_errors`) yields a result with `error` set; the others still run.
    Input errors (empty text, too long a request) raise InputError before any model call, since
    they concern every backend.
    """
    segments = plan(backends, text, limits)
    repeat = check_repeat(repeat)
    load_errors = dict(load_errors or {})
    known = {n: i for i, n in enumerate(BACKEND_NAMES)}
    names = list(dict.fromkeys([*backends, *load_errors]))  # unknown names keep their given order
    order = sorted(names, key=lambda n: (n != reference, known.get(n, len(known)), names.index(n)))
    decode = dict(max_new_tokens=max_new_tokens, top_k=top_k)

    groups: list[list[int]] | None = None
    ref: BackendResult | None = None
    ref_backend: Backend | None = None
    ref_forced: dict[int, ForcedScores | str] = {}  # per segment, computed when first needed

    def reference_forced(i: int) -> ForcedScores:
        if i not in ref_forced:
            try:  # under a deadline of its own: the reference's turn is over
                scorer = timed(ref_backend, limits.max_seconds)
                ref_forced[i] = scorer.score(segments[i].text, ref.translations[i].token_ids, top_k=top_k)
            except Exception as e:
                logger.exception("reference forced scoring failed")
                ref_forced[i] = _error(e)
        if isinstance(ref_forced[i], str):
            raise RuntimeError(f"the reference could not be scored: {ref_forced[i]}")
        return ref_forced[i]

    for name in order:
        if name in load_errors and name not in backends:
            yield BackendResult(name, segments=segments, error=f"failed to load: {load_errors[name]}")
            continue
        backend = timed(backends[name], limits.max_seconds)
        result = BackendResult(name, info=dict(backend.info), segments=segments)
        if groups is None:
            groups = batches([backend.tokenizer.count_tokens(s.text) for s in segments])
        try:
            runs = [_run(backend, segments, groups, **decode) for _ in range(repeat)]
        except InputError:
            raise
        except Exception as e:  # shown in this backend's panel; the others still run
            logger.exception("backend %s failed", name)
            result.error = _error(e)
            yield result
            continue
        result.translations = runs[-1][0]  # greedy: every run gives the same tokens
        result.timings_ms = _median_timings([timings for _, timings in runs])
        result.runs = summarize_runs([timings["total"] for _, timings in runs])
        result.warnings = warnings_for(result.translations)
        result.error = non_finite_error(result.translations)

        if name == reference:
            ref, ref_backend = result, backends[name]
        elif result.error is None and ref is not None and ref.error is None:
            pieces = backend.tokenizer.pieces
            per_segment = [divergence(r, t, pieces) for r, t in zip(ref.translations, result.translations)]
            result.segment_divergence = [_summary(d) for d in per_segment]
            focus = next((i for i, d in enumerate(per_segment) if not d["identical"]), 0)
            forced = None
            if teacher_forced:
                try:
                    mine = backend.score(segments[focus].text, ref.translations[focus].token_ids, top_k=top_k)
                    forced = forced_drift(reference_forced(focus), mine)
                except Exception as e:
                    logger.exception("forced scoring of %s failed", name)
                    forced = {"error": _error(e)}
            same = sum(d["identical"] for d in per_segment)
            result.divergence = {
                **per_segment[focus],
                "teacher_forced": forced,
                "identical": same == len(per_segment),
                "segment": focus,
                "segments": len(per_segment),
                "segments_identical": same,
            }
        elif result.error is None:
            why = f" ({ref.error})" if ref is not None and ref.error else ""
            result.divergence = {
                "error": f"no reference to compare with: {reference} did not produce a translation{why}"
            }
        yield result


def segments_json(segments: list[Segment]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(s) for s in segments]


def to_json(results: Iterable[BackendResult], reference: str = REFERENCE) -> dict[str, Any]:
    results = list(results)
    return {
        "reference": reference,
        "segments": segments_json(results[0].segments if results else []),
        "backends": {r.name: r.to_json() for r in results},
    }


def compare(backends: dict[str, Backend], text: str, **kwargs) -> dict[str, Any]:
    """`compare_iter` run to the end, as the JSON the app's `compare` endpoint returns."""
    reference = kwargs.get("reference", REFERENCE)
    return to_json(list(compare_iter(backends, text, **kwargs)), reference)
