"""How one backend's output differs from the reference's: pure functions on token ids and scores.

Two views (the app, the `compare` API and the benchmarks all use these):
  * free-running: both decode on their own; tokens are aligned (difflib on token ids), and the
    first step whose token differs is reported with both tokens, their probabilities and the
    top-1/top-2 margin in both backends (a small margin means a near-tie flipped);
  * teacher-forced: the backend is fed the reference's own tokens (`Backend.score`), and per step
    we report max |Δlogit| against the reference's forced logits and the rank and probability of
    the reference token, so numeric drift shows even when the outputs agree.
No torch here: the reference's numbers come through the same `Backend` interface.
"""

from __future__ import annotations

import difflib
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .results import ForcedScores, StepScore, Translation


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
        # Beam search and the logits processors often pick a token that is not top-1 (in PyTorch
        # too), so "not argmax" alone is no drift; a top-1 that differs from PyTorch's is.
        "steps_top1_differs": [int(s) for s in np.flatnonzero(a.argmax(axis=1) != b.argmax(axis=1))] if steps else [],
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


def token_parity(sentences: list[str], reference: list[Translation], outputs: list[Translation]) -> dict[str, Any]:
    """How one backend's free-running outputs compare with the reference's, sentence by sentence:
    identical ids and text, the share of reference positions holding the same token, and the
    first sentence whose ids differ (both id lists, to reproduce it)."""
    if not len(sentences) == len(reference) == len(outputs):
        raise ValueError(f"{len(sentences)} sentences, {len(reference)} reference and {len(outputs)} backend outputs")
    same_ids = [o.token_ids == r.token_ids for o, r in zip(outputs, reference)]
    tokens = sum(len(r.token_ids) for r in reference)
    agreeing = sum(sum(a == b for a, b in zip(o.token_ids, r.token_ids)) for o, r in zip(outputs, reference))
    mismatched = [i for i, same in enumerate(same_ids) if not same]
    first = mismatched[0] if mismatched else None
    return {
        "identical_ids": len(sentences) - len(mismatched),
        "identical_text": sum(o.text == r.text for o, r in zip(outputs, reference)),
        "token_agreement": agreeing / max(tokens, 1),  # positional, over the reference's tokens
        "first_mismatch": None
        if first is None
        else {"sentence": sentences[first], "reference": reference[first].token_ids, "backend": outputs[first].token_ids},
        "mismatched_sentences": [sentences[i] for i in mismatched],
    }


def _open_seconds(backend: Any) -> float:
    # A function, not a local: a name left bound to one engine would keep it alive while the
    # verification builds the next one (it holds one engine at a time).
    return getattr(getattr(backend, "model", None), "open_seconds", 0.0)


def parity_report(
    backends: dict[str, Any], sentences: list[str], reference: str, batch_size: int | None = None, **decode: Any
) -> dict[str, Any]:
    """Translate `sentences` with every backend (`batch_size` at a time; None: one batch) and
    compare each with `backends[reference]` (`token_parity`). The one runner behind the export's
    greedy verification and `python -m bench.parity`; `decode` goes to `Backend.translate` as is.
    Not pure: it runs the backends, and times each over all batches, less the time a low-memory
    engine spends reopening its graphs (reported as `graph_open_seconds`)."""
    if reference not in backends:
        raise ValueError(f"reference backend {reference!r} is not loaded; loaded: {', '.join(backends)}")
    size = batch_size or max(len(sentences), 1)
    outputs, seconds, opening = {}, {}, {}
    for name, backend in backends.items():
        opened = _open_seconds(backend)
        start = time.perf_counter()
        outputs[name] = [t for i in range(0, len(sentences), size) for t in backend.translate(sentences[i : i + size], **decode)]
        # a low-memory engine reopens its graphs on the way: that is load time, not decoding speed
        opening[name] = _open_seconds(backend) - opened
        seconds[name] = round(time.perf_counter() - start - opening[name], 2)
    ref = outputs[reference]
    return {
        "sentences": len(sentences),
        **decode,
        "batch_size": size,
        "backends": {
            name: {**token_parity(sentences, ref, outs), "seconds": seconds[name],
                   **({"graph_open_seconds": round(opening[name], 2)} if opening[name] else {})}
            for name, outs in outputs.items()
            if name != reference
        },
        "reference_seconds": seconds[reference],
    }
