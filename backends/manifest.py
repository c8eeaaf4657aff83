"""The export sidecar (`manifest.json`): the one contract between `export/` and the backends.

Backends read nothing else to start: graph files and their inputs/outputs, special ids, limits,
checksums. `load_manifest` validates it once and raises errors that say what is wrong and where.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT = "marian-onnx-export"
FORMAT_VERSION = 2  # 2: tied output layer stored pre-transposed, int8 embeddings (export/rewrite.py)
GRAPH_NAMES = ("full", "encoder", "decoder", "encoder_fp16", "decoder_fp16", "encoder_int8", "decoder_int8")
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json")


class ManifestError(ValueError):
    """The export folder cannot be trusted: missing, malformed, modified or failed verification."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class SpecialTokens:
    pad: int
    eos: int
    unk: int
    decoder_start: int
    bad_words_ids: tuple[int, ...]  # single-token bad words only; masked at every step


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict[str, Any]

    @property
    def special(self) -> SpecialTokens:
        s = self.data["special_tokens"]
        return SpecialTokens(
            pad=s["pad"],
            eos=s["eos"],
            unk=s["unk"],
            decoder_start=s["decoder_start"],
            bad_words_ids=tuple(ids[0] for ids in s["bad_words_ids"] if len(ids) == 1),
        )

    @property
    def max_source_tokens(self) -> int:
        return int(self.data["limits"]["max_source_tokens"])

    @property
    def max_new_tokens(self) -> int:
        return int(self.data["limits"]["max_new_tokens"])

    @property
    def vocab_size(self) -> int:
        return int(self.data["model"]["vocab_size"])

    def graph(self, name: str) -> dict[str, Any]:
        graphs = self.data["graphs"]
        if name not in graphs:
            raise ManifestError(f"{self.root}: no graph {name!r}; this export has: {', '.join(graphs)}")
        return graphs[name]

    def graph_path(self, name: str) -> Path:
        return self.root / self.graph(name)["file"]

    def verify_file(self, filename: str) -> None:
        """Raise if `filename` is missing or its sha256 differs from the one recorded at export."""
        files = self.data["files"]
        if filename not in files:
            raise ManifestError(f"{self.root}: {filename} is not listed in {MANIFEST_NAME}")
        path = self.root / filename
        if not path.is_file():
            raise ManifestError(f"{path} is missing (listed in {MANIFEST_NAME})")
        actual = sha256_file(path)
        expected = files[filename]["sha256"]
        if actual != expected:
            raise ManifestError(
                f"{path} was modified after export: sha256 {actual[:12]}… but {MANIFEST_NAME} "
                f"records {expected[:12]}…; re-run the export"
            )

    def verify_graph(self, name: str) -> Path:
        """Checksum a graph file and its external-data file, if any; return its path."""
        graph = self.graph(name)
        for filename in [graph["file"], *graph.get("external_data", [])]:
            self.verify_file(filename)
        return self.graph_path(name)

    def verify_tokenizer(self) -> None:
        for filename in TOKENIZER_FILES:
            self.verify_file(filename)


def load_manifest(export_dir: str | Path) -> Manifest:
    root = Path(export_dir)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise ManifestError(f"export folder not found: {root}")
    if not path.is_file():
        raise ManifestError(
            f"{root} has no {MANIFEST_NAME}: not a finished export (run `python -m export SRC --out {root}`)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from e
    if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"{path}: format {data.get('format')!r} v{data.get('format_version')!r}, "
            f"expected {FORMAT!r} v{FORMAT_VERSION}"
        )
    missing = [k for k in ("model", "special_tokens", "limits", "graphs", "files", "verification") if k not in data]
    if missing:
        raise ManifestError(f"{path} lacks: {', '.join(missing)}")
    verification = data["verification"]
    if verification is not None and not verification.get("fp32_passed", False):
        raise ManifestError(f"{path}: this export failed its fp32 verification; re-export before using it")
    return Manifest(root=root, data=data)
