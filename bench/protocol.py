"""The measurement protocol (service/protocol.py) as the measuring subprocesses import it.

`python -m bench.worker` (one of our backends) and `python -m bench.peers worker` (a peer, in
.venv-bench) each time one runtime's imports, loading and memory alone in their process.
`from service.protocol import ...` would first run service/__init__.py, which imports backends
and ONNX Runtime: a CTranslate2 peer would then carry ONNX Runtime in its peak memory, our workers
would import it before their timed `import_s`, and .venv-bench (transformers 4) is not meant to
import backends at all. So the file, stdlib and numpy only, is loaded here by path under its own
name `service.protocol`: one module per process, the very one `from service.protocol import ...`
then finds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

NAME = "service.protocol"
PATH = Path(__file__).resolve().parent.parent / "service" / "protocol.py"


def _load():
    if NAME in sys.modules:  # imported already: the app's process, or `python -m bench`'s own
        return sys.modules[NAME]
    spec = importlib.util.spec_from_file_location(NAME, PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module  # before it runs: its dataclasses look their module up there
    spec.loader.exec_module(module)
    if "service" in sys.modules:
        sys.modules["service"].protocol = module
    return module


_protocol = _load()
BackendRuntime, Output, Spec = _protocol.BackendRuntime, _protocol.Output, _protocol.Spec
measure, percentiles, peak_rss_mb, rss_mb = _protocol.measure, _protocol.percentiles, _protocol.peak_rss_mb, _protocol.rss_mb
reset_peak_rss = _protocol.reset_peak_rss

__all__ = ["BackendRuntime", "Output", "Spec", "measure", "peak_rss_mb", "percentiles", "reset_peak_rss", "rss_mb"]
