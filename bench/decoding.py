"""The search every runtime of a speed run performs, and how each worker is told.

`resolve_decoding` turns the command line (or the export's generation config) into the
"decoding" record of results.json; `decode_args` passes it to our workers and the peers'.
"""

from __future__ import annotations

import math

SWEEP_IS_GREEDY = (
    "the output-length sweep measures the per-step cost of greedy search at batch 1; it is not run with "
    "num_beams {n} (run `python -m bench speed --sweep ...` without --num-beams for it)"
)


def resolve_decoding(manifest, num_beams: int | str = 1, length_penalty: float | None = None,
                     early_stopping: bool | str | None = None) -> dict:
    """The search every runtime runs, as results.json records it under "decoding".

    num_beams: 1 (greedy), 2..MAX_BEAMS (beam search), or "model": the export's generation config.
    length_penalty / early_stopping: beam search only; None leaves the export's generation config
    to decide (our backends and transformers/Optimum read the same config), and the effective
    value is recorded. Raises ValueError naming the valid range.
    """
    from backends import MAX_BEAMS

    g = manifest.generation
    from_model = num_beams == "model"
    beams = g.num_beams if from_model else num_beams
    if isinstance(beams, bool) or not isinstance(beams, int) or not 1 <= beams <= MAX_BEAMS:
        raise ValueError(f"num_beams must be an integer in 1..{MAX_BEAMS} (1: greedy search) or 'model', got {num_beams!r}")
    given = {k: v for k, v in (("length_penalty", length_penalty), ("early_stopping", early_stopping)) if v is not None}
    if length_penalty is not None and not math.isfinite(length_penalty):
        raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
    if early_stopping is not None and early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be one of: true, false, never; got {early_stopping!r}")
    source = "the export's generation config (--num-beams model)" if from_model else "the command line"
    # The model's repetition control applies to every search; recorded so CTranslate2, which reads
    # no generation config, can be given the same.
    rules = {"repetition_penalty": float(g.repetition_penalty), "no_repeat_ngram_size": int(g.no_repeat_ngram_size)}
    if beams == 1:
        if given:
            raise ValueError(f"{' and '.join(given)}: beam search only, and num_beams is 1 (from {source})")
        return {"search": "greedy", "num_beams": 1, "label": "greedy", "num_beams_from": source, **rules}
    return {
        **rules,
        "search": "beam", "num_beams": beams, "label": f"beam {beams}", "num_beams_from": source,
        "length_penalty": float(g.length_penalty if length_penalty is None else length_penalty),
        "early_stopping": g.early_stopping if early_stopping is None else early_stopping,
        "given": given,  # the rest are the export's generation config
    }


def decode_args(decoding: dict, ct2: bool = False) -> list[str]:
    """The worker's command-line options for `decoding`. Only what the user gave is passed on, so the
    export's (and the peer's model folder's) generation config decides the rest; CTranslate2 reads no
    generation config, so it always gets the effective length_penalty in beam search."""
    args = ["--num-beams", str(decoding["num_beams"])]
    if ct2:  # CTranslate2 reads no generation config: the model's repetition control, given explicitly
        if decoding.get("repetition_penalty", 1.0) != 1.0:
            args += ["--repetition-penalty", repr(decoding["repetition_penalty"])]
        if decoding.get("no_repeat_ngram_size"):
            args += ["--no-repeat-ngram-size", str(decoding["no_repeat_ngram_size"])]
    if decoding["search"] == "greedy":
        return args
    given = decoding["given"]
    if "length_penalty" in given or ct2:
        args += ["--length-penalty", repr(decoding["length_penalty"])]
    if "early_stopping" in given and not ct2:  # CTranslate2 has no early_stopping (its patience stays 1)
        args += ["--early-stopping", str(decoding["early_stopping"]).lower()]
    return args
