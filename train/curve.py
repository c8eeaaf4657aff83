"""The learning curve of a run: `python -m train.curve RUN_DIR` scores every checkpoint snapshot
(RUN_DIR/snapshots/*.pt, written by the training loop) on all of dev.tsv with greedy decoding and
writes RUN_DIR/curve.json; snapshots already scored there are skipped, so it can run after each
invocation of a long training. The selection history only scores a 100-row subset.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

from corpus import DEV_TSV

logger = logging.getLogger(__name__)


def load_snapshot(path: Path) -> tuple[int | None, dict]:
    """(step, model state) from a snapshot (a bare state dict) or a full training checkpoint."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    if "model" in state and "step" in state:
        return state["step"], state["model"]
    match = re.search(r"step-(\d+)", path.name)
    return (int(match.group(1)) if match else None), state


def score_run(run_dir: Path, dev: Path = DEV_TSV, threads: int = 1, only: set[int] | None = None) -> list[dict]:
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    from corpus import read_pairs

    from .evaluate import REPEAT_RUN, evaluate_model

    torch.set_num_threads(threads)
    out = run_dir / "curve.json"
    rows = json.loads(out.read_text(encoding="utf-8")) if out.exists() else []
    done = {r["step"] for r in rows}
    history = {}
    summary = run_dir / "summary.json"
    if summary.exists():
        history = {h["step"]: h for h in json.loads(summary.read_text())["selection"]["history"]}
    tok = MarianTokenizer.from_pretrained(str(run_dir / "tokenizer"))
    model = MarianMTModel(MarianConfig.from_json_file(str(run_dir / "config.json")))
    pairs = read_pairs(dev, require_zh=True)
    key = f"repeat{REPEAT_RUN}_share"
    for path in sorted((run_dir / "snapshots").glob("*.pt")):
        step, state = load_snapshot(path)
        if step is None or step in done or (only is not None and step not in only):
            continue
        model.load_state_dict(state)
        r = evaluate_model(model, tok, pairs)
        row = {"step": step, "minutes": history.get(step, {}).get("minutes"),
               "bleu": r["whole"]["bleu"], "chrf": r["whole"]["chrf"], "tatoeba_bleu": r["tatoeba"]["bleu"],
               "docs_bleu": r["docs"]["bleu"], key: r["whole"][key]}
        logger.info("%s: %s", path.name, row)
        rows.append(row)
        done.add(step)
        rows.sort(key=lambda x: x["step"])
        out.write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return rows


def curve_table(rows: list[dict]) -> str:
    lines = ["| step | train min | BLEU | chrF | Tatoeba BLEU | docs BLEU | 4+ runs |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        minutes = "" if r.get("minutes") is None else f"{r['minutes']:.0f}"
        lines.append(f"| {r['step']} | {minutes} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['tatoeba_bleu']:.2f} | "
                     f"{r['docs_bleu']:.2f} | {100 * r['repeat4_share']:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.curve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--dev", type=Path, default=DEV_TSV)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, nargs="+", default=None, help="score only these snapshots' steps")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import transformers

    transformers.logging.set_verbosity_error()
    only = set(args.steps) if args.steps else None
    print(curve_table(score_run(args.run_dir, args.dev, args.threads, only)))


if __name__ == "__main__":
    main()
