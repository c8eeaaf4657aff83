"""The parent's side: the peers' worker commands for one speed run, after their conversions."""

from __future__ import annotations

import sys
from pathlib import Path

from bench.decoding import decode_args

from .convert import prepare
from .model import PeerModel
from .specs import PEERS, is_ct2


def peer_jobs(manifest, export_dir: Path, peer_names: list[str], peer_python: Path, peer_cache: Path,
              decoding: dict, log) -> tuple[list[tuple[str, list[str], dict]], dict[str, str]]:
    """([(peer, worker command without --spec/--out, extra result fields)], {peer: why it cannot run}).

    Each peer is converted from the export's source folder (made once, `convert.prepare`) and told
    the export's languages (`PeerModel.of_export`); a peer whose environment or conversion is
    missing is reported, and the others still run."""
    model = PeerModel.of_export(manifest)
    failed: dict[str, str] = {}
    prepared = {}
    if not model.source.is_dir():
        failed.update({p: f"the source model folder {model.source} is gone; the peers convert from it" for p in peer_names})
    else:
        runnable = list(peer_names)
        if not Path(peer_python).is_file():
            missing = [p for p in peer_names if PEERS[p].environment != "project"]
            failed.update({p: f"{peer_python} not found: create the peer environment with `make bench-venv`"
                           for p in missing})
            runnable = [p for p in peer_names if p not in missing]
        prepared = prepare(model.source, Path(peer_cache) / Path(export_dir).name, runnable, Path(peer_python), log=log)
    for name in [n for n, p in prepared.items() if "error" in p]:
        failed[name] = prepared.pop(name)["error"]
        log(f"{name}: {failed[name].splitlines()[0]}")
    jobs = []
    for name, prep in prepared.items():
        python = sys.executable if PEERS[name].environment == "project" else str(peer_python)
        cmd = [python, "-m", "bench.peers", "worker", "--peer", name, "--model-dir", prep["dir"],
               "--source", str(model.source), *model.args(), *decode_args(decoding, ct2=is_ct2(name))]
        jobs.append((name, cmd, {"conversion": {k: v for k, v in prep.items() if k != "dir"}, "command": cmd}))
    return jobs, failed
