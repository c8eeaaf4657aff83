"""The offline side of a translate load run: the same backend's throughput at batch 32, same decoding.

`bench load --target translate --baseline-export DIR` measures it after the app has stopped, in
this process, on the sentences the users sent: loaded once, one warm-up batch, then every
sentence in length-sorted batches of 32 through `Backend.translate` with the endpoint's decoding
(the beams and output cap the answers report, the rest from the model's own generation config;
token ids and text only), timed end to end.
"""

from __future__ import annotations

import time
from pathlib import Path


def offline_throughput(export_dir: str | Path, backend: str, texts: list[str], *, batch_size: int = 32,
                       threads: int | None = None, num_beams: int | None = None,
                       max_new_tokens: int | None = None) -> dict:
    """Sentences per second of `backend` over `texts` in batches of `batch_size`, after one warm-up batch."""
    from backends import SessionConfig, load_backends

    if not texts:
        raise ValueError("no sentences to time")
    loaded = load_backends(export_dir, names=(backend,), session=SessionConfig(threads=threads))[backend]
    ordered = sorted(texts, key=lambda t: loaded.tokenizer.count_tokens(t))
    batches = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    decode = dict(num_beams=num_beams, max_new_tokens=max_new_tokens, top_k=1, output_scores=False)
    loaded.translate(batches[len(batches) // 2], **decode)  # warm-up: a middle-length batch
    start = time.perf_counter()
    for batch in batches:
        loaded.translate(batch, **decode)
    wall = time.perf_counter() - start
    return {"backend": backend, "export": str(export_dir), "batch_size": batch_size, "sentences": len(texts),
            "threads": threads, "num_beams": num_beams, "max_new_tokens": max_new_tokens, "wall_s": round(wall, 3),
            "sentences_per_s": round(len(texts) / wall, 2)}
