"""Beam search, the token decoder for num_beams > 1 (as whisper's BeamSearchDecoder).

It follows transformers 5.24 `generate()` token for token: log_softmax over the whole vocabulary,
then the processors, then keeps 2 x num_beams continuations per sentence (`_beam_search`,
`_get_top_k_continuations`, `_get_running_beams_for_next_iteration`, `_update_finished_beams`,
`_check_early_stop_heuristic`), and says which rows continue which, so the engine can reorder its
cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import native
from .base import sentences_of
from .generation import GenerationDefaults, SpecialTokens
from .options import DecodeOptions
from .processors import logits_processors, prepare
from .results import RowResult, StepScore, longest_run
from .scoring import beam_scores


@dataclass
class _Finished:
    score: float  # sum of log-probs / length ** length_penalty
    step: int  # the step that produced its last token
    row: int  # the row (of that step's input) it continued
    token: int
    logprob: float


@dataclass
class _StepRecord:
    """What one beam-search step leaves behind; hypotheses are read back through `parent`."""

    parent: np.ndarray  # (b * n,) the input row each next-step row continues
    token: np.ndarray  # (b * n,) the token each next-step row appended
    computed: np.ndarray | None  # the rows the step computed (None: all b * n); the arrays below are theirs
    logprob: np.ndarray  # (computed,) the appended token's processed log-prob
    top_ids: np.ndarray  # (computed, k): the divergence view's alternatives
    top_logprobs: np.ndarray  # (computed, k)
    non_finite: np.ndarray  # (computed,)

    def at(self, row: int) -> int:
        """Where row `row` (of all b * n) is in the computed rows' arrays."""
        if self.computed is None:
            return row
        i = int(np.searchsorted(self.computed, row))
        if i == len(self.computed) or self.computed[i] != row:
            raise IndexError(f"row {row} was not computed at this step")
        return i


_NEG = -1.0e9  # generate()'s "not this one" score


def _select(running: np.ndarray, ids: np.ndarray, values: np.ndarray, keep: int, vocab: int, eos: int, capped: bool):
    """Steps 2 and 3 of `BeamSearchDecoder` (`native.beam_select` where compiled, which must agree):
    running (b, n), ids and values (b * n, K) best first -> each sentence's best `keep`
    continuations (b, keep): scores, beams, tokens, log-probs, hits, and the n of them that go on."""
    b, n = running.shape
    scores = (running.reshape(-1, 1) + values[:, :keep]).reshape(b, n * keep)
    beam = np.repeat(np.arange(n), keep)  # (n * keep,) the local beam of each column
    tokens = ids[:, :keep].reshape(b, n * keep)
    order = np.lexsort((beam * vocab + tokens, -scores), axis=-1)[:, :keep]  # (b, keep)
    top_scores = np.take_along_axis(scores, order, axis=-1)
    top_tokens = np.take_along_axis(tokens, order, axis=-1)
    top_logprobs = np.take_along_axis(values[:, :keep].reshape(b, n * keep), order, axis=-1)
    hits = (top_tokens == eos) | capped
    nxt = np.argsort(-(top_scores + hits * _NEG), axis=-1, kind="stable")[:, :n]  # (b, n)
    return top_scores, beam[order], top_tokens, top_logprobs, hits, nxt


class BeamSearchDecoder:
    """generate(num_beams=n, do_sample=False), transformers 5.24 `_beam_search`, per step:

    1. log-probs = log_softmax(logits) over the whole vocabulary, then the processors;
    2. each sentence's running scores + log-probs, flattened over beams x vocabulary: the best
       2n continuations (ties: the lower beam, then the lower id);
    3. a continuation hits a stop when its token is eos or the length cap is reached; the best n
       that do not continue as the running beams (the cache is reordered by their rows);
    4. of the best n continuations, those that hit a stop join the sentence's finished list with
       score sum / length ** length_penalty, unless the sentence is done (early_stopping=True and n
       finished, or the heuristic said no running beam can win); the list keeps the best n;
    5. the heuristic: the best running score divided by (the current length, or the longest
       possible one for "never" with length_penalty > 0) ** length_penalty must beat the worst of
       n finished hypotheses; the loop ends when no sentence can improve, or every sentence is
       full with early_stopping=True, or every continuation hit a stop (the length cap).

    Scores are float64 (generate() uses float32): near-ties may resolve differently.
    """

    def __init__(self, batch: int, special: SpecialTokens, options: DecodeOptions, rules: GenerationDefaults, threads: int):
        self.special, self.options, self.threads = special, options, threads
        self.processors = logits_processors(special, options, rules, beams=True)
        self.forces_eos = rules.forced_eos_token_id is not None
        self.batch = batch
        self.width = n = options.num_beams
        self.candidates = max(2 * n, options.top_k)  # per row: enough for the 2n best of a sentence
        # Only the first beam of a sentence is live at the start: the others are copies of it.
        self.running = np.zeros((batch, n))  # (b, n) float64, best first
        self.running[:, 1:] = _NEG
        self.finished: list[list[_Finished]] = [[] for _ in range(batch)]
        self.improvable = np.ones(batch, dtype=bool)  # generate()'s is_early_stop_heuristic_unsatisfied
        self.count = np.zeros(batch, dtype=np.int64)  # len(finished[s])
        self.worst = np.full(batch, _NEG)  # the lowest finished score once n are finished, else _NEG
        self.history: list[_StepRecord] = []

    def alive_rows(self) -> np.ndarray:
        """The rows the engine must still compute: every beam of each sentence that is not done.

        A sentence is done once no running beam can beat its n finished hypotheses (`improvable`
        only ever turns False). generate() computes its beams to the end of the batch anyway, but
        nothing read from them can change its result: its finished list is frozen, and `finish`
        reads running beams only for a sentence with fewer than n finished hypotheses. Dropping
        it changes no other sentence's numbers (rows are independent), and not when the loop
        stops either: every continuation hits a stop only at the length cap (a beam has one eos).
        """
        n = self.width
        going = self.improvable | (self.count < n)  # (b,)
        return (np.flatnonzero(going)[:, None] * n + np.arange(n)).reshape(-1)

    def _in_global_rows(self, rows: np.ndarray | None, values: np.ndarray, fill) -> np.ndarray:
        """Per-row values of the computed `rows` (None: all) -> the same for all b * n rows (`fill`
        elsewhere)."""
        if rows is None:
            return values
        out = np.full((self.batch * self.width, *values.shape[1:]), fill, dtype=values.dtype)
        out[rows] = values
        return out

    def update(
        self, step: int, decoder_ids: np.ndarray, logits: np.ndarray, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """logits (r, V) for the rows `rows` of decoder_ids (None: all b * n; the loop drops done
        sentences from the engine, every beam of each) -> (decoder ids (b * n, t + 1), the row of
        decoder_ids each row continues, whether all are done). Rows not computed continue
        themselves with pad."""
        o, eos = self.options, self.special.eos
        n, vocab = self.width, logits.shape[1]
        if rows is None:
            sentences = np.arange(self.batch)
        else:
            sentences = sentences_of(rows, n)
            if sentences is None:
                raise ValueError("beam search computes whole sentences: rows must be every beam of each sentence kept")
        b = len(sentences)
        # 1. processed log-probs: ids (r, K) and their values (r, K) float64, best first
        prepare(self.processors, step, decoder_ids if rows is None else decoder_ids[rows])
        ids, values, non_finite = beam_scores(logits, self.processors, self.candidates, self.threads)
        # 2. the best 2n continuations of each sentence over its n beams; 3. stops, and the n best
        # that go on
        keep, capped, live = 2 * n, step + 1 >= o.max_new_tokens, self.running[sentences]
        chosen = native.beam_select(live, ids, values, keep, vocab, eos, capped)
        top_scores, top_beams, top_tokens, top_logprobs, hits, nxt = chosen or _select(
            live, ids, values, keep, vocab, eos, capped)
        running = top_scores + hits * _NEG
        offsets = (sentences * n)[:, None]  # each sentence's first row in decoder_ids
        # (b * n,) over all rows of decoder_ids: a row not computed continues itself with pad
        parents = (np.take_along_axis(top_beams, nxt, axis=-1) + offsets).reshape(-1)
        beam_idx = parents
        if rows is not None:
            beam_idx = np.arange(self.batch * n)
            beam_idx[rows] = parents
        new_tokens = self._in_global_rows(rows, np.take_along_axis(top_tokens, nxt, axis=-1).reshape(-1),
                                          self.special.pad)
        self.history.append(
            _StepRecord(
                parent=beam_idx,
                token=new_tokens,
                computed=rows,
                logprob=np.take_along_axis(top_logprobs, nxt, axis=-1).reshape(-1),
                top_ids=ids[:, : o.top_k],
                top_logprobs=values[:, : o.top_k],
                non_finite=non_finite,
            )
        )
        # 4. finished hypotheses (using the heuristic's verdict from the previous step)
        length_norm = (step + 1) ** o.length_penalty
        for i in np.flatnonzero(hits[:, :n].any(axis=1)):  # only a stop among the best n joins a list
            s = sentences[i]
            done = self.finished[s]
            if not self.improvable[s] or (o.early_stopping is True and len(done) == n):
                continue
            new = [
                _Finished(float(top_scores[i, j] / length_norm), step, int(offsets[i, 0] + top_beams[i, j]),
                          int(top_tokens[i, j]), float(top_logprobs[i, j]))
                for j in range(n)
                if hits[i, j] and np.isfinite(top_scores[i, j])
            ]
            if new:
                merged = done + new
                merged.sort(key=lambda h: -h.score)  # stable: the earlier one first on a tie
                self.finished[s] = merged[:n]
                self.count[s] = len(self.finished[s])
                self.worst[s] = self.finished[s][-1].score if self.count[s] == n else _NEG
        self.running[sentences] = np.take_along_axis(running, nxt, axis=-1)
        # 5. can a running beam still beat the worst finished one?
        if o.early_stopping == "never" and o.length_penalty > 0.0:
            best_length = o.max_new_tokens
        else:
            best_length = step + 1
        best = self.running[sentences, 0] / best_length**o.length_penalty
        self.improvable[sentences] &= best > self.worst[sentences]
        full = bool((self.count == n).all())
        go_on = self.improvable.any() and not (full and o.early_stopping is True) and not hits.all()
        next_ids = np.concatenate([decoder_ids[beam_idx], new_tokens[:, None]], axis=1)
        return next_ids, beam_idx, not go_on

    def _read_back(self, h: _Finished) -> tuple[list[StepScore], list[int]]:
        """The steps of a finished hypothesis, first to last, and its non-finite steps."""
        steps, non_finite = [], []
        token, logprob, row = h.token, h.logprob, h.row
        for step in range(h.step, -1, -1):
            rec = self.history[step]
            i = rec.at(row)
            steps.append(StepScore(int(token), float(logprob), rec.top_ids[i].tolist(), rec.top_logprobs[i].tolist()))
            if rec.non_finite[i]:
                non_finite.append(step)
            if step:
                prev = self.history[step - 1]
                token, logprob, row = prev.token[row], prev.logprob[prev.at(row)], prev.parent[row]
        return steps[::-1], non_finite[::-1]

    def finish(self, timings: dict[str, float]) -> list[RowResult]:
        o, eos = self.options, self.special.eos
        last = len(self.history) - 1
        results = []
        for s in range(self.batch):
            hyps = list(self.finished[s])
            if len(hyps) < o.num_return_sequences:  # never seen: the loop ends with n finished
                rec = self.history[last]
                for j in range(self.width):
                    row = s * self.width + j
                    score = self.running[s, j] / (last + 1) ** o.length_penalty
                    hyps.append(_Finished(float(score), last, int(rec.parent[row]), int(rec.token[row]),
                                          float(rec.logprob[rec.at(row)])))
            out = []
            for h in hyps[: o.num_return_sequences]:
                steps, non_finite = self._read_back(h)
                out.append((steps, non_finite, h.score))
            steps, non_finite, score = out[0]
            ids = [t.token_id for t in steps]
            hypotheses = [([t.token_id for t in st], sc) for st, _, sc in out]
            if not o.output_scores:  # computed anyway (beam search ranks by them), returned only when asked
                steps, score = [], None
                hypotheses = [(h, None) for h, _ in hypotheses]
            capped = len(ids) == o.max_new_tokens and (ids[-1] != eos or self.forces_eos)
            results.append(
                RowResult(
                    token_ids=ids,
                    scores=steps,
                    stop_reason="max_new_tokens" if capped or ids[-1] != eos else "eos",
                    timings_ms=timings,
                    non_finite_steps=non_finite,
                    repeated_run=longest_run(ids),
                    score=score,
                    hypotheses=hypotheses,
                )
            )
        return results
