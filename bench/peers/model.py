"""What a peer knows about the model it runs: its family, its tokenizer and its languages.

The family comes from the family registry (`families.family_of` over the source folder's
config.json: the transformers class, the tokenizer classes), the languages from the export's
sidecar (`languages.src_lang` / `tgt_lang`, the target's code forced first). Stdlib only at the top:
the peer's environment runs transformers 4, the project transformers 5.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PeerModel:
    source: Path  # the model folder the export was made from: weights, config.json, tokenizer
    src_lang: str | None = None  # the tokenizer's source language code (families with codes)
    tgt_lang: str | None = None  # the target's code, forced first (or its token before the source: MADLAD-400)

    @classmethod
    def of_export(cls, manifest) -> "PeerModel":
        """The source folder and languages recorded in an export's sidecar (`backends.Manifest`)."""
        languages = manifest.languages or {}
        return cls(Path(manifest.data["source_model"].get("path") or ""), languages.get("src_lang"),
                   languages.get("tgt_lang"))

    def args(self) -> list[str]:
        """The worker's and converters' command-line options for the languages (none for Marian)."""
        return [*(["--src-lang", self.src_lang] if self.src_lang else []),
                *(["--tgt-lang", self.tgt_lang] if self.tgt_lang else [])]

    def family(self):
        from families import family_of

        config = json.loads((self.source / "config.json").read_text(encoding="utf-8"))
        return family_of(config, str(self.source))

    def tokenizer(self):
        """The family's tokenizer over the source folder, reading sources in `src_lang`."""
        from transformers import AutoTokenizer

        kwargs = {"src_lang": self.src_lang} if self.src_lang else {}
        config_path = self.source / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        if isinstance(config.get("extra_special_tokens"), list):
            # transformers 5 writes the language codes as a list under this key, which transformers 4
            # reads as a dict of named tokens; there they are additional special tokens.
            kwargs.update(extra_special_tokens={}, additional_special_tokens=config["extra_special_tokens"])
        tokenizer = AutoTokenizer.from_pretrained(str(self.source), **kwargs)
        family, name = self.family(), type(tokenizer).__name__
        if name not in family.tokenizer_classes and name.removesuffix("Fast") not in family.tokenizer_classes:
            raise ValueError(f"{self.source}: tokenizer {name} is not one of the {family.title} family's: "
                             f"{', '.join(family.tokenizer_classes)}")
        if family.target_token and self.tgt_lang:  # MADLAD-400: the target's token before every source
            from families.target_token import TargetPrefixed, source_prefix

            return TargetPrefixed(tokenizer, source_prefix(family.target_token, self.tgt_lang))
        return tokenizer

    def forced_bos(self, tokenizer) -> int | None:
        """The id generation forces first: the target language's code, None for a family without codes
        or one whose target is a token before the source."""
        if not self.tgt_lang or self.family().target_token:
            return None
        token_id = tokenizer.convert_tokens_to_ids(self.tgt_lang)
        if token_id in (None, tokenizer.unk_token_id):
            raise ValueError(f"{self.source}: the tokenizer does not know the target language {self.tgt_lang!r}")
        return token_id


def dir_bytes(path: Path, pattern: str = "*") -> int:
    return sum(f.stat().st_size for f in Path(path).glob(pattern) if f.is_file())


def versions(*packages: str) -> dict[str, str]:
    """The installed version of each package that is installed."""
    from importlib import metadata

    out = {}
    for p in packages:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return out
