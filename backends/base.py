"""What every backend shares: decode options, results, and the backend class itself.

A backend is a tokenizer plus a `StepModel` (the engine: how next-token logits are produced).
Everything else, the decoding loop (greedy and beam search), stop rules, masks, timings and
scores, lives in `decoding.py` and is written once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .manifest import GenerationDefaults, Manifest, SpecialTokens
from .tokenizer import TokenizerWrapper

MAX_BEAMS = 16


def _int_in(name: str, value: Any, low: int, high: int, note: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}{note}, got {value!r}")
    return int(value)


def _finite(name: str, value: Any, positive: bool = False, note: str = "") -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))
    if not ok or not math.isfinite(value) or (positive and not value > 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}{note}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DecodeOptions:
    """One call's decoding options. None takes the export's default: the model's own generation
    config as recorded in the sidecar (`GenerationDefaults`), else generate()'s default."""

    # Hard cap on generated tokens, eos included; None: the model's max_length, else the position limit.
    max_new_tokens: int | None = None
    # eos is masked until this many tokens exist; benchmarks force equal lengths with it.
    min_new_tokens: int | None = None
    # Alternatives recorded per step for the divergence view.
    top_k: int = 5
    # 1: greedy search; 2..MAX_BEAMS: beam search with that many hypotheses per sentence.
    num_beams: int | None = None
    # A finished hypothesis scores sum(log-probs) / length ** length_penalty (length counts eos).
    length_penalty: float | None = None
    # When a sentence's beam search ends: True, as soon as num_beams hypotheses are finished; False,
    # generate()'s heuristic (the best running score at the current length cannot win); "never",
    # the exact bound (at the longest possible length when length_penalty > 0).
    early_stopping: bool | str | None = None
    # No n-gram of this size appears twice in one hypothesis (0: off).
    no_repeat_ngram_size: int | None = None
    # > 1 lowers the score of every token already in the hypothesis, < 1 raises it (1.0: off).
    repetition_penalty: float | None = None
    # Hypotheses returned per sentence (the n-best list), best first; at most num_beams.
    num_return_sequences: int | None = None
    # Per-step log-probs and alternatives (`Translation.scores`) and sequence scores, as
    # generate()'s output_scores. False: token ids and text only (what generate() and CTranslate2
    # return by default); greedy search then skips the log-sum-exp over the vocabulary each step.
    output_scores: bool = True

    def resolved(self, limit: int, defaults: GenerationDefaults | None = None) -> "DecodeOptions":
        """Fill in the defaults and validate every option once; raises ValueError naming the valid range."""
        d = defaults or GenerationDefaults()

        def pick(name):
            value = getattr(self, name)
            return getattr(d, name) if value is None else value

        max_new = pick("max_new_tokens")
        max_new = _int_in("max_new_tokens", limit if max_new is None else max_new, 1, limit)
        min_new = _int_in("min_new_tokens", pick("min_new_tokens"), 0, max_new)
        _int_in("top_k", self.top_k, 1, 50)
        beams = _int_in("num_beams", pick("num_beams"), 1, MAX_BEAMS, " (1: greedy search)")
        returned = _int_in(
            "num_return_sequences", pick("num_return_sequences"), 1, beams, f" (at most num_beams, {beams})"
        )
        if not isinstance(self.output_scores, bool):
            raise ValueError(f"output_scores must be True or False, got {self.output_scores!r}")
        if not self.output_scores and self.top_k != 1:
            raise ValueError(
                f"top_k {self.top_k} asks for per-step alternatives with their log-probs, which "
                "output_scores=False does not record: pass top_k=1, or output_scores=True"
            )
        early = pick("early_stopping")
        if not (isinstance(early, bool) or early == "never"):
            raise ValueError(f"early_stopping must be one of: False, True, 'never'; got {early!r}")
        return dataclasses.replace(
            self,
            max_new_tokens=max_new,
            min_new_tokens=min_new,
            top_k=int(self.top_k),
            num_beams=beams,
            num_return_sequences=returned,
            length_penalty=_finite("length_penalty", pick("length_penalty")),
            early_stopping=early,
            no_repeat_ngram_size=_int_in(
                "no_repeat_ngram_size", pick("no_repeat_ngram_size"), 0, max_new, " (0: off)"
            ),
            repetition_penalty=_finite("repetition_penalty", pick("repetition_penalty"), True, " (1.0: off)"),
        )


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


class StepModel(Protocol):
    """The engine behind a backend: encode once, then produce next-token logits per step.

    Beam search also needs `expand` and `reorder`; both searches call `keep` where the engine has it.
    """

    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> Any:
        """input_ids, attention_mask: (b, s) int64 -> an opaque per-batch decoding state."""

    def step(self, state: Any, decoder_ids: np.ndarray) -> np.ndarray:
        """decoder_ids: (b, t) every token so far, start token first -> logits (b, V) float32."""

    def expand(self, state: Any, n: int) -> None:
        """Repeat each sentence's state n times, once, before the first step: rows [s0 x n, s1 x n, ...]."""

    def reorder(self, state: Any, beam_idx: np.ndarray) -> None:
        """beam_idx: (rows,) int64; row i continues from row beam_idx[i] (its cache and positions)."""

    def keep(self, state: Any, rows: np.ndarray) -> None:
        """Optional: only these rows (ascending indices into the current ones) go on; the others'
        sentences are finished (beam search: every beam of a sentence together). Without it,
        finished rows are computed to the end."""


class Backend:
    """One named way to run the model; `translate` and `score` share the one decoding loop."""

    def __init__(
        self,
        name: str,
        model: StepModel,
        tokenizer: TokenizerWrapper,
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
        self,
        texts: list[str],
        *,
        max_new_tokens: int | None = None,
        min_new_tokens: int | None = None,
        top_k: int = 5,
        num_beams: int | None = None,
        length_penalty: float | None = None,
        early_stopping: bool | str | None = None,
        no_repeat_ngram_size: int | None = None,
        repetition_penalty: float | None = None,
        num_return_sequences: int | None = None,
        output_scores: bool = True,
    ) -> list[Translation]:
        """One Translation per text. None takes the export's default (see `DecodeOptions`)."""
        from .decoding import decode

        options = DecodeOptions(
            max_new_tokens,
            min_new_tokens,
            top_k,
            num_beams=num_beams,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            no_repeat_ngram_size=no_repeat_ngram_size,
            repetition_penalty=repetition_penalty,
            num_return_sequences=num_return_sequences,
            output_scores=output_scores,
        ).resolved(self.manifest.max_new_tokens, self.manifest.generation)
        start = time.perf_counter()
        batch = self.tokenizer.encode(texts, self.manifest.max_source_tokens)
        tokenize_ms = (time.perf_counter() - start) * 1e3
        # The loop scores each step's logits on as many threads as the engine itself uses.
        threads = int(self.info.get("threads") or 1)
        results = decode(
            self.model, batch.input_ids, batch.attention_mask, self.special, options, threads, self.manifest.generation
        )
        translations = []
        for r in results:
            timings = dict(r.timings_ms)
            timings["tokenize"] = tokenize_ms
            timings["total"] += tokenize_ms
            ids = r.token_ids
            text = self.tokenizer.decode(ids)
            translations.append(
                Translation(
                    text=text,
                    token_ids=ids,
                    tokens=self.tokenizer.pieces(ids),
                    timings_ms=timings,
                    scores=r.scores,
                    stop_reason=r.stop_reason,
                    batch_size=len(texts),
                    non_finite_steps=r.non_finite_steps,
                    repeated_run=r.repeated_run,
                    score=r.score,
                    # The best hypothesis is the translation itself (greedy search's only one): its text
                    # is not decoded twice (transformers' decode: ~0.1 ms a row, ~3 ms of a ~180 ms batch-32 int8 call).
                    hypotheses=[Hypothesis(text if h == ids else self.tokenizer.decode(h), h, score)
                                for h, score in r.hypotheses],
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
