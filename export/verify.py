"""Parity of every exported graph against the PyTorch model it came from.

Three levels, as in minGPT's HF import test: logits (max |Δ| per graph, on several source
lengths, one >= 400 tokens, and a padded batch mixing short and long rows, padding masked before
comparing), then greedy token ids through the real backends, then decoded text. fp32 graphs must
pass; fp16 and int8 numbers are reported, not required, but they must be finite: every value of a
low-precision graph is checked on calibration text, and the first node that computes NaN or Inf
fails the export by name. Failures are collected and reported together.

Nothing here runs a graph by hand: logits come from the backends' own step models (`encode`, then
one `step` per decoder position, as the decoding loop calls them), greedy ids from
`Backend.translate` (the one loop) through `backends.divergence.parity_report`.

Memory: one engine at a time. Each engine (and each backend) is loaded when its turn comes and
released before the next one loads, next to the PyTorch model and its reference logits: at the
larger families' sizes, every engine at once would not fit beside them. The fp32 and fp16 engines
load with `SessionConfig.low_memory` (no pre-packed copy of the weights, tables mapped from their
files, a KV pair's encoder and decoder open one after the other: every case is encoded before the
first step); int8 loads as the app loads it, since its unpacked kernels compute other numbers. The
report names the engines checked that way, and the peak resident memory of each phase (which
engine, which check), sampled as it runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends import APPROXIMATE, REFERENCE
from backends.base import StepModel
from backends.registry import BACKENDS
from corpus import DEV_TSV, read_sentences
from families import shape_of
from runtime.memory import PhasePeaks, release_freed_memory

FP32_LOGITS_TOLERANCE = 1e-4
# fp32 passes within the larger of the fixed tolerance and this many times PyTorch's own spread: the
# same sentence's logits alone and inside a padded batch, two equally valid fp32 evaluations. Large
# logits (hundreds, as a random 3B output layer gives) differ from themselves by more than 1e-4.
SPREAD_FACTOR = 2.0
# Each ORT engine's key in the logits report; the approximate ones are reported, not required to match.
ENGINES = {spec.logits_key: spec for spec in BACKENDS.values() if spec.engine is not None}
APPROXIMATE_KEYS = tuple(key for key, spec in ENGINES.items() if not spec.exact)


def read_dev_sentences(path: Path | None, count: int) -> list[str]:
    """The first `count` English sentences of `path` (default data/dev.tsv), cycled if it has fewer."""
    sentences = [p.en for p in read_sentences(path or DEV_TSV)]
    return (sentences * (count // len(sentences) + 1))[:count]


@dataclass
class Case:
    name: str
    input_ids: np.ndarray  # (b, s)
    attention_mask: np.ndarray  # (b, s)
    decoder_ids: np.ndarray  # (b, t), decoder start first


def build_cases(tokenizer, sentences: list[str], config, decoder_len: int = 12) -> list[Case]:
    """Single rows of three source lengths (short, ~64, >= 400 tokens) and a padded batch."""
    eos, pad = tokenizer.eos_token_id, config.pad_token_id
    limit = shape_of(config)["max_position_embeddings"]
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

    alone = make(f"source {len(short)} tokens", [short])
    batch = make(f"padded batch of 3 (sources {len(short)}, 300, 64)", [short, row(300), row(64)])
    batch.decoder_ids[0] = alone.decoder_ids[0]  # the same row twice: PyTorch's own spread (`pytorch_spread`)
    return [alone, make("source 64 tokens", [row(64)]), make(f"source {long_len} tokens", [row(long_len)]), batch]


def pytorch_spread(cases: list[Case], references: list) -> float:
    """max |Δlogit| between PyTorch's logits for the first case's row alone and the same row in the
    padded batch (`build_cases` gives them the same source and decoder ids): what fp32 rounding
    alone moves, the floor no other runtime can be asked to beat."""
    alone, batch = cases[0], cases[-1]
    n = alone.input_ids.shape[1]
    if not (np.array_equal(alone.decoder_ids[0], batch.decoder_ids[0])
            and np.array_equal(alone.input_ids[0], batch.input_ids[0, :n])):
        raise ValueError("the padded batch's first row must repeat the first case")
    (alone_logits, _), (batch_logits, _) = references[0], references[-1]  # (b, t, V) each
    return _masked_max_abs(alone_logits[0], batch_logits[0])


def fp32_tolerance(spread: float) -> float:
    return max(FP32_LOGITS_TOLERANCE, SPREAD_FACTOR * spread)


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


def _encoder_hidden(step_model, case: Case) -> np.ndarray:
    """The encoder graph's hidden states (b, s, D): its first output, which decoding never fetches."""
    feeds = {"input_ids": case.input_ids, "attention_mask": case.attention_mask}
    (hidden,) = step_model.open_graph("encoder").run(["encoder_hidden_states"], feeds)
    return hidden


def _stepped_logits(step_model: StepModel, state, decoder_ids: np.ndarray) -> np.ndarray:
    """Teacher-forced logits (b, t, V): one `step` per prefix of the decoder ids, from `state` as
    `encode` returned it."""
    logits = []
    for t in range(1, decoder_ids.shape[1] + 1):
        prefix = np.ascontiguousarray(decoder_ids[:, :t])  # (b, t), as the loop feeds it
        # A copy: `step` may return a view of the engine's buffer, which the next step reuses.
        logits.append(np.array(step_model.step(state, prefix)))  # (b, V)
    return np.stack(logits, axis=1)


def _masked_max_abs(a: np.ndarray, b: np.ndarray, mask: np.ndarray | None = None) -> float:
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    if mask is not None:  # (b, s) -> ignore padded source positions
        diff = diff[mask.astype(bool)]
    return float(diff.max())


def _low_memory(spec) -> bool:
    return spec.precision != "int8"


LOW_MEMORY_BACKENDS = tuple(spec.name for spec in ENGINES.values() if _low_memory(spec))


def _phase(peaks: PhasePeaks | None, name: str):
    return nullcontext() if peaks is None else peaks.phase(name)


def _session(name: str, threads):
    from backends import SessionConfig

    return SessionConfig(threads=threads, provider="cpu", low_memory=name in LOW_MEMORY_BACKENDS)


def _step_models(export_dir: Path, threads, peaks: PhasePeaks | None = None) -> Iterator[tuple[str, StepModel]]:
    """The engine of every ORT backend (`ENGINES`, by its logits key), one at a time: each is built
    when the caller asks for the next and released after it."""
    from backends import load_manifest

    manifest = load_manifest(export_dir)
    for key, spec in ENGINES.items():
        if set(spec.graphs) & set(manifest.graphs_left_out):
            continue
        with _phase(peaks, f"logits {spec.name}"):
            # the caller drops it before asking for the next
            yield key, spec.engine(spec, manifest, _session(spec.name, threads))
            release_freed_memory()  # the sessions' weights go before the next engine loads


def logits_parity(model, tokenizer, export_dir: Path, sentences, threads, peaks: PhasePeaks | None = None) -> dict:
    """`model`: the PyTorch model, or a function that loads it; loaded here, it is released once its
    reference logits are computed, so no ORT engine loads beside it."""
    with _phase(peaks, "logits pytorch"):
        if callable(model) and not isinstance(model, torch.nn.Module):
            model = model()
        config = model.config
        cases = build_cases(tokenizer, sentences, config)
        references = [_torch_reference(model, case) for case in cases]  # (b, t, V) logits: tens of MB
        spread = pytorch_spread(cases, references)
        del model
        release_freed_memory()
    results = [
        {
            "case": case.name,
            "batch": int(case.input_ids.shape[0]),
            "source_lengths": [int(n) for n in case.attention_mask.sum(axis=1)],
            "decoder_steps": int(case.decoder_ids.shape[1]),
            "max_abs_logit_diff": {},
            "max_abs_encoder_hidden_diff": {},
            "argmax_agreement": {},
        }
        for case in cases
    ]
    for name, step_model in _step_models(export_dir, threads, peaks):
        # Every case encoded before any step: a low-memory KV engine then holds its encoder's
        # weights and its decoder's one after the other, never together.
        kv = hasattr(step_model, "open_graph")  # the full graph has no encoder of its own
        encoded = [(step_model.encode(case.input_ids, case.attention_mask), _encoder_hidden(step_model, case) if kv else None)
                   for case in cases]
        for case, (state, hidden), (ref_logits, ref_hidden), entry in zip(cases, encoded, references, results):
            logits = _stepped_logits(step_model, state, case.decoder_ids)
            entry["max_abs_logit_diff"][name] = _masked_max_abs(logits, ref_logits)
            entry["argmax_agreement"][name] = float((logits.argmax(-1) == ref_logits.argmax(-1)).mean())
            if hidden is not None:
                entry["max_abs_encoder_hidden_diff"][name] = _masked_max_abs(hidden, ref_hidden, case.attention_mask)
        del step_model, encoded  # the last references: the generator frees the engine before building the next
    return {"cases": results, "pytorch_spread": spread}


class _OneAtATime(Mapping):
    """The export's backends as `parity_report` reads them (membership, then `items()` in order),
    each loaded when its turn comes and closed before the next one loads."""

    def __init__(self, export_dir: Path, threads, peaks: PhasePeaks | None = None, label: str = "greedy"):
        from backends import load_manifest, runnable_backends

        self.export_dir, self.threads, self.peaks, self.label = export_dir, threads, peaks, label
        self.names = runnable_backends(load_manifest(export_dir))

    def __contains__(self, name) -> bool:
        return name in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, name):
        raise TypeError("backends here are loaded one at a time: iterate items()")

    def items(self):
        from backends import load_backends

        for name in self.names:
            with _phase(self.peaks, f"{self.label} {name}"):
                backend = load_backends(self.export_dir, (name,), session=_session(name, self.threads))[name]
                try:
                    yield name, backend
                finally:
                    backend.close()
                    del backend
                    release_freed_memory()


def greedy_parity(export_dir: Path, sentences: list[str], max_new_tokens: int, threads,
                  peaks: PhasePeaks | None = None, label: str = "greedy", **decode) -> dict:
    """Ids and text through the real backends (one batch), the reference being the PyTorch one.

    `decode`: further options for `Backend.translate`; none given, the export's defaults apply.
    """
    from backends.divergence import parity_report

    backends = _OneAtATime(export_dir, threads, peaks, label)
    return parity_report(backends, sentences, REFERENCE, max_new_tokens=max_new_tokens, **decode)


def low_precision_finite(export_dir: Path, calibration, threads, peaks: PhasePeaks | None = None) -> dict[str, dict | None]:
    """Per approximate backend: the first value its graphs compute as NaN or Inf on the calibration
    text (the node, its op and module, where), or None when every value stays finite."""
    from backends import load_manifest

    from .ranges import measure

    manifest = load_manifest(export_dir)
    found = {}
    for spec in ENGINES.values():
        if spec.exact:
            continue
        encoder, decoder = (manifest.verify_graph(g) for g in spec.graphs)
        with _phase(peaks, f"finite {spec.name}"):
            measured = measure(encoder, decoder, calibration, threads)
        found[spec.name] = next(({"graph": Path(p).name, **r.first_nonfinite} for p, r in
                                 ((encoder, measured["encoder"]), (decoder, measured["decoder"]))
                                 if r.first_nonfinite), None)
    return found


def nonfinite_failure(name: str, where: dict) -> str:
    step = "the encoder" if where.get("step") is None else f"decoder step {where['step']}"
    module = f", module {where['module']}" if where.get("module") else ""
    hint = " (--fp16-keep auto keeps overflowing nodes in fp32)" if "fp16" in name else ""
    return (f"{name}: {where['graph']} computes {where['what']} first at node {where['node']} ({where['op']}{module}), "
            f"calibration batch {where['batch']}, {step}{hint}")


def low_precision_failures(logits: dict, nonfinite: dict[str, dict | None] | None) -> list[str]:
    """A low-precision graph that computes NaN or Inf anywhere, or gives logits that are not finite."""
    failures = [nonfinite_failure(name, where) for name, where in (nonfinite or {}).items() if where]
    for case in logits["cases"]:
        for name, diff in case["max_abs_logit_diff"].items():
            if name in APPROXIMATE_KEYS and not np.isfinite(diff):
                failures.append(f"{name}, {case['case']}: logits are not finite (max |Δlogit| {diff})")
    return failures


def judge(logits: dict, greedy: dict | None, model_decoding: dict | None = None) -> list[str]:
    """Every fp32 failure, with its numbers; an empty list means the export passes."""
    failures = []
    spread = logits.get("pytorch_spread", 0.0)
    tolerance = fp32_tolerance(spread)
    why = f" (PyTorch's own spread {spread:.3g})" if tolerance > FP32_LOGITS_TOLERANCE else ""
    for case in logits["cases"]:
        for name, diff in case["max_abs_logit_diff"].items():
            if name not in APPROXIMATE_KEYS and not diff <= tolerance:
                failures.append(f"{name}, {case['case']}: max |Δlogit| {diff:.3g} > {tolerance:.3g}{why}")
    for label, report in (("greedy", greedy), (decoding_label(model_decoding), model_decoding)):
        if report is None:
            continue
        for name, r in report["backends"].items():
            if name not in APPROXIMATE and r["identical_ids"] != report["sentences"]:
                failures.append(
                    f"{name}: {label} ids identical on {r['identical_ids']}/{report['sentences']} sentences; "
                    f"first mismatch {r['first_mismatch']}"
                )
    return failures


def decoding_label(report: dict | None) -> str:
    """"beam 4" (the model's own decoding, as its generation config sets it) for the summaries."""
    return "" if report is None else f"beam {report['options']['num_beams']}"


def model_decoding_parity(export_dir: Path, sentences: list[str], max_new_tokens: int, threads,
                          peaks: PhasePeaks | None = None) -> dict | None:
    """The same check with the model's own decoding (its generation config: beams, repetition
    control, ...), which is what its users run; None when that decoding is greedy (checked above)."""
    from backends import load_manifest

    generation = load_manifest(export_dir).generation
    if generation.num_beams == 1:
        return None
    # no options: the sidecar's
    report = greedy_parity(export_dir, sentences, max_new_tokens, threads, peaks, f"beam {generation.num_beams}")
    options = {
        k: getattr(generation, k)
        for k in ("num_beams", "length_penalty", "early_stopping", "no_repeat_ngram_size", "repetition_penalty")
    }
    return {"options": options, **report}


def run(model, tokenizer, export_dir: Path, sentences, greedy_sentences, max_new_tokens, threads, calibration=None):
    """Verify the export in `export_dir` (its provisional sidecar names the graphs) against `model`
    (or a function that loads it, so it is held only while its reference logits are computed);
    `calibration` (export/ranges.py): the text the low-precision graphs must stay finite on."""
    start = time.perf_counter()
    with PhasePeaks() as peaks:
        nonfinite = None if calibration is None else low_precision_finite(export_dir, calibration, threads, peaks)
        finite_s = time.perf_counter() - start
        logits = logits_parity(model, tokenizer, export_dir, sentences, threads, peaks)
        logits_s = time.perf_counter() - start
        # Greedy pins the graphs' step-by-step numbers; the model's own decoding (beam search with a
        # cache reordered every step, when its generation config asks for it) is what users get.
        greedy = greedy_parity(export_dir, greedy_sentences, max_new_tokens, threads, peaks, num_beams=1)
        own = model_decoding_parity(export_dir, greedy_sentences, max_new_tokens, threads, peaks)
    failures = judge(logits, greedy, own)
    fp32_passed = not failures
    failures += low_precision_failures(logits, nonfinite)
    approximate = {  # by precision: "fp16", "int8"
        spec.precision: {
            "max_abs_logit_diff": max(c["max_abs_logit_diff"][key] for c in logits["cases"]),
            "argmax_agreement_min": min(c["argmax_agreement"][key] for c in logits["cases"]),
            "greedy": greedy["backends"][spec.name],
            "model_decoding": None if own is None else own["backends"][spec.name],
            "nonfinite": None if nonfinite is None else nonfinite.get(spec.name),
        }
        for key, spec in ENGINES.items()
        if not spec.exact
    }
    return {
        "fp32_tolerance": fp32_tolerance(logits["pytorch_spread"]),
        "pytorch_spread": logits["pytorch_spread"],
        "low_memory_backends": list(LOW_MEMORY_BACKENDS),
        "peak_rss_mb": peaks.rounded(),  # per phase, in the order they ran
        "fp32_passed": fp32_passed,
        "passed": not failures,
        "failures": failures,
        "fp32_max_abs_logit_diff": max(
            d for c in logits["cases"] for n, d in c["max_abs_logit_diff"].items() if n not in APPROXIMATE_KEYS
        ),
        **approximate,
        "logits": logits["cases"],
        "greedy": greedy,
        "model_decoding": own,
        "seconds": {"finite": round(finite_s, 1), "logits": round(logits_s - finite_s, 1),
                    "total": round(time.perf_counter() - start, 1)},
    }
