"""Where the peers run from: the registry (`runtime/peers.py`), the peer environment and the
folder their conversions are cached in."""

from __future__ import annotations

from pathlib import Path

from runtime.peers import IN_PROJECT_ENV, PEER_NAMES, PEERS, PeerSpec, is_ct2
from runtime.spec import expect_one_of

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_PEER_PYTHON = REPO / ".venv-bench" / "bin" / "python"
PEER_CACHE = REPO / "exports" / "peers"


def peer(name: str) -> PeerSpec:
    """The entry for `name`; ValueError naming the peers when there is none."""
    expect_one_of("peer", name, PEER_NAMES)
    return PEERS[name]


__all__ = ["DEFAULT_PEER_PYTHON", "IN_PROJECT_ENV", "PEERS", "PEER_CACHE", "PEER_NAMES", "PeerSpec", "is_ct2", "peer"]
