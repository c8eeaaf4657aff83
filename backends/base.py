"""What every backend shares: decode options, results, and the backend class itself.

A backend is a tokenizer plus a `StepModel` (the engine: how next-token logits are produced).
Everything else, the greedy loop, stop rules, masks, timings and scores, lives in `decoding.py`
and is written once.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .manifest import Manifest, SpecialTokens
from .tokenizer import MarianTokenizerWrapper


@dataclass(frozen=True)
class DecodeOptions:
    # Hard cap on generated tokens, eos included; None takes the sidecar's limit (never unbounded).
    max_new_tokens: int | None = None
    # eos is masked until this many tokens exist; benchmarks force equal lengths with it.
    min_new_tokens: int = 0
    # Alternatives recorded per step for the divergence view.
    top_k: int = 5

    def resolved(self, limit: int) -> "DecodeOptions":
        """Validate against the model's limit and fill in the default; raises ValueError."""
        max_new = limit if self.max_new_tokens is None else self.max_new_tokens
        if not isinstance(max_new, int) or not 1 <= max_new <= limit:
            raise ValueError(f"max_new_tokens must be an integer in 1..{limit}, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= max_new:
            raise ValueError(f"min_new_tokens must be an integer in 0..{max_new}, got {self.min_new_tokens!r}")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= 50:
            raise ValueError(f"top_k must be an integer in 1..50, got {self.top_k!r}")
        return dataclasses.replace(self, max_new_tokens=max_new)


@dataclass
class StepScore:
    token_id: int
    logprob: float
    top_ids: list[int]  # best first; top_ids[0] is the argmax after masking
    top_logprobs: list[float]


@dataclass
class Translation:
    text: str
    token_ids: list[int]  # generated ids, decoder start excluded, eos included when reached
    tokens: list[str]  # sentencepiece pieces of token_ids
    timings_ms: dict[str, float]  # tokenize, encode, first_token, decode, total, per_token (batch-wide)
    scores: list[StepScore]
    stop_reason: str  # "eos" or "max_new_tokens"
    batch_size: int = 1
    non_finite_steps: list[int] = field(default_factory=list)  # steps whose logits held NaN or Inf
    repeated_run: int = 0  # longest run of one repeated token: a hint of degenerate output


@dataclass
class ForcedScores:
    """Teacher-forced statistics of one given target sequence (decoder start excluded)."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of the given token at each step
    ranks: list[int]  # 0 = the given token was the argmax
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    logits: np.ndarray  # (steps, V) float32, raw (before masks), for max |Δlogit| across backends


class StepModel(Protocol):
    """The engine behind a backend: encode once, then produce next-token logits per step."""

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Any:
        """input_ids, attention_mask: (b, s) int64 -> an opaque per-batch decoding state."""

    def step(self, state: Any, decoder_ids: np.ndarray) -> np.ndarray:
        """decoder_ids: (b, t) every token so far, start token first -> logits (b, V) float32."""


class Backend:
    """One named way to run the model; `translate` and `score` share the one decoding loop."""

    def __init__(
        self,
        name: str,
        model: StepModel,
        tokenizer: MarianTokenizerWrapper,
        manifest: Manifest,
        info: dict[str, Any],
    ):
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.manifest = manifest
        self.info = info  # provider, precision, graph files, threads: shown next to every result

    @property
    def special(self) -> SpecialTokens:
        return self.manifest.special

    def translate(
        self, texts: list[str], *, max_new_tokens: int | None = None, min_new_tokens: int = 0, top_k: int = 5
    ) -> list[Translation]:
        from .decoding import greedy_decode

        options = DecodeOptions(max_new_tokens, min_new_tokens, top_k).resolved(self.manifest.max_new_tokens)
        start = time.perf_counter()
        batch = self.tokenizer.encode(texts, self.manifest.max_source_tokens)
        tokenize_ms = (time.perf_counter() - start) * 1e3
        # The loop scores each step's logits on as many threads as the engine itself uses.
        threads = int(self.info.get("threads") or 1)
        results = greedy_decode(self.model, batch.input_ids, batch.attention_mask, self.special, options, threads)
        translations = []
        for r in results:
            timings = dict(r.timings_ms)
            timings["tokenize"] = tokenize_ms
            timings["total"] += tokenize_ms
            ids = r.token_ids
            translations.append(
                Translation(
                    text=self.tokenizer.decode(ids),
                    token_ids=ids,
                    tokens=self.tokenizer.pieces(ids),
                    timings_ms=timings,
                    scores=r.scores,
                    stop_reason=r.stop_reason,
                    batch_size=len(texts),
                    non_finite_steps=r.non_finite_steps,
                    repeated_run=r.repeated_run,
                )
            )
        return translations

    def score(self, text: str, target_ids: list[int], top_k: int = 5) -> ForcedScores:
        """Teacher-forced: score `target_ids` (e.g. the reference backend's output) for `text`."""
        from .decoding import forced_scores

        batch = self.tokenizer.encode([text], self.manifest.max_source_tokens)
        return forced_scores(self.model, batch.input_ids, batch.attention_mask, self.special, target_ids, top_k)

    def close(self) -> None:
        """Release the engine's memory (sessions, weights)."""
        self.model = None

    def __repr__(self) -> str:
        return f"<Backend {self.name} {self.info}>"
