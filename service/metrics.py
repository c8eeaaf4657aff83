"""Agreement with the reference backend and translation quality (BLEU, chrF), for every report that compares."""

from __future__ import annotations

from collections import Counter

from backends.divergence import first_divergence

BUCKETS = ((0, 0), (1, 4), (5, 9), (10, 19), (20, None))


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
