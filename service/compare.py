"""Run several backends on one input, one after another, and compare each with the reference.

The app renders what this module returns and the `compare` API endpoint returns it as JSON:

    {"reference": "pytorch",
     "decoding": {"strategy", "num_beams", "requested_num_beams", "length_penalty", "early_stopping",
                  "no_repeat_ngram_size", "repetition_penalty", "max_new_tokens", "min_new_tokens"},
     "segments": [{"text", "start", "end", "chunked"}],      # how the input was split, in order
     "backends": {NAME: {"text", "tokens", "token_ids", "segments", "timings_ms", "divergence",
                         "error", "warnings", "info", "stop_reason", "non_finite_steps",
                         "repeated_run", "runs"}}}

`decoding` is what every backend ran: the request's `num_beams` (None: the model's own
generation config from the export's sidecar) with the other options resolved from that config.
Each backend's `segments[i]` also carries `score` (the sequence score generate() reports),
`hypotheses` (with beams, the whole final beam, best first: {"text", "token_ids", "score"}) and
`reference_rank`: where the reference's best hypothesis stands in this backend's beam (0 = its
best too, None = not in it), a view of how close a diverging backend came.

Input of any length. The text is cleaned (control characters, NUL included, become spaces) and
split into sentences, a sentence over the model's source limit into chunks (`segment.py`); every
backend translates the same segments, in batches of similar length (`limits.batches`), and its
`text` is the segment outputs joined in order. `segments` (top level) is the split, with
character offsets into the original text; each backend's `segments[i]` holds segment i's output
(`text`, `tokens`, `token_ids`, `stop_reason`, `non_finite_steps`, `repeated_run`) and its
divergence summary. A backend's `tokens` / `token_ids` are every segment's tokens in order (each
segment's own eos included); `stop_reason` is "eos" only when every segment ended at eos,
`repeated_run` is the longest over segments and `non_finite_steps` lists {"segment", "step"}
pairs. Input errors raise `InputError` before any model call (`limits.py`). Messages count
segments from 1, JSON indices from 0.

Backends run one at a time, never concurrently: on a small CPU two decodes at once slow each
other down and the timings would mean nothing. `compare_iter` yields each backend's result as
soon as it is ready, so a UI can show it before the slower ones finish. Timings cover the whole
text: sums over the batches; `per_token` is decode time per batch step.

Divergence (`backends.divergence`): with several segments, a backend's `divergence` details one
segment, named by its `segment` index (0-based): the first segment whose tokens differ from the
reference's, else segment 0. Its `first`, `alignment`, `matching`, `agreement`, lengths and
`teacher_forced` are that segment's; `identical` (every segment identical), `segments_identical`
and `segments` cover the whole text, and each `segments[i].divergence` has segment i's
free-running summary (`identical`, `first_step`, `matching`, `agreement`, lengths). Teacher
forcing runs on that one segment only: it replays a whole decode per backend, and one segment's
drift is what the divergence view explains.

A result that cannot be trusted is an error, not a translation: logits with NaN or Inf (the
loop ends that row: `backends/processors.NonFiniteEndsAtEos`) set `error` to "non-finite logits (NaN/Inf) at
step k" and `text` to null. A run of one repeated token and a decode that hit the length cap
before eos are listed in `warnings`, in words (`messages.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from backends import BACKEND_NAMES, REFERENCE, Backend, DecodeOptions, ForcedScores, InputError, Translation
from backends.divergence import divergence, forced_drift
from backends.timing import median_timings, summarize_runs

from .limits import BATCH_TOKENS, MAX_BATCH, RequestLimits, batches, check_repeat, decoding_for, plan, timed
from .messages import non_finite_error, warnings_for
from .segment import Segment, join_translations

logger = logging.getLogger("service.compare")

TIMING_KEYS = ("tokenize", "encode", "first_token", "per_token", "decode", "total")


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
    # Per segment: where the reference's best hypothesis ranks in this backend's n-best list (0 =
    # this backend's best too; None = not among its hypotheses, or this is the reference).
    reference_ranks: list[int | None] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    decoding: dict[str, Any] = field(default_factory=dict)  # the request's decoding, the same for all

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
                "score": t.score,
                "hypotheses": [{"text": h.text, "token_ids": h.token_ids, "score": h.score} for h in t.hypotheses],
                "reference_rank": self.reference_ranks[i] if self.reference_ranks else None,
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


def _run(backend: Backend, segments: list[Segment], groups: list[list[int]], **decode) -> tuple[list, dict]:
    """Every segment through one backend, a batch per group; (translations in order, timings)."""
    translations: list[Translation | None] = [None] * len(segments)
    timings = dict.fromkeys(("tokenize", "encode", "first_token", "decode", "total", "steps", "engine"), 0.0)
    for k, group in enumerate(groups):
        out = backend.translate([segments[i].text for i in group], **decode)
        for i, t in zip(group, out):
            translations[i] = t
        batch = out[0].timings_ms  # batch-wide: every row of a call shares them
        for key in ("tokenize", "encode", "decode", "total", "steps", "engine"):
            timings[key] += batch[key]
        if k == 0:
            timings["first_token"] = batch["first_token"]
    timings["per_token"] = timings["decode"] / max(timings["steps"], 1)
    return translations, timings


def _rank(reference_ids: list[int], translation: Translation) -> int | None:
    """Where `reference_ids` stands in the translation's n-best list (0 = best), None if absent."""
    ids = [h.token_ids for h in translation.hypotheses] or [translation.token_ids]
    return ids.index(reference_ids) if reference_ids in ids else None


def decoding_json(options: DecodeOptions, requested: int | None) -> dict[str, Any]:
    """The decoding a request ran, echoed in the JSON: resolved values and where they came from."""
    return {
        "strategy": "greedy" if options.num_beams == 1 else "beam search",
        "num_beams": options.num_beams,
        "requested_num_beams": requested,  # None: the model's own generation config decided
        "length_penalty": options.length_penalty,
        "early_stopping": options.early_stopping,
        "no_repeat_ngram_size": options.no_repeat_ngram_size,
        "repetition_penalty": options.repetition_penalty,
        "max_new_tokens": options.max_new_tokens,
        "min_new_tokens": options.min_new_tokens,
    }


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
    num_beams: int | None = None,
) -> Iterator[BackendResult]:
    """Run each backend alone, in order, and yield its result as soon as it is complete.

    `num_beams` None decodes as the model's own generation config says (the export's sidecar);
    1 is greedy search. With beams, every backend returns its whole final beam (the n-best list)
    and each non-reference result says where the reference's best hypothesis ranks in it.

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
    options = decoding_for(backends, segments, num_beams=num_beams, max_new_tokens=max_new_tokens, limits=limits)
    beams = options.num_beams or 1
    decoding = decoding_json(options, requested=num_beams)
    decode = dict(max_new_tokens=options.max_new_tokens, top_k=top_k, num_beams=options.num_beams)
    if beams > 1:
        decode["num_return_sequences"] = beams  # the whole final beam: the n-best view

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
            yield BackendResult(
                name, segments=segments, error=f"failed to load: {load_errors[name]}", decoding=decoding
            )
            continue
        backend = timed(backends[name], limits.max_seconds)
        result = BackendResult(name, info=dict(backend.info), segments=segments, decoding=decoding)
        if groups is None:  # every beam is a decoder row: a batch holds 1/beams as many sentences
            lengths = [backend.tokenizer.count_tokens(s.text) for s in segments]
            groups = batches(lengths, BATCH_TOKENS // beams, max(1, MAX_BATCH // beams))
        try:
            runs = [_run(backend, segments, groups, **decode) for _ in range(repeat)]
        except InputError:
            raise
        except Exception as e:  # shown in this backend's panel; the others still run
            logger.exception("backend %s failed", name)
            result.error = _error(e)
            yield result
            continue
        result.translations = runs[-1][0]  # deterministic search: every run gives the same tokens
        result.timings_ms = median_timings([timings for _, timings in runs])
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
            result.reference_ranks = [
                _rank(r.token_ids, t) for r, t in zip(ref.translations, result.translations)
            ]
            same = sum(d["identical"] for d in per_segment)
            result.divergence = {
                **per_segment[focus],
                "reference_rank": result.reference_ranks[focus],
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
        "decoding": results[0].decoding if results else {},
        "segments": segments_json(results[0].segments if results else []),
        "backends": {r.name: r.to_json() for r in results},
    }


def compare(backends: dict[str, Backend], text: str, **kwargs) -> dict[str, Any]:
    """`compare_iter` run to the end, as the JSON the app's `compare` endpoint returns."""
    reference = kwargs.get("reference", REFERENCE)
    return to_json(list(compare_iter(backends, text, **kwargs)), reference)
