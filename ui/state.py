"""What app.py prepared at start and every tab reads: the loaded backends and the request limits."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends import BACKEND_NAMES, ManifestError, load_manifest
from families import family_named
from service import RequestLimits
from service.batcher import BatchPolicy
from service.translate import MAX_REQUESTS, Traffic

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
    # shown by the Benchmark tab while results_dir has no report; measured elsewhere (None: none shipped)
    reference_results: Path | None = REPO / "assets" / "reference-results.json"
    limits: RequestLimits = RequestLimits()  # characters, segments and seconds per backend of one request
    traffic: Traffic = field(default_factory=Traffic)  # translate decodes, so Compare's timings can say they overlapped
    batching: BatchPolicy = BatchPolicy(MAX_REQUESTS)  # how the translate endpoint's requests are batched
    # The translate requests' batcher (service.translate.translate_batcher), shared by the Gradio API
    # and the HTTP route; app.build_app makes it when None.
    translator: Any = None

    @property
    def names(self) -> list[str]:
        built_in = [n for n in BACKEND_NAMES if n in self.backends or n in self.load_errors]
        # --external NAME=DIR backends: after the built-in ones, in the order they were given
        external = [n for n in [*self.backends, *self.load_errors] if n not in BACKEND_NAMES]
        return built_in + list(dict.fromkeys(external))

    @property
    def manifest(self):
        """The served export's sidecar: a loaded backend's (with the --src-lang/--tgt-lang the
        backends were loaded with), else the export folder's own; None when neither is readable."""
        for backend in self.backends.values():
            return backend.manifest
        if self.export_dir is not None:
            try:
                return load_manifest(self.export_dir)
            except (ManifestError, OSError, ValueError):
                return None
        return None


def model_heading(manifest) -> str:
    """"NLLB-200 eng_Latn→zho_Hans", "mBART-50 en_XX→zh_CN", "Marian en→zh": the model's published
    name (its family's label for its tokenizer class) and the languages the backends translate
    between. The codes come from the sidecar (after any override); a model without codes has one
    pair, which its tokenizer_config.json names (source_lang/target_lang). Without a sidecar: "Model"."""
    if manifest is None:
        return "Model"
    family = family_named(manifest.family)
    label = family.label_for(manifest.tokenizer_class) if family is not None else manifest.family
    languages = manifest.languages
    if languages:
        # A target named by a token before the source (MADLAD-400): the model reads any source language.
        return f"{label} {languages['src_lang'] or 'any'}→{languages['tgt_lang']}"
    try:
        config = json.loads((Path(manifest.root) / "tokenizer_config.json").read_text(encoding="utf-8"))
        pair = config.get("source_lang"), config.get("target_lang")
    except (OSError, ValueError):
        pair = None, None
    return f"{label} {pair[0]}→{pair[1]}" if all(pair) else label
