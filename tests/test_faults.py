"""Faults: broken exports, failing sessions, interrupted exports and unusable model folders.

Every fault is made for real on a copy of the tiny export (a file deleted, overwritten or
appended to; an export process killed; a cache tensor of the wrong shape handed to ONNX Runtime)
and observed where a user meets it: try_load_backends, the compare JSON, `python app.py`, the
start-up `prepare`, and `python -m export`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from gradio_client import Client

import app
from ui import compare_render
from backends import BACKEND_NAMES, Backend, ManifestError, SessionConfig, try_load_backends
from service import compare
from backends.manifest import MANIFEST_NAME, load_manifest, sha256_file
from conftest import REPO, free_port, wait_for
from export.__main__ import main as export_main
from export.ensure import ensure_export, leftover_partials, reusable

SENTENCE = "Click outside the spreadsheet to view the slide."
MAX_NEW = 4
SESSION = SessionConfig(threads=1)


def copy_export(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def corrupt(folder: Path, filename: str, keep_checksum: bool) -> None:
    """Overwrite a graph with garbage; with keep_checksum the sidecar is updated to match, so only
    ONNX Runtime can tell."""
    path = folder / filename
    path.write_bytes(b"this is not an ONNX graph\n" * 64)
    if keep_checksum:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        manifest["files"][filename] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


# --- a backend that cannot load ---------------------------------------------------------------


@pytest.mark.parametrize(
    "fault, backend, message",
    [
        ("missing", "ort_fp16", r"^ManifestError: .*decoder_fp16\.onnx is missing \(listed in manifest\.json\)$"),
        ("checksum", "ort_fp32_single_step", r"^ManifestError: .*full\.onnx was modified after export: sha256 .*"
         r"re-run the export$"),
        ("corrupted", "ort_int8", r"encoder_int8\.onnx"),
    ],
)  # fmt: skip
def test_a_backend_that_cannot_load_is_reported_in_its_place(tiny_export_dir, tmp_path, fault, backend, message):
    folder = copy_export(tiny_export_dir, tmp_path / "export")
    if fault == "missing":
        (folder / "decoder_fp16.onnx").unlink()
    elif fault == "checksum":
        with open(folder / "full.onnx", "ab") as f:
            f.write(b"\0")
    else:
        corrupt(folder, "encoder_int8.onnx", keep_checksum=True)
    loaded, errors = try_load_backends(folder, session=SESSION)
    assert list(errors) == [backend] and list(loaded) == [n for n in BACKEND_NAMES if n != backend]
    assert re.search(message, errors[backend]), errors[backend]
    if fault == "corrupted":  # the checksum matched: ONNX Runtime itself refused the bytes
        assert not errors[backend].startswith("ManifestError")
    out = compare(loaded, SENTENCE, max_new_tokens=MAX_NEW, load_errors=errors)
    assert list(out["backends"]) == list(BACKEND_NAMES)
    assert out["backends"][backend]["error"] == f"failed to load: {errors[backend]}"
    assert out["backends"][backend]["text"] is None
    for name in loaded:
        assert out["backends"][name]["error"] is None and len(out["backends"][name]["token_ids"]) == MAX_NEW


@pytest.mark.slow
def test_app_starts_with_the_backends_it_can_load_and_names_the_others(tiny_export_dir, tmp_path, artifacts_dir):
    """`python app.py --model EXPORT` on an export with three broken graphs serves the other two."""
    folder = copy_export(tiny_export_dir, tmp_path / "export")
    (folder / "decoder_fp16.onnx").unlink()
    with open(folder / "full.onnx", "ab") as f:
        f.write(b"\0")
    corrupt(folder, "encoder_int8.onnx", keep_checksum=True)
    port = free_port()
    log = artifacts_dir / "app-faults.log"
    env = dict(os.environ, GRADIO_SERVER_PORT=str(port), GRADIO_SERVER_NAME="127.0.0.1")
    env["GRADIO_ANALYTICS_ENABLED"] = "False"
    cmd = [sys.executable, "app.py", "--model", str(folder), "--threads", "1", "--max-new-tokens", str(MAX_NEW)]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(f"http://127.0.0.1:{port}/", proc, log, 300)
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        result = client.predict(SENTENCE, api_name="/compare")
        components = {c["props"].get("elem_id"): c["props"] for c in client.config["components"]}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    broken = ["ort_fp32_single_step", "ort_fp16", "ort_int8"]
    text = log.read_text()
    for name in broken:
        assert f"backend {name} failed to load (shown in its panel)" in text
        assert result["backends"][name]["error"].startswith("failed to load: ")
        assert "failed to load" in components[f"stats-{name}"]["value"]
    header = components["header"]["value"]
    failed = "ORT fp32 · single step, ORT fp16 · KV cache, ORT int8 · KV cache"
    assert f"2/5 backends loaded (could not load: {failed}; see their panels)" in header
    for name in ("pytorch", "ort_fp32_kv_cache"):
        assert result["backends"][name]["error"] is None and len(result["backends"][name]["token_ids"]) == MAX_NEW
    assert result["backends"]["ort_fp32_kv_cache"]["divergence"]["identical"]


def test_an_export_without_its_tokenizer_stops_the_app_naming_the_file(tiny_export_dir, tmp_path, capsys):
    folder = copy_export(tiny_export_dir, tmp_path / "export")
    (folder / "vocab.json").unlink()
    with pytest.raises(ManifestError, match=r"vocab\.json is missing"):
        try_load_backends(folder, session=SESSION)
    assert app.main(["--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"error: cannot start with model '{folder}': ManifestError: " in err and "vocab.json is missing" in err


# --- a session that fails while translating ---------------------------------------------------


class _WrongCache:
    """The real KV-cache engine, handed a self-attention cache with one head too many at one step:
    ONNX Runtime itself rejects the run, as it would a cache corrupted in memory."""

    def __init__(self, inner, step: int):
        self.inner, self.at, self.keep = inner, step, []

    def encode(self, input_ids, attention_mask):
        return self.inner.encode(input_ids, attention_mask)

    def step(self, state, decoder_ids):
        if decoder_ids.shape[1] - 1 == self.at:
            shape = (decoder_ids.shape[0], self.inner.heads + 1, self.at, self.inner.head_dim)
            wrong = np.zeros(shape, dtype=self.inner.cache_dtype)
            self.keep.append(wrong)  # an OrtValue borrows the numpy buffer
            state.past = [ort.OrtValue.ortvalue_from_numpy(wrong)] * len(state.past)
        return self.inner.step(state, decoder_ids)


def test_a_session_error_while_translating_is_shown_in_its_place(tiny_backends):
    kv = tiny_backends["ort_fp32_kv_cache"]
    broken = Backend(kv.name, _WrongCache(kv.model, step=2), kv.tokenizer, kv.manifest, dict(kv.info))
    out = compare(dict(tiny_backends, ort_fp32_kv_cache=broken), SENTENCE, max_new_tokens=MAX_NEW)
    b = out["backends"]["ort_fp32_kv_cache"]
    assert b["error"].startswith("InvalidArgument: ") and "past." in b["error"], b["error"]
    assert b["text"] is None and b["segments"] == [] and b["divergence"] is None
    for name in (n for n in BACKEND_NAMES if n != "ort_fp32_kv_cache"):
        assert out["backends"][name]["error"] is None and len(out["backends"][name]["token_ids"]) == MAX_NEW
    panel = compare_render.panel_html("ort_fp32_kv_cache", b, "", kv.info)
    assert "error: InvalidArgument" in panel
    # the same engine is fine again on the next request: a failed run leaves nothing behind
    assert compare({"ort_fp32_kv_cache": kv}, SENTENCE, max_new_tokens=MAX_NEW)["backends"]["ort_fp32_kv_cache"][
        "error"
    ] is None


# --- interrupted and tampered exports ---------------------------------------------------------


@pytest.mark.slow
def test_a_killed_export_leaves_nothing_a_later_start_trusts(tiny_model_dir, tiny_export_dir, tmp_path):
    """SIGKILL mid-export, as soon as its temporary folder exists (no clean-up can run): that
    folder is never read, and a start that finds it says so and keeps to the finished export."""
    out = tmp_path / "exports" / "tiny"
    cmd = [sys.executable, "-m", "export", str(tiny_model_dir), "--out", str(out), "--no-verify", "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while not leftover_partials(out):
            assert proc.poll() is None, "the export ended before it could be interrupted"
            assert time.monotonic() < deadline, "no partial export folder appeared"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    [partial] = leftover_partials(out)
    assert partial.name.startswith(".tiny.partial-") and not out.exists()
    ok, why = reusable(str(tiny_model_dir), out)
    assert not ok and why == f"export folder not found: {out}"
    with pytest.raises(ManifestError):
        load_manifest(partial)  # killed before its sidecar was written
    # a later start, with a finished export in place: reuses it and names the leftover, never reads it
    shutil.copytree(tiny_export_dir, out)
    said = []
    assert ensure_export(str(tiny_model_dir), out, log=said.append) == out
    assert said == [
        f"reusing {out}: checksums match",
        f"ignoring 1 unfinished export folder(s) left by an interrupted export: {partial.name}",
    ]


def test_a_complete_looking_partial_folder_is_still_not_used(tiny_model_dir, tiny_export_dir, tmp_path):
    """Killed during verification, a partial folder holds every graph and a provisional sidecar;
    only the renamed folder counts."""
    out = tmp_path / "tiny"
    copy_export(tiny_export_dir, tmp_path / ".tiny.partial-k1ll3d")
    ok, why = reusable(str(tiny_model_dir), out)
    assert not ok and why == f"export folder not found: {out}"
    assert leftover_partials(out) == [tmp_path / ".tiny.partial-k1ll3d"]


@pytest.mark.parametrize(
    "tamper, message",
    [
        ("append", r"decoder\.onnx was modified after export"),
        ("delete", r"encoder\.onnx is missing \(listed in manifest\.json\)"),
        ("replace", r"vocab\.json was modified after export"),
        ("no sidecar", r"has no manifest\.json: not a finished export"),
        ("other source", r"was exported from /somewhere/else, not "),
    ],
)
def test_an_export_whose_files_do_not_match_its_sidecar_is_not_reused(
    tiny_model_dir, tiny_export_dir, tmp_path, tamper, message
):
    out = copy_export(tiny_export_dir, tmp_path / "tiny")
    if tamper == "append":
        with open(out / "decoder.onnx", "ab") as f:
            f.write(b"\0")
    elif tamper == "delete":
        (out / "encoder.onnx").unlink()
    elif tamper == "replace":
        (out / "vocab.json").write_text(json.dumps({"<pad>": 0}))
    elif tamper == "no sidecar":
        (out / MANIFEST_NAME).unlink()
    else:
        manifest = json.loads((out / MANIFEST_NAME).read_text())
        manifest["source_model"]["path"] = "/somewhere/else"
        (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert reusable(str(tiny_model_dir), copy_export(tiny_export_dir, tmp_path / "intact")) == (
        True,
        f"reusing {tmp_path / 'intact'}: checksums match",
    )
    ok, why = reusable(str(tiny_model_dir), out)
    assert not ok and re.search(message, why), why


# --- a model folder that cannot be exported ---------------------------------------------------


def _bad_model(tiny_model_dir: Path, tmp_path: Path, kind: str) -> Path:
    folder = tmp_path / kind.replace(" ", "-")
    shutil.copytree(tiny_model_dir, folder)
    if kind == "not marian":
        config = json.loads((folder / "config.json").read_text())
        config.update(model_type="bert", architectures=["BertModel"])
        (folder / "config.json").write_text(json.dumps(config))
    elif kind == "no tokenizer":
        (folder / "source.spm").unlink()
        (folder / "vocab.json").unlink()
    elif kind == "no config":
        (folder / "config.json").unlink()
    return folder


BAD_MODELS = {
    "not marian": "unsupported architecture BertModel (model_type 'bert'); supported: MarianMTModel "
    "(model_type 'marian')",
    "no tokenizer": "lacks source.spm, vocab.json (a Marian model folder needs weights and tokenizer files)",
    "no config": "has no config.json: not a Hugging Face model folder",
}


@pytest.mark.parametrize("kind", list(BAD_MODELS))
def test_python_m_export_names_what_is_wrong_with_the_model(tiny_model_dir, tmp_path, capsys, kind):
    folder = _bad_model(tiny_model_dir, tmp_path, kind)
    out = tmp_path / "out"
    assert export_main([str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert BAD_MODELS[kind] in err, err
    assert not out.exists() and leftover_partials(out) == []


@pytest.mark.parametrize("kind", list(BAD_MODELS))
def test_app_start_names_what_is_wrong_with_the_model(tiny_model_dir, tmp_path, capsys, kind):
    folder = _bad_model(tiny_model_dir, tmp_path, kind)
    out = tmp_path / "out"
    assert app.main(["--model", str(folder), "--export-dir", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"error: cannot start with model '{folder}': SourceError: " in captured.err
    assert BAD_MODELS[kind] in captured.err, captured.err
    assert f"exporting {folder} to {out}" in captured.out  # prepare tried, found the fault, made nothing
    assert not out.exists() and leftover_partials(out) == []
