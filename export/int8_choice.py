"""`--int8-keep auto|N|none`: which int8 nodes stay in fp32, from their measured sensitivity.

- none: every MatMul and embedding int8 (the graph int8 always had).
- N: the N most sensitive nodes (`int8_sensitivity.measure`'s ranking) stay in fp32.
- N+rescore: the N most sensitive nodes other than the output layer stay in fp32, and the output
  layer's K best logits are recomputed in fp32 (`int8_rescore.py`): the curve's "N + re-score" rows.
- auto: sensitivity per unit of per-token cost. A decoding step reads the decoder graph's weights
  once per generated token; the encoder graph (cross-attention K/V projections included) runs once
  per sentence and an embedding Gather reads one row per token, so keeping those in fp32 costs
  little per token, and auto keeps every one of them that measurably helps (margin error removed
  > 0). The output layer, the largest per-step weight, is not kept but re-scored: its K best
  logits recomputed in fp32 (`int8_rescore.py`). Then decoder-step MatMuls join in ranking order
  while the calibration sentences whose greedy output is fp32's (no argmax flipped under teacher
  forcing, which is exactly "its raw greedy output is fp32's") stay under AUTO_TARGET, within
  AUTO_STEP_BUDGET of the decoder-step MatMul weights (fp32 reads four bytes where int8 reads
  one; a budget stays the same on every run, where a timing taken during an export would be noise
  on a shared machine). The sidecar says whether the target was reached.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import onnx

from families import shape_of

from . import int8_sensitivity
from .int8_rescore import DEFAULT_TOP, output_layer

CHOICES = "auto, none, a count N >= 0, or N+rescore"
CALIBRATION_SENTENCES = 64
AUTO_TARGET = 0.95
AUTO_STEP_BUDGET = 0.20


def parse_keep(value: str | int) -> str | int:
    """'auto', 'none' or a count; ValueError naming the choices otherwise."""
    text = str(value).strip().lower()
    if text in ("auto", "none"):
        return text
    if text.isdigit():
        return int(text)
    if match := re.fullmatch(r"(\d+)\s*\+\s*rescore", text):
        return f"{int(match[1])}+rescore"
    raise ValueError(f"--int8-keep {value!r}: expected one of: {CHOICES}")


def calibration(tokenizer, config, generation: dict, sentences: list[str]) -> int8_sensitivity.Calibration:
    """The calibration batch: `sentences` tokenized by the source's (HF) tokenizer, padded."""
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=shape_of(config)["max_position_embeddings"],
                      return_tensors="np")
    special = {"decoder_start": config.decoder_start_token_id, "eos": config.eos_token_id, "pad": config.pad_token_id}
    return int8_sensitivity.calibration(batch["input_ids"], batch["attention_mask"], special, generation)


def per_step(s: int8_sensitivity.Sensitivity) -> bool:
    """Whether int8 -> fp32 for this node costs weight reads at every decoding step."""
    return s.item.graph == "decoder" and s.item.op == "MatMul"


def _is_output_layer(folder: Path, ranking: list) -> list[bool]:
    head = output_layer(onnx.load(str(folder / "decoder.onnx"), load_external_data=False)).name
    return [s.item.graph == "decoder" and s.item.node == head for s in ranking]


def _auto(folder: Path, shape: dict, calib, measured: dict, threads, log) -> tuple[list, int, dict]:
    ranking, sentences = measured["ranking"], measured["sentences"]
    is_head = _is_output_layer(folder, ranking)
    rescore = DEFAULT_TOP if any(h and s.margin_error_removed > 0 for s, h in zip(ranking, is_head)) else 0
    kept = [s for s, h in zip(ranking, is_head) if not h and not per_step(s) and s.margin_error_removed > 0]
    steps = [s for s, h in zip(ranking, is_head) if not h and per_step(s) and s.margin_error_removed > 0]
    budget = AUTO_STEP_BUDGET * sum(s.item.parameters for s in ranking if per_step(s))
    need = AUTO_TARGET * sentences
    tried = []
    with tempfile.TemporaryDirectory(prefix="int8-auto-") as tmp:
        def score(nodes):
            result = int8_sensitivity.score_kept(folder, Path(tmp), shape, calib, nodes, threads, rescore=rescore)
            tried.append({"kept": len(nodes), "per_step_kept": sum(map(per_step, nodes)), **result})
            log(f"  int8 auto: {len(nodes)} kept in fp32 ({sum(map(per_step, nodes))} per step), output layer "
                f"{'re-scored' if rescore else 'int8'} -> {result['identical_sentences']}/{sentences} calibration "
                "sentences identical", flush=True)
            return result["identical_sentences"] >= need

        reached = score(kept)
        spent = 0
        for s in steps:
            if reached or spent + s.item.parameters > budget:
                break
            spent += s.item.parameters
            kept = [*kept, s]
            reached = score(kept)
    rule = (f"auto: the once-per-sentence nodes (encoder graph, embeddings) that measurably help, the output layer "
            f"re-scored on its {rescore} best logits, then decoder-step MatMuls by sensitivity until fp32's greedy "
            f"output on >= {AUTO_TARGET:.0%} of {sentences} calibration sentences, within {AUTO_STEP_BUDGET:.0%} "
            f"of the decoder-step weights; target {'reached' if reached else 'NOT reached'}")
    return kept, rescore, {"rule": rule, "reached": reached, "tried": tried}


def choose(folder: Path, shape: dict, calib: int8_sensitivity.Calibration | None, keep: str | int,
           threads: int | None = 1, log=print) -> dict:
    """The sidecar's int8 choice: {"option", "rule", "kept": [...], "rescore": K or 0, "sensitivity"};
    for none and 0 nothing is measured (`calib` may be None)."""
    keep = parse_keep(keep)
    if keep == "none" or keep == 0:
        return {"option": str(keep), "kept": [], "rescore": 0, "sensitivity": None,
                "rule": "none: every MatMul and embedding in int8" if keep == "none" else "N = 0: nothing kept"}
    measured = int8_sensitivity.measure(folder, shape, calib, threads=threads, log=log)
    ranking = measured["ranking"]
    section = {"method": "leave one out, teacher-forced on fp32's greedy output (export/int8_sensitivity.py)",
               "sentences": measured["sentences"], "positions": measured["positions"],
               "all_int8": measured["baseline"], "seconds": measured["seconds"],
               "ranking": [s.record() for s in ranking]}
    if keep == "auto":
        chosen, rescore, outcome = _auto(Path(folder), shape, calib, measured, threads, log)
        section["auto"] = outcome
        rule = outcome["rule"]
    elif isinstance(keep, str):  # "N+rescore"
        count = int(keep.split("+")[0])
        chosen = [s for s, head in zip(ranking, _is_output_layer(Path(folder), ranking)) if not head][:count]
        rescore = DEFAULT_TOP
        rule = (f"N = {count} + re-score: the {len(chosen)} most sensitive nodes other than the output layer"
                f"{'' if len(chosen) == count else ' (all there are)'}, the output layer's {rescore} best logits "
                "re-scored in fp32")
    else:
        chosen, rescore = ranking[:keep], 0
        rule = f"N = {keep}: the {len(chosen)} most sensitive nodes"
        rule += "" if len(chosen) == keep else " (all there are)"
    position = {s.item.key: i + 1 for i, s in enumerate(ranking)}
    kept = [{**s.record(), "rank": position[s.item.key],
             "why": (f"rank {position[s.item.key]} of {len(ranking)} by margin error removed on the calibration text"
                     + ("" if per_step(s) else "; runs once per sentence or reads one row per token"))}
            for s in chosen]
    return {"option": str(keep), "rule": rule, "kept": kept, "rescore": rescore, "sensitivity": section}


def keep_sets(choice: dict) -> dict[str, set[str]]:
    """{"encoder": node names, "decoder": node names} to pass to quantize.quantize_int8."""
    return {g: {k["node"] for k in choice["kept"] if k["graph"] == g} for g in ("encoder", "decoder")}
