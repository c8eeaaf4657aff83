"""The corpus engine: every backend over a corpus of any size, in this process or on a Ray cluster.

`run_corpus` checks every input row first (`corpus_io.count_rows`), cuts the corpus into shards of
`shard_size` rows, hands the shards not yet in `--out/shards/` to an engine, writes each finished
shard's Parquet file as it arrives (this process writes them all, wherever they were translated),
then adds the shards up (`shards.aggregate`). Both engines run the one per-shard function
(`shards.translate_shard`), so they give the same per-sentence results:

- `local`: the backends loaded once in this process, the shards one after another.
- `ray` (`ray_engine`, the only module that imports ray): Ray Data reads the shards, an actor
  pool (`map_batches` with a callable class, each actor loading the backends once) translates
  them; a failed actor is restarted and its shard retried by Ray.

A rerun with the same `--out` skips the shards already there (`run.json` pins what they were made
from: input files, export, backends, decoding, shard size, the `--external` exports' files; a
different run refuses that folder).
A shard is written whole or not at all, and a shard that arrives twice is written once, so after
any interruption or retry each sentence is present exactly once; `aggregate` checks it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corpus import CorpusError

from .corpus_io import count_rows, expected_shards, input_files, iter_shards
from .shards import ShardStore, aggregate, summary_of, translate_shard

ENGINES = ("local", "ray")
MODEL_TRANSFER = ("auto", "shared", "ship")


class EngineUnavailable(RuntimeError):
    """The chosen engine cannot run here (Ray not installed)."""


@dataclass(frozen=True)
class EngineOptions:
    engine: str = "local"
    threads: int | None = None  # per backend: default 2 for the local engine, 1 per Ray actor
    batch_size: int = 16  # sentences per translate call, length-sorted within a shard
    shard_size: int = 128  # sentences per shard: the unit of work, of retry and of resume
    actors: int | None = None  # ray: default one per CPU slot (the cluster's CPUs // threads)
    address: str | None = None  # ray: "auto" or "ray://host:port" joins a cluster; None starts a local one
    model_transfer: str = "auto"  # ray: "shared" path on every node, "ship" through the object store, "auto"
    node_cache: str | None = None  # ray: where shipped exports go on each node (default: the temp folder)
    progress: bool = True  # the progress bar (sentences/s, ETA) on stderr

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; expected one of: {', '.join(ENGINES)}")
        if self.model_transfer not in MODEL_TRANSFER:
            raise ValueError(f"unknown model transfer {self.model_transfer!r}; expected one of: {', '.join(MODEL_TRANSFER)}")
        for name in ("threads", "batch_size", "shard_size", "actors"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.engine == "local" and (self.actors or self.address):
            raise ValueError("--actors and --address need --engine ray")

    @property
    def threads_per_worker(self) -> int:
        return self.threads or (2 if self.engine == "local" else 1)


@dataclass(frozen=True)
class Job:
    """What an engine needs, picklable: the export, the backends, decoding, and the shards to run."""

    export_dir: str
    names: tuple[str, ...]
    reference: str
    threads: int
    batch_size: int
    decode: dict[str, Any]
    files: tuple[str, ...]
    counts: tuple[int, ...]
    shard_size: int
    skip: frozenset[str] = field(default_factory=frozenset)
    external: tuple[tuple[str, str], ...] = ()  # (NAME, DIR): Optimum-layout exports run after `names`

    @property
    def all_names(self) -> tuple[str, ...]:
        return (*self.names, *(n for n, _ in self.external))

    def shards(self, only_file: int | None = None):
        return iter_shards([Path(f) for f in self.files], list(self.counts), self.shard_size, self.skip, only_file)

    def translate(self, backends: dict, shard: dict, worker: dict):
        return translate_shard(backends, shard, reference=self.reference, batch_size=self.batch_size,
                               decode=self.decode, worker=worker)


def _run_local(job: Job, accept) -> dict:
    from backends import SessionConfig, load_backends

    backends = load_backends(job.export_dir, names=job.names, session=SessionConfig(threads=job.threads),
                             external=dict(job.external))
    worker = {"engine": "local", "host": socket.gethostname(), "pid": os.getpid(),
              "model_files": {"mode": "local", "path": job.export_dir}}
    try:
        for shard in job.shards():
            accept(job.translate(backends, shard, worker))
    finally:
        for backend in backends.values():
            backend.close()
    return {"name": "local", "nodes": 1, "actors": 1, "threads_per_actor": job.threads}


def _external_spec(export_dir: Path, external: dict[str, str]) -> dict:
    """What each external export is, for run.json: its folder and the sha256 of every file it is read
    from, so a resume after the folder changed is refused like one after the export changed."""
    from backends import load_manifest
    from backends.manifest import sha256_file
    from backends.ort_external import files_read, find_layout

    manifest = load_manifest(export_dir)
    spec = {}
    for name, path in external.items():
        layout = find_layout(path)
        spec[name] = {"path": path, "files": {str(f.relative_to(layout.meta)): sha256_file(f)
                                              for f in files_read(layout, manifest) if f.is_file()}}
    return spec


def _spec(files, counts, export_dir: Path, names, reference, options: EngineOptions, decode, limit,
          external: dict[str, str]) -> dict:
    from backends.manifest import MANIFEST_NAME, sha256_file

    return {
        "input": [{"path": str(f), "bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns, "rows": n}
                  for f, n in zip(files, counts)],
        "limit": limit, "export": str(export_dir), "manifest_sha256": sha256_file(export_dir / MANIFEST_NAME),
        "backends": list(names), "reference": reference, "batch_size": options.batch_size,
        "shard_size": options.shard_size, "decode": decode,
        **({"external": _external_spec(export_dir, external)} if external else {}),
    }


def _claim(out: Path, spec: dict) -> None:
    """Write run.json, or check that the one there describes this very run (resume)."""
    path = out / "run.json"
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        changed = [k for k in sorted(set(old) | set(spec)) if old.get(k) != spec.get(k)]
        if changed:
            raise ValueError(f"{out} holds shards of another run ({', '.join(changed)} differ); use another --out, "
                             f"or delete {out} to start over")
    elif (out / "shards").is_dir() and any((out / "shards").glob("*.parquet")):
        raise ValueError(f"{out}/shards holds shards but no run.json; use another --out")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=2, ensure_ascii=False), encoding="utf-8")


def run_corpus(export_dir: Path, input_path, out: Path, names: list[str], reference: str, options: EngineOptions,
               decode: dict[str, Any], limit: int | None = None, log=print, on_shard=None,
               external: dict[str, str] | None = None) -> dict:
    """Translate and compare the corpus at `input_path` into `out`; returns the aggregate, the engine's
    figures and the input. `on_shard(summary)` is called after each shard is written. `external`:
    {NAME: DIR} of Optimum-layout exports of the same model, run as backends NAME after `names`."""
    export_dir, out = Path(export_dir).resolve(), Path(out)
    try:
        files = input_files(input_path)
    except FileNotFoundError as e:
        raise CorpusError(str(e)) from None
    counts = count_rows(files, limit)  # every row checked before anything is translated
    external = dict(external or {})
    _claim(out, _spec(files, counts, export_dir, names, reference, options, decode, limit, external))
    store = ShardStore(out)
    expected = {s: n for s, _f, _start, n in expected_shards(counts, options.shard_size)}
    done = store.done() & expected.keys()
    total, resumed = sum(counts), sum(expected[s] for s in done)
    job = Job(str(export_dir), tuple(names), reference, options.threads_per_worker, options.batch_size, dict(decode),
              tuple(str(f) for f in files), tuple(counts), options.shard_size, frozenset(done), tuple(external.items()))
    log(f"{total:,} sentences in {len(expected)} shards of {options.shard_size} from {len(files)} file(s); "
        f"{len(done)} shards already in {store.dir}; engine {options.engine}")
    from tqdm import tqdm

    tty = sys.stderr.isatty()  # in a log (a submitted job, CI): a line every 30 s instead of a live bar
    bar = tqdm(total=total, initial=resumed, unit=" sentences", smoothing=0.1, mininterval=0.5 if tty else 30,
               disable=not options.progress, desc=options.engine, file=sys.stderr)
    state = {"seen": set(done), "duplicates": 0, "first": None, "translated": 0}
    start = time.perf_counter()

    def accept(table) -> None:
        s = summary_of(table)
        if s["shard"] in state["seen"] or s["shard"] not in expected:
            state["duplicates"] += 1  # a retried shard that had arrived already: written once
            return
        store.write(table)
        state["seen"].add(s["shard"])
        state["translated"] += s["n"]
        state["first"] = state["first"] or time.perf_counter() - start
        bar.update(s["n"])
        if on_shard is not None:
            on_shard(s)

    try:
        if len(done) == len(expected):
            engine = {"name": options.engine, "note": "every shard was already done"}
        elif options.engine == "local":
            engine = _run_local(job, accept)
        else:
            try:
                from . import ray_engine
            except ImportError as e:
                raise EngineUnavailable("--engine ray needs Ray Data: pip install -r requirements-engine.txt "
                                        "(ray[data]==2.60.0; every node needs it too)") from e
            engine = ray_engine.run(job, options, accept, log=log)
    finally:
        bar.close()
    wall = time.perf_counter() - start
    engine.update({"shard_size": options.shard_size, "shards": len(expected), "shards_resumed": len(done),
                   "duplicate_shards_dropped": state["duplicates"], "sentences_translated": state["translated"],
                   "wall_s": round(wall, 2), "first_shard_s": round(state["first"], 2) if state["first"] else None,
                   "sentences_per_s": round(state["translated"] / wall, 2) if state["translated"] else None})
    result = aggregate(store, counts, options.shard_size, list(job.all_names), reference)
    return {"aggregate": result, "engine": engine,
            "input": {"path": str(Path(input_path).resolve()), "files": [str(f) for f in files], "rows": counts}}
