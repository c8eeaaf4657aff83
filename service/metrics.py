"""Agreement with the reference and translation quality, shared by the speed and quality reports."""

from __future__ import annotations

from collections import Counter

BUCKETS = ((0, 0), (1, 4), (5, 9), (10, 19), (20, None))


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first step whose token differs (a prefix diverges at the shorter length); None if equal."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def bucket_label(lo: int, hi: int | None) -> str:
    return f"{lo}" if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Share of identical token sequences, and where the others first diverge."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    steps = [first_divergence(o, r) for o, r in zip(outputs, reference)]
    diverged = [s for s in steps if s is not None]
    buckets = {bucket_label(lo, hi): sum(1 for s in diverged if s >= lo and (hi is None or s <= hi)) for lo, hi in BUCKETS}
    return {
        "n": len(steps),
        "identical": len(steps) - len(diverged),
        "identical_share": (len(steps) - len(diverged)) / len(steps) if steps else float("nan"),
        "first_divergence_steps": steps,
        "first_divergence_histogram": dict(sorted(Counter(diverged).items())),
        "first_divergence_buckets": buckets,
    }


def bleu_chrf(hypotheses: list[str], references: list[str]) -> dict:
    """Corpus BLEU (sacrebleu, tokenize="zh") and chrF of hypotheses against one reference each."""
    import sacrebleu

    bleu = sacrebleu.corpus_bleu(hypotheses, [references], tokenize="zh")
    chrf = sacrebleu.corpus_chrf(hypotheses, [references])
    return {"bleu": round(bleu.score, 2), "chrf": round(chrf.score, 2), "n": len(hypotheses)}
