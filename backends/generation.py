"""The model's generation policy: its special ids and the decoding defaults and fixed rules that
the export records from its generation config (the sidecar's "special_tokens" and "generation").

`generate()` reads the same config, so a backend that follows this policy decodes as generate()
does for that model. Writing the "generation" section (and refusing what the loop does not
implement) is `manifest.generation_section`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# transformers 5.24 `GenerationConfig._get_default_generation_params()`: what an unset field means
# (tests/test_beam.py checks this copy against the installed transformers).
GENERATE_DEFAULTS: dict[str, Any] = {
    "max_length": 20, "min_length": 0, "do_sample": False, "use_cache": True, "early_stopping": False,
    "num_beams": 1, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "typical_p": 1.0,
    "repetition_penalty": 1.0, "length_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "num_return_sequences": 1,
    "output_scores": False, "return_dict_in_generate": False, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "remove_invalid_values": False, "exponential_decay_length_penalty": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "encoder_repetition_penalty": 1.0, "num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4, "assistant_lookbehind": 10, "target_lookbehind": 10,
    "num_beam_groups": 1, "diversity_penalty": 0.0,
}
# Implemented by the token decoders and the logits processors, and recorded in the sidecar.
SUPPORTED_GENERATION = (
    "num_beams", "length_penalty", "early_stopping", "max_length", "max_new_tokens", "min_length",
    "min_new_tokens", "bad_words_ids", "forced_bos_token_id", "forced_eos_token_id", "no_repeat_ngram_size",
    "repetition_penalty", "num_return_sequences", "renormalize_logits",
)


class UnsupportedGeneration(ValueError):
    """The model's generation config asks for decoding the backends do not implement."""


@dataclass(frozen=True)
class SpecialTokens:
    pad: int
    eos: int
    unk: int
    decoder_start: int
    bad_words_ids: tuple[int, ...]  # single-token bad words only; masked at every step

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> "SpecialTokens":
        """The sidecar's "special_tokens" section."""
        return cls(
            pad=section["pad"],
            eos=section["eos"],
            unk=section["unk"],
            decoder_start=section["decoder_start"],
            bad_words_ids=tuple(ids[0] for ids in section["bad_words_ids"] if len(ids) == 1),
        )


@dataclass(frozen=True)
class GenerationDefaults:
    """The sidecar's "generation" section: decoding defaults and the model's fixed rules."""

    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    max_new_tokens: int | None = None  # None: the position limit (`limits.max_new_tokens`)
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0
    num_return_sequences: int = 1
    # The model's rules, applied on every call (not per-call options):
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # as generate() masks them (a lone eos is never banned)
    forced_bos_token_id: int | None = None  # the first generated token
    forced_eos_token_id: int | None = None  # the last token at the length cap (beam search; see processors.py)
    renormalize_logits: bool = False  # log-softmax again after the processors

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> "GenerationDefaults":
        fields = {k: section[k] for k in cls.__dataclass_fields__ if k in section}
        fields["bad_words_ids"] = tuple(tuple(ids) for ids in fields.get("bad_words_ids") or ())
        return cls(**fields)
