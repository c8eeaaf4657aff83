"""`--int8-keep auto|N|none`: which int8 nodes stay in fp32, from their measured sensitivity.

- none: every MatMul and embedding int8 (the graph int8 always had).
- N: the N most sensitive nodes (`int8_sensitivity.measure`'s ranking) stay in fp32.
- auto: the smallest prefix of the ranking whose int8 graph gives fp32's greedy output on at least
  AUTO_TARGET of the calibration sentences (a sentence counts when teacher forcing fp32's output
  flips no argmax, which is exactly "its raw greedy output is fp32's"), without keeping more fp32
  MatMul weights than AUTO_MAX_FP32_SHARE of the quantized ones; the speed rule is a weight budget
  because at batch 1 a step's time follows the weight bytes it reads, and a budget is the same on
  every run where a timing at export would be noise on a shared machine. Embedding Gathers read one
  row per token and cost no speed, so they do not count against it. When no prefix within the
  budget reaches the target, auto keeps the largest prefix that fits and the sidecar says the
  target was not reached.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from . import int8_sensitivity

CHOICES = "auto, none, or a count N >= 0"
CALIBRATION_SENTENCES = 64
AUTO_TARGET = 0.95
AUTO_MAX_FP32_SHARE = 0.30


def parse_keep(value: str | int) -> str | int:
    """'auto', 'none' or a count; ValueError naming the choices otherwise."""
    text = str(value).strip().lower()
    if text in ("auto", "none"):
        return text
    if text.isdigit():
        return int(text)
    raise ValueError(f"--int8-keep {value!r}: expected one of: {CHOICES}")


def calibration(tokenizer, config, generation: dict, sentences: list[str]) -> int8_sensitivity.Calibration:
    """The calibration batch: `sentences` tokenized by the source's (HF) tokenizer, padded."""
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=config.max_position_embeddings,
                      return_tensors="np")
    special = {"decoder_start": config.decoder_start_token_id, "eos": config.eos_token_id, "pad": config.pad_token_id}
    return int8_sensitivity.calibration(batch["input_ids"], batch["attention_mask"], special, generation)


def _prefixes(ranking: list[int8_sensitivity.Sensitivity], budget: float) -> list[int]:
    """Counts worth trying for auto, in order: every prefix length within the weight budget at which
    a MatMul joins (a Gather alone changes no speed, so it rides along with the next count)."""
    counts, weights = [], 0
    for n, s in enumerate(ranking, start=1):
        if s.item.op == "MatMul":
            weights += s.item.parameters
        if weights > budget:
            break
        counts.append(n)
    return counts


def choose(folder: Path, shape: dict, calib: int8_sensitivity.Calibration, keep: str | int,
           threads: int | None = 1, log=print) -> dict:
    """The sidecar's int8 choice: {"option", "kept": [...], "sensitivity": {...}, "rule"}; empty `kept`
    for none (nothing is measured)."""
    keep = parse_keep(keep)
    if keep == "none" or keep == 0:
        return {"option": str(keep), "kept": [], "sensitivity": None,
                "rule": "none: every MatMul and embedding in int8" if keep == "none" else "N = 0 asked"}
    measured = int8_sensitivity.measure(folder, shape, calib, threads=threads, log=log)
    ranking = measured["ranking"]
    sentences = measured["sentences"]
    section = {"method": "leave one out, teacher-forced on fp32's greedy output (export/int8_sensitivity.py)",
               "sentences": sentences, "positions": measured["positions"], "all_int8": measured["baseline"],
               "seconds": measured["seconds"], "ranking": [s.record() for s in ranking]}
    if keep == "auto":
        total = sum(s.item.parameters for s in ranking if s.item.op == "MatMul")
        need = AUTO_TARGET * sentences
        chosen, reached, tried = 0, measured["baseline"]["identical_sentences"] >= need, []
        if not reached:
            with tempfile.TemporaryDirectory(prefix="int8-auto-", dir=folder) as tmp:
                for n in _prefixes(ranking, AUTO_MAX_FP32_SHARE * total):
                    score = int8_sensitivity.score_kept(folder, Path(tmp), shape, calib, ranking[:n], threads)
                    tried.append({"kept": n, **score})
                    log(f"  int8 auto: {n} kept in fp32 -> {score['identical_sentences']}/{sentences} calibration "
                        "sentences identical", flush=True)
                    chosen = n
                    if score["identical_sentences"] >= need:
                        reached = True
                        break
        rule = (f"auto: the fewest most-sensitive nodes giving fp32's greedy output on >= {AUTO_TARGET:.0%} of "
                f"{sentences} calibration sentences, fp32 MatMul weights <= {AUTO_MAX_FP32_SHARE:.0%} of the "
                f"quantized ones; target {'reached' if reached else 'NOT reached within the budget'}")
        section["auto_tried"] = tried
    else:
        chosen = min(keep, len(ranking))
        rule = f"N = {keep}: the {chosen} most sensitive nodes" + ("" if chosen == keep else " (all there are)")
    why = ("among the {n} most sensitive of {total} by margin error removed on the calibration text"
           .format(n=chosen, total=len(ranking)))
    kept = [{**s.record(), "why": why} for s in ranking[:chosen]]
    return {"option": str(keep), "kept": kept, "sensitivity": section, "rule": rule}


def keep_sets(choice: dict) -> dict[str, set[str]]:
    """{"encoder": node names, "decoder": node names} to pass to quantize.quantize_int8."""
    return {g: {k["node"] for k in choice["kept"] if k["graph"] == g} for g in ("encoder", "decoder")}

