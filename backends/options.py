"""One call's decoding options: a frozen dataclass, defaults filled in and validated once."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .generation import GenerationDefaults

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
