"""What decoding returns: per-step scores, hypotheses, translations, teacher-forced scores."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepScore:
    token_id: int
    logprob: float
    top_ids: list[int]  # best first; top_ids[0] is the argmax after masking
    top_logprobs: list[float]


@dataclass
class Hypothesis:
    """One entry of a sentence's n-best list."""

    text: str
    token_ids: list[int]
    # as generate()'s `sequences_scores`: sum(log-probs) / len(token_ids) ** length_penalty;
    # None when the call asked for no scores (output_scores=False)
    score: float | None


@dataclass
class Translation:
    text: str
    token_ids: list[int]  # generated ids, decoder start excluded, eos included when reached
    tokens: list[str]  # sentencepiece pieces of token_ids
    timings_ms: dict[str, float]  # tokenize, encode, first_token, decode, total, per_token, steps, engine (batch-wide)
    scores: list[StepScore]  # one per token; empty when the call asked for none (output_scores=False)
    stop_reason: str  # "eos", or "max_new_tokens" (cut at the cap, even where the model forces eos there)
    batch_size: int = 1
    non_finite_steps: list[int] = field(default_factory=list)  # steps whose logits held NaN or Inf
    repeated_run: int = 0  # longest run of one repeated token: a hint of degenerate output
    score: float | None = 0.0  # this hypothesis' sequence score (see Hypothesis.score)
    hypotheses: list[Hypothesis] = field(default_factory=list)  # num_return_sequences of them, best first


@dataclass
class ForcedScores:
    """Teacher-forced statistics of one given target sequence (decoder start excluded)."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of the given token at each step
    ranks: list[int]  # 0 = the given token was the argmax
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    logits: np.ndarray  # (steps, V) float32, raw (before masks), for max |Δlogit| across backends




@dataclass
class RowResult:
    """One sentence's result of the decoding loop, before detokenization (`Backend.translate`)."""

    token_ids: list[int]
    scores: list[StepScore]
    stop_reason: str
    timings_ms: dict[str, float]
    non_finite_steps: list[int] = field(default_factory=list)
    repeated_run: int = 0
    score: float | None = 0.0  # sum(log-probs) / len(token_ids) ** length_penalty; None: output_scores=False
    hypotheses: list[tuple[list[int], float | None]] = field(default_factory=list)  # (ids, score), best first


def longest_run(ids: list[int]) -> int:
    """The longest run of one repeated token (`RowResult.repeated_run`)."""
    best = run = 0
    prev = None
    for t in ids:
        run = run + 1 if t == prev else 1
        best, prev = max(best, run), t
    return best
