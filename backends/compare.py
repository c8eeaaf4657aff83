"""Run several backends on one input, align their tokens to the reference, measure divergence.

The app renders what this module returns and the `compare` API endpoint returns it as JSON:

    {"reference": "pytorch",
     "backends": {NAME: {"text", "tokens", "token_ids", "timings_ms", "divergence", "error",
                         "info", "stop_reason", "runs"}}}

Backends run one at a time, never concurrently: on a small CPU two decodes at once slow each
other down and the timings would mean nothing. `compare_iter` yields each backend's result as
soon as it is ready, so a UI can show it before the slower ones finish.

Divergence of a backend against the reference has two views:
  * free-running: both decode greedily; tokens are aligned (difflib on token ids), and the first
    step whose token differs is reported with both tokens, their probabilities and the
    top-1/top-2 margin in both backends (a small margin means a near-tie flipped);
  * teacher-forced: the backend is fed the reference's own tokens (`Backend.score`), and per step
    we report max |Δlogit| against the reference's forced logits and the rank and probability
    of the reference token, so numeric drift shows even when the outputs agree.
No torch here: the reference's numbers come through the same `Backend` interface.
"""

from __future__ import annotations

import difflib
import logging
import math
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import BACKEND_NAMES, REFERENCE
from .base import Backend, ForcedScores, StepScore, Translation
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


def _median_timings(runs: list[Translation]) -> dict[str, float]:
    warm = runs[1:] or runs
    return {k: statistics.median(r.timings_ms[k] for r in warm) for k in warm[0].timings_ms}


# ---------------------------------------------------------------------------------------------
# Orchestration


def check_text(text: Any) -> str:
    """Reject what cannot be translated before any model is called (InputError, a ValueError)."""
    if not isinstance(text, str):
        raise InputError(f"expected text, got {type(text).__name__}")
    if not text.strip():
        raise InputError("the input is empty: type an English sentence to translate")
    return text


def check_repeat(repeat: Any) -> int:
    if isinstance(repeat, float) and repeat.is_integer():
        repeat = int(repeat)  # number widgets send floats
    if not isinstance(repeat, int) or isinstance(repeat, bool) or not 1 <= repeat <= MAX_REPEAT:
        raise ValueError(f"repeat must be an integer in 1..{MAX_REPEAT}, got {repeat!r}")
    return repeat


@dataclass
class BackendResult:
    name: str
    info: dict[str, Any] = field(default_factory=dict)
    translation: Translation | None = None
    runs: dict[str, Any] | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    divergence: dict[str, Any] | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        t = self.translation
        return {
            "text": t.text if t else None,
            "tokens": t.tokens if t else [],
            "token_ids": t.token_ids if t else [],
            "timings_ms": self.timings_ms,
            "divergence": self.divergence,
            "error": self.error,
            "info": self.info,
            "stop_reason": t.stop_reason if t else None,
            "non_finite_steps": t.non_finite_steps if t else [],
            "runs": self.runs,
        }


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


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
) -> Iterator[BackendResult]:
    """Run each backend alone, in order, and yield its result as soon as it is complete.

    The reference runs first, then the others in `BACKEND_NAMES` order. A backend that raises (or
    failed to load, per `load_errors`) yields a result with `error` set; the others still run.
    Input errors (empty text, too many tokens) raise InputError before or at the first model
    call, since they concern every backend.
    """
    check_text(text)
    repeat = check_repeat(repeat)
    load_errors = dict(load_errors or {})
    known = {n: i for i, n in enumerate(BACKEND_NAMES)}
    names = list(dict.fromkeys([*backends, *load_errors]))  # unknown names keep their given order
    order = sorted(names, key=lambda n: (n != reference, known.get(n, len(known)), names.index(n)))

    ref_translation: Translation | None = None
    ref_forced: ForcedScores | None = None
    ref_forced_error: str | None = None
    pieces = None
    for name in order:
        if name in load_errors and name not in backends:
            yield BackendResult(name, error=f"failed to load: {load_errors[name]}")
            continue
        backend = backends[name]
        result = BackendResult(name, info=dict(backend.info))
        pieces = pieces or backend.tokenizer.pieces
        try:
            runs = []
            for _ in range(repeat):
                runs.append(backend.translate([text], max_new_tokens=max_new_tokens, top_k=top_k)[0])
        except InputError:
            raise
        except Exception as e:  # shown in this backend's panel; the others still run
            logger.exception("backend %s failed", name)
            result.error = _error(e)
            yield result
            continue
        result.translation = runs[-1]  # greedy: every run gives the same tokens
        result.timings_ms = _median_timings(runs)
        result.runs = summarize_runs([r.timings_ms["total"] for r in runs])

        if name == reference:
            ref_translation = result.translation
            if teacher_forced:
                try:
                    ref_forced = backend.score(text, ref_translation.token_ids, top_k=top_k)
                except Exception as e:
                    logger.exception("reference forced scoring failed")
                    ref_forced_error = _error(e)
        elif ref_translation is not None:
            forced = None
            if teacher_forced:
                try:
                    if ref_forced is None:
                        raise RuntimeError(f"the reference could not be scored: {ref_forced_error}")
                    forced = forced_drift(ref_forced, backend.score(text, ref_translation.token_ids, top_k=top_k))
                except Exception as e:
                    logger.exception("forced scoring of %s failed", name)
                    forced = {"error": _error(e)}
            result.divergence = divergence(ref_translation, result.translation, pieces, forced)
        else:
            result.divergence = {"error": f"no reference to compare with: {reference} did not produce a translation"}
        yield result


def to_json(results: Iterable[BackendResult], reference: str = REFERENCE) -> dict[str, Any]:
    return {"reference": reference, "backends": {r.name: r.to_json() for r in results}}


def compare(backends: dict[str, Backend], text: str, **kwargs) -> dict[str, Any]:
    """`compare_iter` run to the end, as the JSON the app's `compare` endpoint returns."""
    reference = kwargs.get("reference", REFERENCE)
    return to_json(list(compare_iter(backends, text, **kwargs)), reference)
