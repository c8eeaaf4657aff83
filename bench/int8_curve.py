"""python -m bench quality --int8-curve 0,1,2,4,8: what keeping int8's most sensitive nodes in fp32 buys.

For each count N: int8 graphs made from the export's own fp32 encoder/decoder with the N most
sensitive nodes (the sidecar's int8 ranking, or measured now by `export.int8_sensitivity` on the
first sentences of the corpus) kept in fp32, then over the corpus: sentences whose token ids are
identical to PyTorch's, greedy and at the model's beam count, BLEU against the references; and
ms per generated token at batch 1. Timing: every variant loaded in one process, the speed sentences
translated one at a time, variant after variant in round-robin rounds (each round starting with the
next variant, so none always runs first), the median round per variant;
ratios to N = 0 (today's int8), which is what survives a shared machine. The PyTorch outputs are
computed once and kept in --out, so a rerun with more counts does not recompute them.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from backends import REFERENCE
from corpus import Pair

CALIBRATION_SENTENCES = 64


def _calibration(manifest, tokenizer, pairs: list[Pair]):
    from export.int8_sensitivity import calibration

    batch = tokenizer.encode([p.en for p in pairs[:CALIBRATION_SENTENCES]], manifest.max_source_tokens)
    return calibration(batch.input_ids, batch.attention_mask, manifest.data["special_tokens"],
                       manifest.data["generation"])


def _ranking(manifest, tokenizer, pairs: list[Pair], threads: int, log) -> tuple[list[dict], str]:
    """The sidecar's sensitivity ranking, else one measured now on the first corpus sentences."""
    recorded = (manifest.data.get("int8") or {}).get("sensitivity")
    if recorded:
        return recorded["ranking"], "the export's sidecar"
    from export.int8_sensitivity import measure

    result = measure(manifest.root, manifest.data["model"], _calibration(manifest, tokenizer, pairs), threads=threads,
                     log=log)
    return [s.record() for s in result["ranking"]], f"measured now on the first {result['sentences']} corpus sentences"


def _auto_choice(manifest, tokenizer, pairs: list[Pair], threads: int, log) -> dict:
    """{"kept", "rescore", "rule", "tried"}: the export's own when it was made with --int8-keep auto."""
    section = manifest.data.get("int8") or {}
    if section.get("keep_option") == "auto":
        return {"kept": section["kept_in_fp32"], "rescore": (section.get("output_layer_rescored") or {}).get("top", 0),
                "rule": section["keep_rule"], "tried": section["sensitivity"]["auto"]["tried"]}
    from export.int8_choice import choose

    choice = choose(manifest.root, manifest.data["model"], _calibration(manifest, tokenizer, pairs), "auto",
                    threads=threads, log=log)
    return {**{k: choice[k] for k in ("kept", "rescore", "rule")}, "tried": choice["sensitivity"]["auto"]["tried"]}


def _variant(manifest, folder: Path, kept: list[dict], tag: int, rescore: int):
    """A sidecar view whose int8 graphs keep `kept` in fp32 and, with `rescore` K > 0, re-score
    the output layer's K best logits exactly (files in `folder`, named by `tag`, checksummed)."""
    from backends.manifest import sha256_file
    from export.quantize import quantize_int8

    data = json.loads(json.dumps(manifest.data))
    for graph in ("encoder", "decoder"):
        keep = {r["node"] for r in kept if r["graph"] == graph}
        path = folder / f"{graph}_int8.variant{tag}.onnx"
        quantize_int8(manifest.root / f"{graph}.onnx", path, keep=keep, rescore=rescore if graph == "decoder" else 0)
        data["graphs"][f"{graph}_int8"]["file"] = str(path)  # absolute: root / path is path
        data["files"][str(path)] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return dataclasses.replace(manifest, data=data)


def _translate(backend, texts: list[str], batch_size: int, beams: int, max_new_tokens: int) -> list:
    out = []
    for i in range(0, len(texts), batch_size):
        out += backend.translate(texts[i:i + batch_size], num_beams=beams, max_new_tokens=max_new_tokens, top_k=1,
                                 output_scores=False)
    return out


def run(export_dir: Path, pairs: list[Pair], out: Path, counts: tuple[int, ...], threads: int = 1,
        batch_size: int = 16, max_new_tokens: int = 256, speed_sentences: int = 30, rounds: int = 3,
        rescore: int = 0, auto: bool = False, log=print) -> dict:
    """`rescore` K > 0: also, for each count, the output layer re-scored on its K best logits
    (export/int8_rescore.py) instead of kept, the other nodes kept by the ranking without it.
    `auto`: also the variant `--int8-keep auto` would export (export/int8_choice.py)."""
    from backends import load_backends, load_manifest
    from backends.backend import Backend
    from backends.ort_kv_cache import KVCacheStepModel
    from backends.ort_session import SessionConfig
    from service import metrics

    if not counts or any(n < 0 for n in counts):
        raise ValueError(f"--int8-curve needs counts >= 0 (e.g. 0,1,2,4,8), got {counts}")
    counts = tuple(sorted(set(counts) | {0}))  # N = 0 is every ratio's base
    out.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(export_dir)
    beams = sorted({1, int(manifest.data["generation"].get("num_beams") or 1)})
    session = SessionConfig(threads=threads, provider="cpu")
    reference = load_backends(export_dir, (REFERENCE,), session)[REFERENCE]
    texts = [p.en for p in pairs]
    refs = [p.zh for p in pairs]
    ranking, origin = _ranking(manifest, reference.tokenizer, pairs, threads, log)
    results = {"kind": "int8_curve", "export": str(export_dir), "sentences": len(texts), "beams": beams,
               "threads": threads, "batch_size": batch_size, "ranking_from": origin, "ranking": ranking, "rows": []}

    expected = {}
    for b in beams:
        cache = out / f"reference-beams{b}.json"
        key = {"export": str(export_dir), "texts": texts, "max_new_tokens": max_new_tokens, "batch_size": batch_size}
        cached = json.loads(cache.read_text(encoding="utf-8")) if cache.is_file() else None
        if cached and cached["key"] == key:
            expected[b] = cached["outputs"]
        else:
            log(f"{REFERENCE}, {b} beam(s), {len(texts)} sentences ...", flush=True)
            outputs = _translate(reference, texts, batch_size, b, max_new_tokens)
            expected[b] = [{"ids": t.token_ids, "text": t.text} for t in outputs]
            cache.write_text(json.dumps({"key": key, "outputs": expected[b]}, ensure_ascii=False), encoding="utf-8")
    base_bleu = {b: metrics.bleu_chrf([o["text"] for o in expected[b]], refs)["bleu"] for b in beams}
    results["pytorch_bleu"] = base_bleu
    reference.close()

    import onnx
    from export.int8_rescore import output_layer

    head = output_layer(onnx.load(str(manifest.root / "decoder.onnx"), load_external_data=False)).name
    without_head = [r for r in ranking if not (r["graph"] == "decoder" and r["node"] == head)]
    configs = [(str(n), ranking[:n], 0) for n in counts]
    configs += [(f"{n} + re-score top {rescore}", without_head[:n], rescore) for n in counts] if rescore else []
    if auto:
        choice = _auto_choice(manifest, reference.tokenizer, pairs, threads, log)
        configs.append((f"auto ({len(choice['kept'])}" + (f" + re-score top {choice['rescore']})" if choice["rescore"]
                                                          else ")"), choice["kept"], choice["rescore"]))
        results["auto"] = {k: choice[k] for k in ("rule", "rescore", "tried")}
    with tempfile.TemporaryDirectory(prefix="int8-curve-") as tmp:
        variants = {}
        for i, (label, kept, k) in enumerate(configs):
            view = _variant(manifest, Path(tmp), kept, i, k)
            model = KVCacheStepModel(view, session, "encoder_int8", "decoder_int8")
            variants[label] = (Backend(f"int8 keep {label}", model, reference.tokenizer, manifest, model.info), kept)
        for label, (backend, kept) in variants.items():
            row = {"kept": label, "kept_nodes": [f"{r['graph']} {r['module']}" for r in kept]}
            for b in beams:
                start = time.perf_counter()
                outputs = _translate(backend, texts, batch_size, b, max_new_tokens)
                a = metrics.agreement([t.token_ids for t in outputs], [o["ids"] for o in expected[b]])
                bleu = metrics.bleu_chrf([t.text for t in outputs], refs)["bleu"]
                held_out = a["first_divergence_steps"][CALIBRATION_SENTENCES:]  # past the ranking's calibration text
                row[f"beams{b}"] = {"identical": a["identical"], "n": a["n"], "bleu": bleu,
                                    "identical_held_out": sum(d is None for d in held_out), "held_out": len(held_out),
                                    "bleu_delta": round(bleu - base_bleu[b], 2),
                                    "seconds": round(time.perf_counter() - start, 1)}
                log(f"keep {label}, {b} beam(s): identical {a['identical']}/{a['n']}, BLEU {bleu} "
                    f"(PyTorch {base_bleu[b]})", flush=True)
            results["rows"].append(row)

        speed = texts[:speed_sentences]
        times: dict[str, list[float]] = {label: [] for label in variants}
        tokens: dict[str, int] = {}
        for backend, _ in variants.values():  # warm-up, untimed
            backend.translate(speed[:2], num_beams=1, top_k=1, output_scores=False)
        labels = list(variants)
        for r in range(rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:  # each round starts one later
                backend = variants[label][0]
                total, count = 0.0, 0
                for text in speed:
                    (t,) = backend.translate([text], num_beams=1, max_new_tokens=max_new_tokens, top_k=1,
                                             output_scores=False)
                    total += t.timings_ms["total"]
                    count += len(t.token_ids)
                times[label].append(total / count)
                tokens[label] = count
            log(f"speed round {r + 1}/{rounds}: " + ", ".join(f"keep {label}: {times[label][-1]:.2f} ms/token"
                                                                for label in times), flush=True)
    base = statistics.median(times["0"])
    for row in results["rows"]:
        ms = statistics.median(times[row["kept"]])
        row["ms_per_token_batch1"] = round(ms, 3)
        row["ratio_to_keep0"] = round(ms / base, 3)
        row["speed_tokens"] = tokens[row["kept"]]
    results["speed"] = {"sentences": len(speed), "rounds": rounds, "timed": "Backend.translate wall time per sentence "
                        "(tokenize, encoder, every step, detokenize) at batch 1, greedy, summed over the sentences "
                        "and divided by the tokens generated; median of the rounds"}
    (out / "int8_curve.json").write_text(json.dumps(results, indent=1, ensure_ascii=False), encoding="utf-8")
    (out / "int8_curve.md").write_text(table(results) + "\n", encoding="utf-8")
    return results


def table(results: dict) -> str:
    """The curve as a markdown table: one row per choice of nodes kept in fp32."""
    beams = results["beams"]
    head = ["kept in fp32", *[f"identical, {'greedy' if b == 1 else f'beam {b}'}" for b in beams],
            *[f"BLEU Δ {'greedy' if b == 1 else f'beam {b}'}" for b in beams], "ms/token batch 1 (ratio)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in results["rows"]:
        cells = [row["kept"], *[f"{row[f'beams{b}']['identical']}/{row[f'beams{b}']['n']}" for b in beams],
                 *[f"{row[f'beams{b}']['bleu_delta']:+.2f}" for b in beams],
                 f"{row['ms_per_token_batch1']:.2f} ({row['ratio_to_keep0']:.2f}x)"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
