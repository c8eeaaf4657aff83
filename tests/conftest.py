"""Session fixtures: a tiny random Marian model built from the corpus, exported once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO.parent / "shared" / "corpus"
EMBEDDED_MODEL = REPO / "assets" / "marian-en-zh-small"

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def dev_sentences(count: int) -> list[str]:
    """The first `count` English sentences of the shared dev set."""
    rows = []
    with (CORPUS / "dev.tsv").open(encoding="utf-8") as f:
        next(f)
        for line in f:
            rows.append(line.rstrip("\n").split("\t")[1])
    return rows[:count]


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Kept after the run (screenshots, logs): test-artifacts/ in the repo, ignored by git."""
    path = REPO / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from export.fixtures import build

    return build("tiny", tmp_path_factory.mktemp("models") / "tiny", corpus=CORPUS)


@pytest.fixture(scope="session")
def tiny_export_dir(tiny_model_dir, tmp_path_factory) -> Path:
    from export.pipeline import ExportOptions, export

    out = tmp_path_factory.mktemp("exports") / "tiny"
    return export(str(tiny_model_dir), ExportOptions(out=out, corpus=CORPUS, threads=2), log=lambda *a, **k: None)


@pytest.fixture(scope="session")
def tiny_backends(tiny_export_dir):
    from backends import SessionConfig, load_backends

    return load_backends(tiny_export_dir, session=SessionConfig(threads=2))
