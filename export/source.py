"""Find, validate and load the source model: a local HF folder or a hub id, of a family in the
registry (`families/`), with a tokenizer that matches its vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

from families import Family, UnsupportedArchitecture, default_languages, family_of, supported
from families.target_token import TargetPrefixed, source_prefix, target_codes

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class SourceError(ValueError):
    """The source model cannot be exported; the message names what is missing or unsupported."""


def check_local_folder(folder: Path) -> dict:
    """Validate a local model folder before loading anything heavy; return its config."""
    if not folder.is_dir():
        raise SourceError(f"{folder} is not a folder")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise SourceError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SourceError(f"{config_path} is not valid JSON: {e}") from e
    family = check_architecture(config, str(folder))
    missing = []
    if not any((folder / w).is_file() for w in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    for need in family.tokenizer_files:  # all of a tuple's names, one of each set's
        options = [need] if isinstance(need, str) else sorted(need)
        if not any((folder / f).is_file() for f in options):
            missing.append(" or ".join(options))
    if missing:
        raise SourceError(
            f"{folder} lacks {', '.join(missing)} (a {family.title} model folder needs weights and tokenizer files)"
        )
    return config


def check_architecture(config: dict, where: str) -> Family:
    try:
        return family_of(config, where)
    except UnsupportedArchitecture as e:
        raise SourceError(str(e)) from e


def tokenizer_class_of(folder: Path, family: Family) -> str:
    """The tokenizer class a folder names (tokenizer_config.json), checked against the family's."""
    config_path = folder / "tokenizer_config.json"
    named = None
    if config_path.is_file():
        try:
            named = json.loads(config_path.read_text(encoding="utf-8")).get("tokenizer_class")
        except json.JSONDecodeError as e:
            raise SourceError(f"{config_path} is not valid JSON: {e}") from e
    named = named or family.tokenizer_classes[0]
    if named not in family.tokenizer_classes:
        raise SourceError(
            f"{folder}: tokenizer class {named} does not belong to a {family.title} model; "
            f"expected one of: {', '.join(family.tokenizer_classes)}"
        )
    return named


def language_codes(tokenizer) -> dict[str, int]:
    """{code: id} of every language code the tokenizer knows (empty for a family without codes)."""
    lang_map = getattr(tokenizer, "lang_code_to_id", None)  # M2M100Tokenizer: {"en": id, ...}
    if isinstance(lang_map, dict) and lang_map:
        return {code: int(i) for code, i in lang_map.items()}
    extra = [str(t) for t in (getattr(tokenizer, "extra_special_tokens", None) or [])]
    if not extra:
        extra = [str(t) for t in (getattr(tokenizer, "additional_special_tokens", None) or [])]
    ids = tokenizer.convert_tokens_to_ids(extra) if extra else []
    return {code: int(i) for code, i in zip(extra, ids) if i is not None and i != tokenizer.unk_token_id}


def _target_token_languages(tokenizer, family: Family, src_lang, tgt_lang, where: str):
    """(languages, tokenizer) of a family whose target language is a token before the source: its
    codes from the vocabulary, and the tokenizer prefixing each text with the chosen one."""
    codes = target_codes(tokenizer.get_vocab(), family.target_token)
    if src_lang:
        raise SourceError(f"{where}: a {family.title} model reads the source language from the text itself; "
                          "--src-lang does not apply")
    if not codes:
        if tgt_lang:
            raise SourceError(f"{where}: this model's vocabulary has no target-language tokens "
                              f"({family.target_token.format('xx')}); --tgt-lang does not apply")
        return None, tokenizer
    tgt_lang = tgt_lang or family.default_tgt_lang
    if tgt_lang not in codes:
        raise SourceError(f"{where}: unknown target language {tgt_lang!r}; the tokenizer knows: {', '.join(codes)}")
    languages = {"src_lang": None, "tgt_lang": tgt_lang, "codes": codes, "target_token": family.target_token}
    return languages, TargetPrefixed(tokenizer, source_prefix(family.target_token, tgt_lang))


def check_languages(codes: dict[str, int], src_lang: str | None, tgt_lang: str | None, where: str) -> None:
    if not codes:
        if src_lang or tgt_lang:
            raise SourceError(f"{where}: this model has no language codes; --src-lang/--tgt-lang do not apply")
        return
    unknown = [f"{what} {code!r}" for what, code in (("source language", src_lang), ("target language", tgt_lang))
               if code not in codes]
    if unknown:
        raise SourceError(f"{where}: unknown {' and '.join(unknown)}; the tokenizer knows: {', '.join(codes)}")


def check_tokenizer_matches(tokenizer, config, codes: dict[str, int], where: str) -> None:
    """Refuse a tokenizer whose ids do not fit the model: every difference in one error."""
    problems = []
    size = len(tokenizer)
    if size > config.vocab_size:
        problems.append(f"the tokenizer has {size} ids but the model's vocabulary (embedding) has {config.vocab_size}")
    for name in ("pad", "eos"):
        tok_id, model_id = getattr(tokenizer, f"{name}_token_id"), getattr(config, f"{name}_token_id")
        if tok_id != model_id:
            problems.append(f"{name} id: tokenizer {tok_id}, model config {model_id}")
    if not 0 <= (config.decoder_start_token_id or 0) < config.vocab_size:
        problems.append(f"decoder_start_token_id {config.decoder_start_token_id} is outside the vocabulary")
    outside = {code: i for code, i in codes.items() if not 0 <= i < config.vocab_size}
    if outside:
        problems.append(f"language codes outside the model's vocabulary: {outside}")
    if problems:
        raise SourceError(f"{where}: the tokenizer does not match the model: " + "; ".join(problems))


def check_weights_match(loading: dict, where: str) -> None:
    """Refuse a checkpoint whose weights do not fit its config. transformers only warns when the
    config asks for weights the file lacks (it initialises them randomly): the export would then
    verify perfectly against a model that translates garbage."""
    problems = []
    for key, what in (("missing_keys", "in the config, not in the weights (would be random)"),
                      ("unexpected_keys", "in the weights, not in the config (ignored)"),
                      ("mismatched_keys", "of another shape than the config says")):
        names = sorted(
            f"{k[0]} (weights {list(k[1])}, config {list(k[2])})" if isinstance(k, tuple) and len(k) == 3 else str(k)
            for k in loading.get(key) or ()
        )
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            problems.append(f"{len(names)} tensor(s) {what}: {shown}")
    if problems:
        raise SourceError(f"{where}: the weights do not match config.json; " + "; ".join(problems))


def load_source(src: str, src_lang: str | None = None, tgt_lang: str | None = None):
    """Return (model in eval mode, tokenizer, source record for the sidecar, family, languages).

    `languages`: None for a model without codes, else {"src_lang", "tgt_lang", "codes": {code: id}}, and
    for a family whose target is a token before the source, "target_token" (its template) and src_lang
    None; the tokenizer returned then prefixes every text with it.
    """
    import transformers

    path = Path(src)
    if path.exists():
        family = check_architecture(check_local_folder(path), str(path))
        weights = next(path / w for w in WEIGHT_FILES if (path / w).is_file())
        from backends.manifest import sha256_file

        record = {"path": str(path.resolve()), "hub_id": None, "weights_sha256": sha256_file(weights)}
        where = str(path)
    else:
        if src.count("/") != 1 or src.startswith((".", "/")):
            raise SourceError(f"{src} is neither a local folder nor a hub id (owner/name)")
        record = {"path": None, "hub_id": src, "weights_sha256": None}
        where = src
        family = None
    try:
        if family is None:
            family = check_architecture(transformers.AutoConfig.from_pretrained(src).to_dict(), src)
        tokenizer_class = tokenizer_class_of(path, family) if path.exists() else family.tokenizer_classes[0]
        default_src, default_tgt = default_languages(family, tokenizer_class)
        if family.target_token is None:
            src_lang, tgt_lang = src_lang or default_src, tgt_lang or default_tgt
        kwargs = {"src_lang": src_lang, "tgt_lang": tgt_lang} if default_src else {}
        tokenizer = getattr(transformers, tokenizer_class).from_pretrained(where, **kwargs)
        model_class = getattr(transformers, family.architecture)
        try:
            model, loading = model_class.from_pretrained(where, output_loading_info=True)
        except RuntimeError as e:  # shapes that differ from the config: find which, then refuse
            if "mismatch" not in str(e):
                raise SourceError(f"could not load {where}: {e}") from e
            _, loading = model_class.from_pretrained(where, output_loading_info=True, ignore_mismatched_sizes=True)
            check_weights_match(loading, where)
            raise SourceError(f"{where}: the weights do not match config.json: {e}") from e
        model.eval()
        check_weights_match(loading, where)
    except SourceError:
        raise
    except OSError as e:
        raise SourceError(f"could not load {where}: {e}") from e
    except ValueError as e:  # e.g. weights whose shapes do not match the config
        raise SourceError(f"could not load {where}: {e}") from e
    if family.target_token is not None:
        languages, tokenizer = _target_token_languages(tokenizer, family, src_lang, tgt_lang, where)
        codes = languages["codes"] if languages else {}
    else:
        codes = language_codes(tokenizer) if default_src else {}
        check_languages(codes, src_lang, tgt_lang, where)
        languages = {"src_lang": src_lang, "tgt_lang": tgt_lang, "codes": codes} if codes else None
    check_tokenizer_matches(tokenizer, model.config, codes, where)
    for p in model.parameters():
        p.requires_grad_(False)
    record["tokenizer_class"] = tokenizer_class
    return model, tokenizer, record, family, languages


__all__ = ["SourceError", "check_local_folder", "load_source", "supported"]
