"""The export on every node: used in place where the path is shared, else shipped once per node.

`shipment_files` lists what the chosen backends read: the sidecar, the tokenizer files it lists, each
backend's graphs (and external data), for `pytorch` the source model's config and weights, and for
each external export (`--external NAME=DIR`) every file its backend reads (`ort_external.files_read`),
under `external/NAME/` as laid out in its folder (`shipped_external` says where each is on a node).
The Ray engine puts each file in Ray's object store once; on each node the first actor writes them
under the node cache (`materialize`, under a file lock, so the other actors on that node wait and
reuse the copy), checks every file against the sidecar (`Manifest.verify_file` for the export's
files; the source weights against `source_model.weights_sha256`; the sidecar itself and the source
config and the external exports' files against the digests the driver sent) and only then marks the
copy ready. The copy's
sidecar is the original with `source_model.path` pointing at the copied source folder. No Ray
here: `fetch(name) -> bytes` is whatever brings a file's bytes.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from backends.manifest import MANIFEST_NAME, ManifestError, load_manifest, sha256_file
from backends.registry import GRAPHS

SOURCE_FILES = ("config.json", "generation_config.json")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def _external_layout(path: str):
    from backends.ort_external import find_layout

    layout = find_layout(path)
    return layout, Path(path).relative_to(layout.meta)  # the folder or encoder file given, within what is shipped


def shipped_external(external: dict[str, str]) -> dict[str, str]:
    """{NAME: where its --external DIR is in a shipment ("external/NAME/…")}: the path to load on a node,
    relative to the shipment's root."""
    return {name: str(Path("external", name, _external_layout(path)[1])) for name, path in external.items()}


def shipment_files(export_dir: Path, names: list[str], external: dict[str, str] | None = None) -> dict[str, Path]:
    """{name in the shipment ("export/…", "source/…", "external/NAME/…"): file on this machine} for these
    backends and external exports ({NAME: DIR}, absolute paths)."""
    manifest = load_manifest(export_dir)
    files = {f"export/{MANIFEST_NAME}": Path(export_dir) / MANIFEST_NAME}
    listed = list(manifest.tokenizer_files)  # the sidecar's own list: Marian's spm files, NLLB's tokenizer.json, ...
    for name in names:
        for graph in GRAPHS.get(name, ()):
            entry = manifest.graph(graph)
            listed += [entry["file"], *entry.get("external_data", [])]
    files.update({f"export/{f}": Path(export_dir) / f for f in dict.fromkeys(listed)})
    if "pytorch" in names:
        from backends.pytorch import source_model_of

        source = Path(source_model_of(manifest))
        if not source.is_dir():
            raise FileNotFoundError(f"the pytorch backend needs the source model folder {source} to ship it")
        weights = [w for w in WEIGHTS if (source / w).is_file()][:1]
        if not weights:
            raise FileNotFoundError(f"{source} has none of {', '.join(WEIGHTS)}")
        files.update({f"source/{f}": source / f for f in (*SOURCE_FILES, *weights) if (source / f).is_file()})
    from backends.ort_external import files_read

    for name, path in (external or {}).items():
        layout, _ = _external_layout(path)
        # Missing files are left to the node's load, whose check names every one (config, tokenizer, graphs).
        files.update({f"external/{name}/{f.relative_to(layout.meta)}": f
                      for f in files_read(layout, manifest) if f.is_file()})
    return files


def digests(files: dict[str, Path]) -> dict[str, str]:
    return {name: sha256_file(path) for name, path in files.items()}


def shipment_key(digest: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()[:20]


def _check(root: Path, digest: dict[str, str]) -> int:
    """Every shipped file against the sidecar (or the driver's digest where the sidecar has none)."""
    export = root / "export"
    if sha256_file(export / MANIFEST_NAME) != digest[f"export/{MANIFEST_NAME}"]:
        raise ManifestError(f"{export / MANIFEST_NAME}: the shipped sidecar differs from the driver's")
    manifest = load_manifest(export)
    recorded = manifest.data["source_model"].get("weights_sha256")
    for name in digest:
        where, filename = name.split("/", 1)
        if where == "export":
            if filename != MANIFEST_NAME:  # the sidecar itself was checked above
                manifest.verify_file(filename)
        elif where == "source":
            expected = recorded if filename in WEIGHTS and recorded else digest[name]
            if sha256_file(root / name) != expected:
                raise ManifestError(f"{root / name}: sha256 differs from the one recorded for the source model")
        elif where == "external":
            if sha256_file(root / name) != digest[name]:
                raise ManifestError(f"{root / name}: sha256 differs from the external export's file on the driver")
        else:
            raise ManifestError(f"{name}: not a shipment file (export/, source/ or external/)")
    return len(digest)


def materialize(cache: Path, digest: dict[str, str], fetch: Callable[[str], bytes]) -> tuple[Path, dict]:
    """The export folder of this shipment on this node: written and checked once, then reused."""
    root = Path(cache) / shipment_key(digest)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other actors wait for the first one's copy
        if (root / "ready").is_file():
            return root / "export", {"mode": "ship", "path": str(root / "export"), "written_here": False}
        shutil.rmtree(root, ignore_errors=True)  # a copy that never became ready
        for name in digest:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(fetch(name))
        checked = _check(root, digest)
        sidecar = json.loads((root / "export" / MANIFEST_NAME).read_text(encoding="utf-8"))
        if any(n.startswith("source/") for n in digest):
            sidecar["source_model"]["path"] = str(root / "source")
            (root / "export" / MANIFEST_NAME).write_text(json.dumps(sidecar, indent=2), encoding="utf-8")
        (root / "ready").write_text(f"{checked} files checked by process {os.getpid()}\n")
    return root / "export", {"mode": "ship", "path": str(root / "export"), "written_here": True, "checked": checked}
