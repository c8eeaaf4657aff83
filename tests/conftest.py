"""Session fixtures: a tiny random Marian model built from the corpus, exported once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from corpus import DEV_TSV, TRAIN_TSV, dev_sentences  # noqa: F401  (tests import dev_sentences from here)

REPO = Path(__file__).resolve().parent.parent
EMBEDDED_MODEL = REPO / "assets" / "marian-en-zh-small"

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Kept after the run (screenshots, logs): test-artifacts/ in the repo, ignored by git."""
    path = REPO / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from export.fixtures import build

    return build("tiny", tmp_path_factory.mktemp("models") / "tiny", corpus=TRAIN_TSV)


@pytest.fixture(scope="session")
def tiny_export_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from export.pipeline import ExportOptions, export

    out = tmp_path_factory.mktemp("exports") / "tiny"
    return export(str(tiny_model_dir), ExportOptions(out=out, threads=2), log=lambda *a, **k: None)


@pytest.fixture(scope="session")
def peer_cache(tmp_path_factory) -> Path:
    """One folder of the peers' conversions (bench.peers.prepare) for the run: a conversion of the
    tiny fixture is made once and reused by every test that asks for it (each costs 8-10 s)."""
    return tmp_path_factory.mktemp("peers")


@pytest.fixture(scope="session")
def tiny_backends(tiny_export_dir):
    from backends import SessionConfig, load_backends

    return load_backends(tiny_export_dir, session=SessionConfig(threads=2))
