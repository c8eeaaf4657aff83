"""The Ray engine: Ray Data reads the shards, an actor pool translates them, the driver writes them.

The only module of the project that imports ray (imported by `bench.engine` only for `--engine
ray`). Pipeline:

    read_datasource(ShardSource)                 one read task per input file, on the driver's node
                                                 (the corpus is read where the command runs; nodes
                                                 never need it), one row per shard not yet done
      .map_batches(ShardWorker, batch_size=1,    each actor loads the backends once (its own copy
                   ActorPoolStrategy(size=N))    of the export, see model_files) and runs
                                                 `translate_shard`, the local engine's function
      .iter_batches()                            the driver writes each shard's Parquet file

Ray Data restarts an actor that dies and retries its shard (max_restarts / max_task_retries -1);
the driver writes each shard once. Joining a cluster (`--address`) ships this repository's code
(not its data or models) to every node as the job's working_dir; the nodes need the Python
packages of requirements.txt and requirements-engine.txt.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pyarrow as pa
import ray
import ray.data
from ray.data import ActorPoolStrategy, Datasource, ReadTask
from ray.data.block import BlockMetadata

from .corpus_io import expected_shards
from .model_files import digests, materialize, shipment_files, shipped_external

REPO = Path(__file__).resolve().parents[2]
# What a node needs of the repository is its code: the rest stays on the driver.
CODE_EXCLUDES = [".git", ".venv", ".venv-bench", "exports", "runs", "bench-results", "test-artifacts", "data",
                 "assets", "docs", "*.onnx", "*.safetensors", "*.tsv.gz", "*.parquet"]
SHARD_SCHEMA = pa.schema([("shard", pa.string()), ("file", pa.int32()), ("start", pa.int64()),
                          ("en", pa.list_(pa.string())), ("zh", pa.list_(pa.string()))])


class ShardSource(Datasource):
    """The job's shards that are not done yet, one row each, read from the driver's node."""

    def __init__(self, job):
        self.job = job

    def estimate_inmemory_data_size(self):
        return None

    @property
    def supports_distributed_reads(self) -> bool:
        return False  # local paths: read where the command runs

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        tasks = []
        todo = [(f, s) for s, f, _start, _n in expected_shards(list(self.job.counts), self.job.shard_size)
                if s not in self.job.skip]
        for f, path in enumerate(self.job.files):
            rows = sum(1 for g, _ in todo if g == f)
            if rows:
                def read(f=f, job=self.job):
                    for shard in job.shards(only_file=f):
                        yield pa.Table.from_pylist([shard], schema=SHARD_SCHEMA)

                tasks.append(ReadTask(read, BlockMetadata(num_rows=rows, size_bytes=None, exec_stats=None,
                                                          input_files=(path,))))
        return tasks


class ShardWorker:
    """One actor: the backends loaded once, then `translate_shard` per shard."""

    def __init__(self, job, shipment: dict | None, cache: str | None):
        from backends import SessionConfig, load_backends

        export_dir, files = job.export_dir, {"mode": "shared", "path": job.export_dir}
        external = dict(job.external)
        if shipment is not None:
            refs = shipment["refs"]
            root = Path(cache) if cache else Path(tempfile.gettempdir()) / "bench-corpus-engine"  # on this node
            export_dir, files = materialize(root, shipment["digest"], lambda name: ray.get(refs[name]))
            external = {name: str(export_dir.parent / where) for name, where in shipment["external"].items()}
        self.job = job
        self.backends = load_backends(export_dir, names=job.names, session=SessionConfig(threads=job.threads),
                                      external=external)
        self.worker = {"engine": "ray", "node": ray.get_runtime_context().get_node_id(),
                       "host": socket.gethostname(), "pid": os.getpid(), "model_files": files}

    def __call__(self, batch: pa.Table) -> pa.Table:
        shards, payloads = [], []
        for shard in batch.to_pylist():
            table = self.job.translate(self.backends, shard, self.worker)
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as writer:  # schema metadata (the shard's sums) included
                writer.write_table(table)
            shards.append(shard["shard"])
            payloads.append(sink.getvalue().to_pybytes())
        return pa.table({"shard": pa.array(shards, pa.string()), "payload": pa.array(payloads, pa.binary())})


def _connect(address: str | None) -> bool:
    """Connect (or start a local cluster); True when this call started the connection."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, runtime_env={"working_dir": str(REPO), "excludes": CODE_EXCLUDES},
                 log_to_driver=True)
    else:  # "local": a new instance here, never whichever cluster this machine last started
        ray.init(address="local", include_dashboard=False)
    return True


def run(job, options, accept, log=print) -> dict:
    """Every shard of `job` through an actor pool; `accept(table)` gets each finished shard's table."""
    started = _connect(options.address)
    try:
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0]
        cpus = int(sum(n["Resources"]["CPU"] for n in nodes))
        actors = options.actors or max(1, cpus // job.threads)
        here = ray.get_runtime_context().get_node_id()
        transfer = options.model_transfer
        if transfer == "auto":
            transfer = "ship" if any(n["NodeID"] != here for n in nodes) else "shared"
        shipment = None
        if transfer == "ship":
            external = dict(job.external)
            files = shipment_files(Path(job.export_dir), list(job.names), external)
            digest = digests(files)
            shipment = {"digest": digest, "refs": {name: ray.put(path.read_bytes()) for name, path in files.items()},
                        "external": shipped_external(external)}
            log(f"shipping {len(files)} model files ({sum(p.stat().st_size for p in files.values()) / 1e6:,.0f} MB) "
                "through the object store, checked against the sidecar on each node")
        log(f"ray {ray.__version__}: {len(nodes)} node(s), {cpus} CPUs; {actors} actor(s) x {job.threads} thread(s); "
            f"model files: {transfer}")
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        ds = ray.data.read_datasource(ShardSource(job), num_cpus=0).map_batches(
            ShardWorker, fn_constructor_kwargs={"job": job, "shipment": shipment, "cache": options.node_cache},
            batch_size=1, batch_format="pyarrow", num_cpus=job.threads,
            compute=ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1))
        for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for payload in block.column("payload").to_pylist():
                accept(pa.ipc.open_stream(payload).read_all())
        return {"name": "ray", "ray": ray.__version__, "address": options.address or "local (started here)",
                "nodes": len(nodes), "cluster_cpus": cpus, "actors": actors, "threads_per_actor": job.threads,
                "model_transfer": transfer}
    finally:
        if started:
            ray.shutdown()
