"""Parity of every exported graph against the PyTorch model it came from.

Three levels, as in minGPT's HF import test: logits (max |Δ| per graph, on several source
lengths, one >= 400 tokens, and a padded batch mixing short and long rows, padding masked before
comparing), then greedy token ids through the real backends, then decoded text. fp32 graphs must
pass; fp16 numbers are reported, not required. Failures are collected and reported together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends import APPROXIMATE

FP32_LOGITS_TOLERANCE = 1e-4
APPROXIMATE_SUFFIXES = ("_fp16", "_int8")  # reported, not required to match
FALLBACK_SENTENCES = [
    "Click OK to save the document.",
    "My father works in a factory.",
    "Select the cells that you want to format, and then choose Format - Cells.",
    "The file could not be opened because it is already in use by another program.",
    "I would like to learn Chinese next year.",
    "Press the Delete key to remove the selected object.",
    "Where is the nearest train station?",
    "This option specifies the number of decimal places shown for each value.",
]


def read_dev_sentences(corpus: Path | None, count: int) -> list[str]:
    path = corpus / "dev.tsv" if corpus else None
    if path is None or not path.is_file():
        return (FALLBACK_SENTENCES * (count // len(FALLBACK_SENTENCES) + 1))[:count]
    rows = []
    with path.open(encoding="utf-8") as f:
        next(f)
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if len(fields) == 3:
                rows.append(fields[1])
    return rows[:count]


@dataclass
class Case:
    name: str
    input_ids: np.ndarray  # (b, s)
    attention_mask: np.ndarray  # (b, s)
    decoder_ids: np.ndarray  # (b, t), decoder start first


def build_cases(tokenizer, sentences: list[str], config, decoder_len: int = 12) -> list[Case]:
    """Single rows of three source lengths (short, ~64, >= 400 tokens) and a padded batch."""
    eos, pad = tokenizer.eos_token_id, config.pad_token_id
    limit = config.max_position_embeddings
    stream = []
    for s in sentences * 50:
        stream += tokenizer(s).input_ids[:-1]
        if len(stream) > limit:
            break

    def row(n: int) -> list[int]:
        return stream[: n - 1] + [eos]

    short = tokenizer(sentences[0]).input_ids
    long_len = min(limit, 450)
    rng = np.random.default_rng(0)

    def make(name, rows):
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), pad, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        # Decoder prefixes from real vocabulary ids (never pad), the start token first.
        dec = rng.integers(0, config.vocab_size - 1, size=(len(rows), decoder_len), dtype=np.int64)
        dec[:, 0] = config.decoder_start_token_id
        return Case(name, ids, mask, dec)

    return [
        make(f"source {len(short)} tokens", [short]),
        make("source 64 tokens", [row(64)]),
        make(f"source {long_len} tokens", [row(long_len)]),
        make(f"padded batch of 3 (sources {len(short)}, 300, 64)", [short, row(300), row(64)]),
    ]


def _torch_reference(model, case: Case) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(case.input_ids),
            attention_mask=torch.from_numpy(case.attention_mask),
            decoder_input_ids=torch.from_numpy(case.decoder_ids),
            use_cache=False,
            return_dict=True,
        )
    return out.logits.numpy(), out.encoder_last_hidden_state.numpy()


def _kv_logits(encoder, decoder, case: Case) -> tuple[np.ndarray, np.ndarray]:
    enc_out = encoder.run(None, {"input_ids": case.input_ids, "attention_mask": case.attention_mask})
    hidden, cross = enc_out[0], enc_out[1:]
    cross_names = [o.name for o in encoder.get_outputs()][1:]
    past_inputs = [i for i in decoder.get_inputs() if i.name.startswith("past.")]
    b = case.input_ids.shape[0]
    heads, head_dim = cross[0].shape[1], cross[0].shape[3]
    past = [np.zeros((b, heads, 0, head_dim), np.float32) for _ in past_inputs]
    steps = []
    for t in range(case.decoder_ids.shape[1]):
        feeds = {"input_ids": case.decoder_ids[:, t : t + 1], "encoder_attention_mask": case.attention_mask}
        feeds.update(zip(cross_names, cross))
        feeds.update(zip((i.name for i in past_inputs), past))
        logits, *past = decoder.run(None, feeds)
        steps.append(logits[:, 0, :])
    return np.stack(steps, axis=1), hidden  # (b, t, V), (b, s, D)


def _masked_max_abs(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None = None) -> float:
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    if mask is not None:  # (b, s) -> ignore padded source positions
        diff = diff[mask.astype(bool)]
    return float(diff.max())


def logits_parity(model, tokenizer, export_dir: Path, manifest_graphs: dict, sentences, threads) -> dict:
    from backends.ort_session import SessionConfig, create_session

    config = model.config
    session = SessionConfig(threads=threads, provider="cpu")
    sessions = {name: create_session(export_dir / g["file"], session) for name, g in manifest_graphs.items()}
    cases = build_cases(tokenizer, sentences, config)
    results = []
    for case in cases:
        ref_logits, ref_hidden = _torch_reference(model, case)
        entry = {
            "case": case.name,
            "batch": int(case.input_ids.shape[0]),
            "source_lengths": [int(n) for n in case.attention_mask.sum(axis=1)],
            "decoder_steps": int(case.decoder_ids.shape[1]),
            "max_abs_logit_diff": {},
            "max_abs_encoder_hidden_diff": {},
            "argmax_agreement": {},
        }
        (full,) = sessions["full"].run(
            ["logits"],
            {"input_ids": case.input_ids, "attention_mask": case.attention_mask, "decoder_input_ids": case.decoder_ids},
        )
        candidates = {"full": (full, None)}
        for suffix in ("", *APPROXIMATE_SUFFIXES):
            logits, hidden = _kv_logits(sessions["encoder" + suffix], sessions["decoder" + suffix], case)
            candidates["kv_cache" + suffix] = (logits, hidden)
        for name, (logits, hidden) in candidates.items():
            entry["max_abs_logit_diff"][name] = _masked_max_abs(logits, ref_logits)
            entry["argmax_agreement"][name] = float((logits.argmax(-1) == ref_logits.argmax(-1)).mean())
            if hidden is not None:
                entry["max_abs_encoder_hidden_diff"][name] = _masked_max_abs(hidden, ref_hidden, case.attention_mask)
        results.append(entry)
    return {"cases": results}


def greedy_parity(export_dir: Path, sentences: list[str], max_new_tokens: int, threads) -> dict:
    """Greedy ids and text through the real backends, the reference being the PyTorch one."""
    from backends import SessionConfig, load_backends

    backends = load_backends(export_dir, session=SessionConfig(threads=threads, provider="cpu"))
    outputs = {name: b.translate(sentences, max_new_tokens=max_new_tokens) for name, b in backends.items()}
    ref = outputs.pop("pytorch")
    report = {"sentences": len(sentences), "max_new_tokens": max_new_tokens, "backends": {}}
    for name, outs in outputs.items():
        same_ids = [o.token_ids == r.token_ids for o, r in zip(outs, ref)]
        same_text = [o.text == r.text for o, r in zip(outs, ref)]
        tokens = sum(len(r.token_ids) for r in ref)
        agreeing = sum(
            sum(a == b for a, b in zip(o.token_ids, r.token_ids)) for o, r in zip(outs, ref)
        )
        report["backends"][name] = {
            "identical_ids": sum(same_ids),
            "identical_text": sum(same_text),
            "token_agreement": agreeing / max(tokens, 1),
            "first_mismatch": next(
                (
                    {"sentence": sentences[i], "reference": ref[i].token_ids, "backend": outs[i].token_ids}
                    for i, ok in enumerate(same_ids)
                    if not ok
                ),
                None,
            ),
        }
    for b in backends.values():
        b.close()
    return report


def judge(logits: dict, greedy: dict | None) -> list[str]:
    """Every fp32 failure, with its numbers; an empty list means the export passes."""
    failures = []
    for case in logits["cases"]:
        for name, diff in case["max_abs_logit_diff"].items():
            if not name.endswith(APPROXIMATE_SUFFIXES) and not diff <= FP32_LOGITS_TOLERANCE:
                failures.append(f"{name}, {case['case']}: max |Δlogit| {diff:.3g} > {FP32_LOGITS_TOLERANCE:g}")
    if greedy is not None:
        for name, r in greedy["backends"].items():
            if name not in APPROXIMATE and r["identical_ids"] != greedy["sentences"]:
                failures.append(
                    f"{name}: greedy ids identical on {r['identical_ids']}/{greedy['sentences']} sentences; "
                    f"first mismatch {r['first_mismatch']}"
                )
    return failures


def run(model, tokenizer, export_dir: Path, graphs: dict, sentences, greedy_sentences, max_new_tokens, threads):
    start = time.perf_counter()
    logits = logits_parity(model, tokenizer, export_dir, graphs, sentences, threads)
    logits_s = time.perf_counter() - start
    greedy = greedy_parity(export_dir, greedy_sentences, max_new_tokens, threads)
    failures = judge(logits, greedy)
    approximate = {
        backend: {
            "max_abs_logit_diff": max(c["max_abs_logit_diff"]["kv_cache" + suffix] for c in logits["cases"]),
            "argmax_agreement_min": min(c["argmax_agreement"]["kv_cache" + suffix] for c in logits["cases"]),
            "greedy": greedy["backends"][backend],
        }
        for backend, suffix in zip(APPROXIMATE, APPROXIMATE_SUFFIXES)
    }
    return {
        "fp32_tolerance": FP32_LOGITS_TOLERANCE,
        "fp32_passed": not failures,
        "failures": failures,
        "fp32_max_abs_logit_diff": max(
            d for c in logits["cases"] for n, d in c["max_abs_logit_diff"].items() if not n.endswith(APPROXIMATE_SUFFIXES)
        ),
        "fp16": approximate["ort_fp16"],
        "int8": approximate["ort_int8"],
        "logits": logits["cases"],
        "greedy": greedy,
        "seconds": {"logits": round(logits_s, 1), "total": round(time.perf_counter() - start, 1)},
    }
