"""Reuse an export when it is intact and comes from the same source, else export again.

Used at app start: the first start exports the embedded model, later starts reuse it as long as
every checksum in the sidecar matches, the source weights and generation config are the ones it
was made from, and the sidecar's format is this version's (an older export is made again).
"""

from __future__ import annotations

from pathlib import Path

from backends.manifest import ManifestError, generation_source_file, load_manifest, sha256_file

from .pipeline import ExportOptions, export


def _weights_digest(src: Path) -> str | None:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (src / name).is_file():
            return sha256_file(src / name)
    return None


def reusable(src: str, out: Path) -> tuple[bool, str]:
    """(True, why) when `out` is a finished, unmodified export of `src`."""
    try:
        manifest = load_manifest(out)
        for filename in manifest.data["files"]:
            manifest.verify_file(filename)
    except ManifestError as e:
        return False, str(e)
    source = manifest.data["source_model"]
    local = Path(src)
    if local.exists():
        if source.get("path") != str(local.resolve()):
            return False, f"{out} was exported from {source.get('path') or source.get('hub_id')}, not {src}"
        if source.get("weights_sha256") != _weights_digest(local):
            return False, f"the weights in {src} changed since {out} was exported"
        recorded = manifest.data["generation"]["source"]  # the file the decoding defaults came from
        now = generation_source_file(local)
        if recorded is not None and (
            not now.is_file() or now.name != recorded["file"] or sha256_file(now) != recorded["sha256"]
        ):
            return False, f"the generation config in {src} ({now.name}) changed since {out} was exported"
    elif source.get("hub_id") != src:
        return False, f"{out} was exported from {source.get('path') or source.get('hub_id')}, not {src}"
    return True, f"reusing {out}: checksums match"


def leftover_partials(out: Path) -> list[Path]:
    """Temp folders of exports to `out` that never finished (the process was killed before it
    could clean up). Never read: an export only counts once renamed to `out`. Not deleted here
    either, since another process may be exporting into one right now."""
    return sorted(Path(out).parent.glob(f".{Path(out).name}.partial-*"))


def ensure_export(src: str, out: Path, log=print, **options) -> Path:
    ok, why = reusable(src, Path(out))
    log(why if ok else f"exporting {src} to {out} ({why})")
    leftovers = leftover_partials(Path(out))
    if leftovers:
        names = ", ".join(p.name for p in leftovers)
        log(f"ignoring {len(leftovers)} unfinished export folder(s) left by an interrupted export: {names}")
    if ok:
        return Path(out)
    return export(src, ExportOptions(out=Path(out), force=True, **options), log=log)
