"""What app.py prepared at start and every tab reads: the loaded backends and the request limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends import BACKEND_NAMES
from service import RequestLimits

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Loaded:
    """What main() prepared: the backends that loaded and why the others did not."""

    backends: dict[str, Any]
    load_errors: dict[str, str] = field(default_factory=dict)
    model: str = ""
    export_dir: Path | None = None
    export_note: str = ""
    max_new_tokens: int | None = None
    examples: list[str] = field(default_factory=list)
    results_dir: Path = REPO / "bench-results"  # the Benchmark tab's reports: read, and quick runs saved
    limits: RequestLimits = RequestLimits()  # characters, segments and seconds per backend of one request

    @property
    def names(self) -> list[str]:
        return [n for n in BACKEND_NAMES if n in self.backends or n in self.load_errors]
