"""fp16's overflow guard: the nodes of an fp16 graph that must compute in fp32, chosen by measurement.

fp16's largest finite number is 65504. A trained model's feed-forward output, residual sum or
squared value can pass it on ordinary text, and the fp16 graph then computes Inf, NaN, or finite
but wrong text with no NaN at all. So the fp32 graphs run first on calibration text (`ranges`),
and every node that reads or writes a value within `margin` times of that limit stays fp32:
a value too large for fp16 is then made, carried and reduced in fp32, and the converter's casts
only ever meet values fp16 can hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .ranges import Calibration, Ranges, measure

FP16_MAX = 65504.0
DEFAULT_MARGIN = 8.0
MODES = ("auto", "none", "OP,OP,...")

# Inputs unlike the verification sentences, where activations peak on real models: a long
# paragraph, numbers and symbols, shouting, mixed scripts, emoji, and repetition.
EXTRA_TEXT = (
    "!!! ??? ... --- *** ((( ))) ;;; ###",
    "1234567890 3.14159 2026-12-04 $1,000,000.00 99.9% +86 10-1234-5678 0x7FFF",
    "HTTP://WWW.EXAMPLE.COM/PATH/TO/PAGE?QUERY=VALUE&X=1 user.name@example.com",
    "THIS SENTENCE IS WRITTEN ENTIRELY IN CAPITAL LETTERS ABOUT THE WEATHER TOMORROW.",
    "我们 will meet at 3pm 在北京 tomorrow, OK? 好的，明天见。",
    "I love it 😀👍🎉 so much!!! ❤️❤️❤️",
    " ".join(["the"] * 80),
    "Buffalo buffalo Buffalo buffalo buffalo buffalo Buffalo buffalo.",
    " ".join("abcdefghijklmnopqrstuvwxyz") + " " + " ".join("ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
)
LONG_PARAGRAPH_SENTENCES = 40  # joined into one source, cut at the model's source limit


@dataclass(frozen=True)
class Fp16Keep:
    """What stays fp32 in the fp16 graphs: "auto" (measured: nodes within `margin` of fp16's range),
    "none" (only the converter's own block list) or op types ("LayerNormalization,Pow")."""

    mode: str = "auto"
    ops: tuple[str, ...] = ()
    margin: float = DEFAULT_MARGIN

    def __post_init__(self):
        if self.mode not in ("auto", "none", "ops"):
            raise ValueError(f"fp16 keep mode {self.mode!r}; expected one of: {', '.join(MODES)}")
        if (self.mode == "ops") != bool(self.ops):
            raise ValueError("op types are given with mode 'ops' and only with it")
        if not self.margin >= 1.0:
            raise ValueError(f"the fp16 margin is a factor >= 1, got {self.margin}")

    @classmethod
    def parse(cls, text: str) -> Fp16Keep:
        """`--fp16-keep auto|none|OP,OP`: op types are ONNX names, a capital first (MatMul, Pow, Add)."""
        text = (text or "").strip()
        if text in ("auto", "none"):
            return cls(text)
        import onnx

        ops = tuple(dict.fromkeys(op.strip() for op in text.split(",") if op.strip()))
        bad = [op for op in ops if not onnx.defs.has(op)]
        if not ops or bad:
            raise ValueError(f"--fp16-keep {text!r}: expected one of: {', '.join(MODES)} (op types are ONNX "
                             f"operator names such as LayerNormalization,Pow; not one: {', '.join(bad) or 'none given'})")
        return cls("ops", ops)

    @property
    def threshold(self) -> float:
        return FP16_MAX / self.margin

    def describe(self) -> str:
        return {"auto": f"auto: nodes reading or writing |values| >= {self.threshold:.0f} (fp16's 65504 / {self.margin:g})",
                "none": "none: the converter's default block list only"}.get(self.mode, f"op types: {', '.join(self.ops)}")


def calibration_text(sentences: list[str]) -> list[str]:
    """The verification sentences, one long paragraph of them, and EXTRA_TEXT."""
    return [*sentences, " ".join(sentences[:LONG_PARAGRAPH_SENTENCES]), *EXTRA_TEXT]


def _largest(ranges: Ranges) -> dict | None:
    finite = {v: m for v, m in ranges.max_abs.items() if m == m}
    if not finite:
        return None
    value = max(finite, key=finite.get)
    return {**ranges.node_of(value), "max_abs": finite[value]}


def nodes_to_keep(model_path: Path, ranges: Ranges, threshold: float) -> list[dict]:
    """Every node with a float input or output whose largest |value| reached `threshold` (or was not
    finite), in graph order, with what it read and wrote."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    seen = ranges.max_abs
    kept = []
    for node in model.graph.node:
        read = [seen[i] for i in node.input if i in seen]
        wrote = [seen[o] for o in node.output if o in seen]
        top_in, top_out = max(read, default=0.0), max(wrote, default=0.0)
        if not (top_in < threshold and top_out < threshold):  # NaN counts as reached
            if not node.name:
                raise ValueError(f"{model_path.name}: an unnamed {node.op_type} node must stay fp32; the converter "
                                 "blocks nodes by name")
            kept.append({"node": node.name, "op": node.op_type, "module": ranges.producer.get(
                node.output[0], ("", "", None))[2], "max_abs_in": top_in, "max_abs_out": top_out})
    return kept


def plan(encoder: Path, decoder: Path, keep: Fp16Keep, calibration: Calibration | None, threads: int | None) -> dict:
    """{"encoder": [node names], "decoder": [...], "record": the sidecar's account} for `keep`."""
    record = {"mode": keep.mode, "rule": keep.describe()}
    if keep.mode != "auto":
        return {"encoder": [], "decoder": [], "ops": list(keep.ops), "record": record}
    if calibration is None:
        raise ValueError("--fp16-keep auto measures the fp32 graphs on calibration text; none was given")
    measured = measure(encoder, decoder, calibration, threads)
    plan_ = {"ops": [], "record": {**record, "margin": keep.margin, "threshold": keep.threshold,
                                   "calibration": {"sentences": calibration.sentences,
                                                   "max_new_tokens": calibration.max_new_tokens,
                                                   "text": "the verification sentences, a paragraph of them, and "
                                                           f"{len(EXTRA_TEXT)} odd, long and repetitive inputs"},
                                   "largest": {}, "kept": {}}}
    for name, path in (("encoder", encoder), ("decoder", decoder)):
        ranges = measured[name]
        if ranges.first_nonfinite is not None:
            where = ranges.first_nonfinite
            raise ValueError(f"the fp32 {name} graph itself computes {where['what']} at node {where['node']} "
                             f"({where['op']}, module {where['module']}) on the calibration text: fp16 cannot fix that")
        kept = nodes_to_keep(path, ranges, keep.threshold)
        plan_[name] = [k["node"] for k in kept]
        plan_["record"]["kept"][name] = kept
        plan_["record"]["largest"][name] = _largest(ranges)
    return plan_
