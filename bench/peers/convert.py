"""The parent's side: each peer's conversion of the source model, made once and reused.

`python -m bench speed --peers` runs these converters with the peer environment's tools into
`exports/peers/<export name>/`; a conversion is reused while its stamp (source folder, weights
size and mtime, recipe) matches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from .ct2 import CT2_RECIPE
from .model import PeerModel
from .specs import PEERS, REPO, peer as peer_spec

# A CTranslate2 conversion of another family than Marian also takes its decoder start from the
# config (bench/peers/ct2_convert.py); Marian's recipe string stays, so its conversions are reused.
CT2_RECIPE_FAMILIES = CT2_RECIPE + "; decoder start from decoder_start_token_id"


def _converted(out: Path, stamp: dict) -> bool:
    f = out / "bench-stamp.json"
    return f.is_file() and json.loads(f.read_text()) == stamp


def _convert(cmd: list[str], out: Path, stamp: dict, log) -> float:
    """Run one converter into a temporary sibling, rename into place; returns seconds."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"converting: {' '.join(map(str, cmd))}")
    start = time.perf_counter()
    proc = subprocess.run([*map(str, cmd[:-1]), str(tmp)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    seconds = time.perf_counter() - start
    (tmp / "bench-stamp.json").write_text(json.dumps(stamp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return seconds


def _command(name: str, source: Path, out: Path, peer_python: Path, start: str | None) -> list:
    """The converter's command line for peer `name`, its output folder last; `start`: the folder of
    the conversion it starts from (PeerSpec.converted_from)."""
    library, bindir = PEERS[name].library, Path(peer_python).parent
    if library == "optimum" and PEERS[name].converted_from is None:
        return [bindir / "optimum-cli", "export", "onnx", "--model", source, "--task", "text2text-generation-with-past", out]
    if library == "optimum":  # quantizes the fp32 export
        return [peer_python, "-m", "bench.peers", "quantize", "--src", start, "--out", out]
    if library == "ctranslate2":
        return [peer_python, "-m", "bench.peers", "ct2-convert", "--model", source, "--quantization",
                PEERS[name].name.split("_")[1], "--output_dir", out]
    raise ValueError(f"peer {name} ({library}) reads the source folder; it has no converter")


def prepare(source: Path, root: Path, peers: list[str], peer_python: Path, log=print) -> dict[str, dict]:
    """Convert `source` (the export's model folder) for each peer once, under `root`.

    Returns {peer: {"dir", "convert_s" or "reused"}} or {peer: {"error"}} when its conversion failed.
    """
    weights = next((source / n for n in ("model.safetensors", "pytorch_model.bin") if (source / n).is_file()), None)
    if weights is None:
        raise FileNotFoundError(f"{source}: no model.safetensors or pytorch_model.bin for the peers to convert")
    st = weights.stat()
    stamp = {"source": str(source.resolve()), "weights_bytes": st.st_size, "weights_mtime": st.st_mtime}
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    prepared = {}
    for name in peers:
        spec = peer_spec(name)
        if spec.converted_into is None:
            prepared[name] = {"dir": str(source), "reused": True}
            continue
        start = None
        if spec.converted_from is not None:  # its starting point, made first if needed
            first = prepared.get(spec.converted_from) or prepare(source, root, [spec.converted_from], peer_python,
                                                                 log)[spec.converted_from]
            if "error" in first:
                base = PEERS[spec.converted_from]
                prepared[name] = {"error": f"needs the {base.precision} {base.library.title()} export, which failed: "
                                           f"{first['error']}"}
                continue
            start = first["dir"]
        out = root / spec.converted_into
        cmd = _command(name, source, out, peer_python, start)
        if spec.library == "ctranslate2":  # conversions made by an older recipe (the stock ct2 CLI) are redone
            marian = PeerModel(source).family().name == "marian"
            peer_stamp = {**stamp, "recipe": CT2_RECIPE if marian else CT2_RECIPE_FAMILIES}
        else:
            peer_stamp = stamp
        if _converted(out, peer_stamp):
            prepared[name] = {"dir": str(out), "reused": True}
            continue
        try:
            prepared[name] = {"dir": str(out), "convert_s": round(_convert(cmd, out, peer_stamp, log), 1)}
        except (OSError, RuntimeError) as e:  # reported per peer; the other peers still run
            prepared[name] = {"error": f"conversion failed: {e}"}
    return prepared
