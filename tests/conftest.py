"""Session fixtures and the test tiers.

Built artefacts (fixture models, their exports, the embedded model's export) are made once and
kept under test-artifacts/cache/, each in a folder named by a hash of everything it is made from:
the product code an export runs (every module outside tests/, ui/, bench/ and app.py), data/, the
installed versions of the libraries that trace, convert and run it, the recipe (the fixture code
and its options) and its inputs. A change to any of them gives a new folder, so a stale artefact is
never reused; a folder whose files changed after it was sealed is built again.

Tiers (markers registered in pyproject.toml): `slow`, `browser`, `peers`, `ray`. A test is `slow`
when it is marked so or uses a fixture listed in SLOW_FIXTURES; `make test-fast` runs the rest.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest
from filelock import FileLock

from corpus import DEV_TSV, TRAIN_TSV, dev_sentences  # noqa: F401  (tests import these from here)

REPO = Path(__file__).resolve().parent.parent
EMBEDDED_MODEL = REPO / "assets" / "marian-en-zh-small"
CACHE = REPO / "test-artifacts" / "cache"

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

# --- the cache of built artefacts ------------------------------------------------------------------

# Folders whose code never runs in an export or a fixture build (and the repository's outputs).
NOT_EXPORT_CODE = {"tests", "ui", "bench", "docs", "assets", "exports", "runs", "build", "test-artifacts",
                   "bench-results"}
LIBRARIES = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "onnxconverter-common",
             "numpy", "sentencepiece", "tokenizers", "safetensors", "protobuf")
SEAL = ".sealed.json"


def _digest_files(paths, root: Path, h) -> None:
    for path in sorted(paths):
        h.update(str(path.relative_to(root)).encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())


def _export_code_files() -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(REPO):
        here = Path(folder)
        if here == REPO:
            dirs[:] = [d for d in dirs if d not in NOT_EXPORT_CODE and not d.startswith(".")]
            names = [n for n in names if n != "app.py" and n != "conftest.py"]
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        files += [here / n for n in names if n.endswith((".py", ".c"))]  # rows.c scores the export check's decodes
    return files


_BASE_KEY: str | None = None


def _base_key() -> str:
    """The part of every key that is the same for the whole session: code, data, library versions."""
    global _BASE_KEY
    if _BASE_KEY is None:
        h = hashlib.sha256()
        _digest_files(_export_code_files(), REPO, h)
        _digest_files([p for p in (REPO / "data").rglob("*") if p.is_file()], REPO, h)
        for name in LIBRARIES:
            try:
                h.update(f"{name}=={metadata.version(name)}".encode())
            except metadata.PackageNotFoundError:
                h.update(f"{name} absent".encode())
        _BASE_KEY = h.hexdigest()
    return _BASE_KEY


def _recipe_part(value) -> str:
    if isinstance(value, functools.partial):
        return "".join(_recipe_part(v) for v in (value.func, *value.args, *sorted(value.keywords.items())))
    if callable(value):  # a function: its source, so editing the recipe changes the key
        return inspect.getsource(value)
    if isinstance(value, Path) and value.is_dir():  # an input folder: its content
        h = hashlib.sha256()
        _digest_files([p for p in value.rglob("*") if p.is_file()], value, h)
        return f"{value}:{h.hexdigest()}"
    return repr(value)


def _files(folder: Path) -> dict[str, list[int]]:
    return {str(p.relative_to(folder)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != SEAL}


def _intact(folder: Path) -> bool:
    seal = folder / SEAL
    return seal.is_file() and json.loads(seal.read_text()) == _files(folder)


_BUILT: dict[str, Path] = {}


def cached(name: str, make: Callable[[Path], None], *recipe) -> Path:
    """The folder `make(folder)` fills, built once for this key (across sessions, under a file lock).

    `recipe` is everything else the result depends on: functions (their source counts), options,
    input folders (their content counts) and the paths of other cached folders (their key counts).
    `make` writes into the final folder itself, since exports record their source model's path."""
    h = hashlib.sha256(_base_key().encode())
    for part in (name, make, *recipe):
        h.update(_recipe_part(part).encode())
    folder = CACHE / f"{name}-{h.hexdigest()[:16]}"
    if str(folder) in _BUILT:
        return folder
    CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not _intact(folder):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                make(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            (folder / SEAL).write_text(json.dumps(_files(folder)))
            for old in CACHE.iterdir():  # this artefact's earlier keys: stale now
                if old.is_dir() and old != folder and re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{16}}", old.name):
                    shutil.rmtree(old, ignore_errors=True)
                    Path(str(old) + ".lock").unlink(missing_ok=True)
    _BUILT[str(folder)] = folder
    return folder


def quiet(*args, **kwargs) -> None:
    pass


# --- session fixtures ---------------------------------------------------------------------------------


@pytest.fixture(params=["compiled", "numpy"])
def row_kernels(request, monkeypatch) -> str:
    """Runs a test once with each implementation of the scoring's row passes (backends/native.py):
    the compiled one must load wherever a C compiler exists."""
    from backends import native

    if request.param == "numpy":
        monkeypatch.setenv(native.ENV, "numpy")
    else:
        monkeypatch.delenv(native.ENV, raising=False)
    native.reset()
    if request.param == "compiled" and native.library() is None:
        if native.why_not().startswith("no C compiler"):
            pytest.skip(native.why_not())
        pytest.fail(f"the compiled row passes did not load: {native.why_not()}")
    yield request.param
    native.reset()


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """Kept after the run (screenshots, logs): test-artifacts/ in the repo, ignored by git."""
    path = REPO / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


def _make_tiny(folder: Path) -> None:
    from export.fixtures import build
    from export.pipeline import ExportOptions, export

    build("tiny", folder / "models" / "tiny", corpus=TRAIN_TSV)
    export(str(folder / "models" / "tiny"), ExportOptions(out=folder / "exports" / "tiny", threads=2), log=quiet)


@pytest.fixture(scope="session")
def tiny_folder() -> Path:
    """The tiny random Marian model built from the corpus (models/tiny) and its verified export (exports/tiny)."""
    return cached("tiny", _make_tiny)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_folder) -> Path:
    return tiny_folder / "models" / "tiny"


@pytest.fixture(scope="session")
def tiny_export_dir(tiny_folder) -> Path:
    return tiny_folder / "exports" / "tiny"


def _make_embedded(folder: Path) -> None:
    from export.pipeline import ExportOptions, export

    export(str(EMBEDDED_MODEL), ExportOptions(out=folder / EMBEDDED_MODEL.name, threads=2), log=quiet)


@pytest.fixture(scope="session")
def embedded_export_dir() -> Path:
    """The embedded model's export, made as `python app.py --threads 2` makes it (so the app tests
    start the app on it with --export-dir, and it reuses it), shared with the beam tests."""
    if not (EMBEDDED_MODEL / "config.json").is_file():
        pytest.skip("assets/marian-en-zh-small is not in this checkout")
    return cached("embedded", _make_embedded, EMBEDDED_MODEL) / EMBEDDED_MODEL.name


@pytest.fixture(scope="session")
def peer_cache(tmp_path_factory) -> Path:
    """One folder of the peers' conversions (bench.peers.prepare) for the run: a conversion of the
    tiny fixture is made once and reused by every test that asks for it (each costs 8-10 s)."""
    return tmp_path_factory.mktemp("peers")


@pytest.fixture(scope="session")
def tiny_backends(tiny_export_dir):
    from backends import SessionConfig, load_backends

    return load_backends(tiny_export_dir, session=SessionConfig(threads=2))


# --- the app under test: one process for the session ------------------------------------------------

TINY_MAX_NEW_TOKENS = 24  # the tiny random model rarely stops by itself; a trained one does
QUEUE_SIZE = 2  # small on purpose, so the busy test can fill it
START_TIMEOUT_S = 900  # generous: a loaded machine can take minutes to load five backends


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"app exited with {proc.returncode} before serving; log:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"app did not serve {url} within {timeout} s; log:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def app_model(request) -> Path:
    """What the app under test serves: the embedded model if present, else the tiny export."""
    if (EMBEDDED_MODEL / "config.json").is_file():
        return EMBEDDED_MODEL
    return request.getfixturevalue("tiny_export_dir")


@pytest.fixture(scope="session")
def app_args(app_model, request) -> list[str]:
    """The model arguments of every `python app.py` the tests start: the embedded model with the
    session's export of it (reused, not exported again), or the tiny export."""
    if app_model == EMBEDDED_MODEL:
        return ["--model", str(app_model), "--export-dir", str(request.getfixturevalue("embedded_export_dir"))]
    return ["--model", str(app_model), "--max-new-tokens", str(TINY_MAX_NEW_TOKENS)]


@pytest.fixture(scope="session")
def app_url(app_args, artifacts_dir):
    """`python app.py --model ...` on a free port, as a user starts it; one for the session (the app
    and browser tests share it), stopped at its end."""
    port = free_port()
    log = artifacts_dir / "app.log"
    env = dict(os.environ, GRADIO_SERVER_PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1")
    env["GRADIO_ANALYTICS_ENABLED"] = "False"
    cmd = [sys.executable, "app.py", *app_args, "--queue-size", str(QUEUE_SIZE), "--threads", "2"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(url, proc, log, START_TIMEOUT_S)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


# --- tiers ----------------------------------------------------------------------------------------------

# A test that uses one of these fixtures is in that tier. `slow`: an export other than the tiny one,
# an app process, a full benchmark or corpus run (tens of seconds or more each); tests as costly on
# their own carry @pytest.mark.slow.
TIER_FIXTURES = {
    "slow": {"app_url", "launched", "embedded_export_dir", "peaked_export_dir", "family_folders",
             "external_export_dir", "optimum_dir", "family", "peer_cache", "ray_local", "local_run", "speed_run", "beam_run"},
    "browser": {"page"},
    "peers": {"optimum_dir", "family", "peer_cache"},
    "ray": {"ray_local"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in TIER_FIXTURES.items():
            if used & fixtures:
                item.add_marker(marker)
