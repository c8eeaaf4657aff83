"""The offline side of a translate load run: the same backend's throughput at given batch sizes, same decoding.

`bench load --target translate --baseline-export DIR` measures it after the app has stopped, in
this process, on the sentences the users sent: loaded once, one warm-up batch, then every
sentence in length-sorted batches through `Backend.translate` with the endpoint's decoding (the
beams and output cap the answers report, the rest from the model's own generation config; token
ids and text only), timed end to end. The batch sizes take turns, round after round, so a
neighbour's load on a shared machine falls on all of them alike; each size's median round counts.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def offline_throughput(export_dir: str | Path, backend: str, texts: list[str], *,
                       batch_sizes: tuple[int, ...] = (32,), rounds: int = 1, threads: int | None = None,
                       num_beams: int | None = None, max_new_tokens: int | None = None) -> list[dict]:
    """Sentences per second of `backend` over `texts` at each of `batch_sizes` (median of `rounds`
    alternating rounds), after one warm-up batch; one dict per batch size, in order."""
    from backends import SessionConfig, load_backends

    if not texts:
        raise ValueError("no sentences to time")
    loaded = load_backends(export_dir, names=(backend,), session=SessionConfig(threads=threads))[backend]
    ordered = sorted(texts, key=lambda t: loaded.tokenizer.count_tokens(t))
    decode = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, top_k=1, output_scores=False)
    loaded.translate(ordered[len(ordered) // 2:][:max(batch_sizes)], **decode)  # warm-up: middle-length sentences
    walls: dict[int, list[float]] = {size: [] for size in batch_sizes}
    for _ in range(rounds):
        for size in batch_sizes:
            start = time.perf_counter()
            for i in range(0, len(ordered), size):
                loaded.translate(ordered[i:i + size], **decode)
            walls[size].append(time.perf_counter() - start)
    return [{"backend": backend, "export": str(export_dir), "batch_size": size, "sentences": len(texts),
             "threads": threads, "num_beams": num_beams, "max_new_tokens": max_new_tokens,
             "rounds_s": [round(w, 3) for w in walls[size]], "wall_s": round(statistics.median(walls[size]), 3),
             "sentences_per_s": round(len(texts) / statistics.median(walls[size]), 2)}
            for size in batch_sizes]
