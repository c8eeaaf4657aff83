"""The Backend façade: a tokenizer, an engine (`StepModel`) and the export's sidecar behind
`translate` and `score`, which share the one decoding loop (`decoding.py`)."""

from __future__ import annotations

import time
from typing import Any

from .base import StepModel
from .decoding import decode, forced_scores
from .generation import SpecialTokens
from .manifest import Manifest
from .options import DecodeOptions
from .results import ForcedScores, Hypothesis, Translation
from .tokenizer import TokenizerWrapper


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
                    # The best hypothesis is the translation itself (greedy search's only one): its
                    # text is not decoded twice, detokenizing being a visible share of a batch call.
                    hypotheses=[Hypothesis(text if h == ids else self.tokenizer.decode(h), h, score)
                                for h, score in r.hypotheses],
                )
            )
        return translations

    def score(self, text: str, target_ids: list[int], top_k: int = 5) -> ForcedScores:
        """Teacher-forced: score `target_ids` (e.g. the reference backend's output) for `text`."""
        batch = self.tokenizer.encode([text], self.manifest.max_source_tokens)
        return forced_scores(self.model, batch.input_ids, batch.attention_mask, self.special, target_ids, top_k)

    def close(self) -> None:
        """Release the engine's memory (sessions, weights)."""
        self.model = None

    def __repr__(self) -> str:
        return f"<Backend {self.name} {self.info}>"
