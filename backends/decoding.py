"""The one decoding loop every backend shares, and teacher-forced scoring.

Backends differ only in how a `StepModel` turns the tokens so far into next-token logits. The
start token, the logits processors (`processors.py`), eos / length stops, per-step scores and
timings are decided by the loop and its token decoders (`strategies.py`), so a difference between
backends is a difference in their numbers.

`decode` is the loop (as whisper's `DecodingTask.run`): encode once, expand per beam, then one
`step` per token; a token decoder picks the next tokens and says which rows continue which
(`GreedyDecoder`, `BeamSearchDecoder`); the engine reorders its cache by that index.
"""

from __future__ import annotations

import time

import numpy as np

from .base import DecodeOptions, ForcedScores, StepModel
from .manifest import GenerationDefaults, SpecialTokens
from .scoring import _top_k, log_softmax
from .strategies import BeamSearchDecoder, GreedyDecoder, RowResult

__all__ = ["RowResult", "decode", "forced_scores"]

# Greedy search drops finished sentences from the engine once they are a quarter of the rows it
# still computes (at least one). Each drop gathers every cache tensor into new buffers (~2 ms at
# batch 32), more than a finished row costs for a few steps; on length-sorted batches, where rows
# end a step or two apart, dropping at every finish made batch 32 slower than never dropping
# (embedded model, A/B in one process: fp32 KV 104.8 vs 132.5 sentences/s; a quarter: 154.7;
# int8 153.4 vs 194.6; a quarter: 198.3).
_KEEP_FRACTION = 4


def decode(
    model: StepModel,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    special: SpecialTokens,
    options: DecodeOptions,
    threads: int = 1,
    rules: GenerationDefaults = GenerationDefaults(),
) -> list[RowResult]:
    """Decode a batch: greedy or beam search by `options.num_beams` (options already `resolved`).

    `rules`: the model's fixed rules from the sidecar (bad words, forced BOS / EOS, renormalizing);
    `threads`: how many threads may score a step's logits (the backend's own thread count).
    """
    if options.num_beams is None or options.min_new_tokens is None:
        raise ValueError("decode() takes resolved options: DecodeOptions(...).resolved(limit, defaults)")
    batch = input_ids.shape[0]
    strategy = GreedyDecoder if options.num_beams == 1 else BeamSearchDecoder
    decoder = strategy(batch, special, options, rules, threads)
    if decoder.width > 1:
        missing = [m for m in ("expand", "reorder") if not callable(getattr(model, m, None))]
        if missing:
            raise TypeError(f"beam search needs {' and '.join(missing)}() on {type(model).__name__} (see StepModel)")

    start = time.perf_counter()
    state = model.encode(input_ids, attention_mask)
    if decoder.width > 1:
        model.expand(state, decoder.width)  # (b, ...) -> (b * n, ...), once: rows [s0 x n, s1 x n, ...]
    encoded = time.perf_counter()

    decoder_ids = np.full((batch * decoder.width, 1), special.decoder_start, dtype=np.int64)  # (rows, t)
    # A finished sentence is dropped from the engine (as CTranslate2 does): greedy search's row
    # would only produce pad, beam search's beams nothing its result reads (BeamSearchDecoder.
    # alive_rows). Rows are independent, so the others' numbers do not change.
    compact = batch > 1 and callable(getattr(model, "keep", None))
    rows = None  # the decoder_ids rows the engine still computes, ascending; None: all of them
    first_token = None
    engine = encoded - start  # seconds inside the engine (its graphs / modules), the loop's own work excluded
    for step in range(options.max_new_tokens):
        # A fresh (rows, V) array each step (a view of the engine's output): masked in place.
        ids = decoder_ids if rows is None else decoder_ids[rows]
        t = time.perf_counter()
        logits = np.asarray(model.step(state, ids), dtype=np.float32)
        engine += time.perf_counter() - t
        decoder_ids, beam_idx, done = decoder.update(step, decoder_ids, logits, rows)
        if first_token is None:
            first_token = time.perf_counter()
        if done:
            break
        if beam_idx is not None:
            # beam_idx is over every row of decoder_ids; the engine holds `rows` only, and a row's
            # parent is a row of the same sentence, so among them
            local = beam_idx if rows is None else np.searchsorted(rows, beam_idx[rows])
            if not np.array_equal(local, np.arange(len(local))):
                t = time.perf_counter()
                model.reorder(state, local)
                engine += time.perf_counter() - t
        if compact:
            alive = decoder.alive_rows()
            current = np.arange(decoder_ids.shape[0]) if rows is None else rows
            if len(current) - len(alive) >= max(1, len(current) // _KEEP_FRACTION):
                keep = np.searchsorted(current, alive)
                t = time.perf_counter()
                model.keep(state, keep)
                engine += time.perf_counter() - t
                rows = alive
    end = time.perf_counter()

    generated = decoder_ids.shape[1] - 1
    timings = {
        "encode": (encoded - start) * 1e3,
        "first_token": ((first_token or end) - start) * 1e3,
        "decode": (end - encoded) * 1e3,
        "total": (end - start) * 1e3,
        "per_token": (end - encoded) * 1e3 / max(generated, 1),
        "steps": float(generated),
        # What the engine alone took (encoder, steps, cache reorders): total minus this is the
        # decoding loop's own cost, which a faster graph cannot remove.
        "engine": engine * 1e3,
    }
    return decoder.finish(timings)


def forced_scores(
    model: StepModel,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    special: SpecialTokens,
    target_ids: list[int],
    top_k: int = 5,
) -> ForcedScores:
    """Feed `target_ids` one step at a time (batch of one) and score each given token."""
    if input_ids.shape[0] != 1:
        raise ValueError("forced scoring takes one sentence at a time")
    if not target_ids:
        raise ValueError("target_ids is empty: nothing to score")
    state = model.encode(input_ids, attention_mask)
    decoder_ids = np.full((1, 1), special.decoder_start, dtype=np.int64)
    all_logits, logprobs, ranks, tops, top_lps = [], [], [], [], []
    for token in target_ids:
        logits = np.asarray(model.step(state, decoder_ids), dtype=np.float32)  # (1, V)
        # A copy: the row may be a view of a (1, t, V) output (the single-step graph returns every
        # position), and keeping views kept all of them alive: 8 GB for 511 steps of a 15k vocabulary.
        all_logits.append(logits[0].copy())
        lp = log_softmax(logits)[0]
        logprobs.append(float(lp[token]))
        ranks.append(int((lp > lp[token]).sum()))
        top = _top_k(lp[None, :], top_k)[0]
        tops.append([int(t) for t in top])
        top_lps.append([float(lp[t]) for t in top])
        decoder_ids = np.concatenate([decoder_ids, np.array([[token]], dtype=np.int64)], axis=1)
    return ForcedScores(
        token_ids=list(target_ids),
        logprobs=logprobs,
        ranks=ranks,
        top_ids=tops,
        top_logprobs=top_lps,
        logits=np.stack(all_logits),
    )
