"""`bench speed --peers` on a family with language codes (NLLB): the peers run the family's classes,
read the sources in the export's source language and force its target language first, and the
exact ones are token-identical to generate(), as tests/test_bench.py asserts for Marian."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from conftest import REPO, cached
from corpus import default_sample
from test_families import _make_family, _peak

PEER_PYTHON = REPO / ".venv-bench" / "bin" / "python"
FORCED = 4  # forced output length: a random model never stops on its own
PEERS = ["transformers", "optimum_fp32", "ct2_float32", "ct2_int8"]

pytestmark = [
    pytest.mark.peers,
    pytest.mark.slow,
    pytest.mark.skipif(not PEER_PYTHON.is_file(), reason="no peer environment (.venv-bench); `make bench-venv` creates it"),
]


@pytest.fixture(scope="module")
def nllb_folder() -> Path:
    """tests/test_families.py's NLLB fixture and its export, built once for both files (conftest's cache)."""
    return cached("family-nllb-tiny", functools.partial(_make_family, "nllb-tiny"), _peak)


@pytest.fixture(scope="module")
def nllb_model_dir(nllb_folder) -> Path:
    return nllb_folder / "models" / "nllb-tiny"


@pytest.fixture(scope="module")
def nllb_export_dir(nllb_folder) -> Path:
    return nllb_folder / "exports" / "nllb-tiny"


@pytest.fixture(scope="module")
def nllb_peer_run(nllb_export_dir, peer_cache, tmp_path_factory):
    from bench.speed import run
    from service.speedrun import SpeedOptions

    options = SpeedOptions(forced_tokens=FORCED, latency_sentences=4, throughput_sentences=4, batch_sizes=(2,),
                           sweep_lengths=(), warmup=1, floor=False, ct2_probe_rounds=0)
    return run(nllb_export_dir, default_sample(4), options, tmp_path_factory.mktemp("nllb-peers") / "out",
               backend_names=["pytorch"], peer_names=PEERS, peer_python=PEER_PYTHON, peer_cache=peer_cache,
               log=lambda m: None)


def test_peers_run_the_family_with_its_languages(nllb_peer_run, nllb_export_dir):
    from backends import load_manifest

    manifest = load_manifest(nllb_export_dir)
    forced_bos, languages = manifest.generation.forced_bos_token_id, manifest.languages
    assert manifest.family == "m2m_100" and forced_bos == languages["codes"][languages["tgt_lang"]]
    results = nllb_peer_run
    assert results["failed"] == {}
    rt = results["runtimes"]
    for name in PEERS:
        r = rt[name]
        assert r["kind"] == "peer" and r["latency"]["n"] == 4 and r["latency"]["tokens_mean"] == float(FORCED)
        assert r["tokenization_mismatches"] == []  # the peer's tokenizer reads sources in the export's language
        assert r["command"][r["command"].index("--src-lang") + 1] == languages["src_lang"]
        assert r["command"][r["command"].index("--tgt-lang") + 1] == languages["tgt_lang"]
        assert all(o["ids"][0] == forced_bos for o in r["outputs"])  # the target's code first, as generate() forces it
    for name in ("transformers", "optimum_fp32"):
        assert rt[name]["call"]["forced_bos_token_id"] == forced_bos
    assert rt["ct2_float32"]["info"]["conversion"]["decoder_start"].startswith("decoder_start_token_id 2 ")


def test_exact_peers_are_token_identical_to_generate(nllb_peer_run, nllb_model_dir, nllb_export_dir):
    """generate() greedy, called here directly, against the transformers peer, Optimum fp32 and
    CTranslate2 float32; CTranslate2 int8 is reduced precision: agreement, not identity."""
    import torch
    import transformers

    from backends import load_manifest

    manifest = load_manifest(nllb_export_dir)
    model = getattr(transformers, manifest.architecture).from_pretrained(nllb_model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(nllb_model_dir, src_lang=manifest.languages["src_lang"])
    direct = []
    for pair in default_sample(4):
        with torch.inference_mode():
            row = model.generate(**tokenizer([pair.en], return_tensors="pt"), num_beams=1, do_sample=False,
                                 forced_bos_token_id=manifest.generation.forced_bos_token_id, forced_eos_token_id=None,
                                 max_new_tokens=FORCED, min_new_tokens=FORCED)
        direct.append(row[0, 1:].tolist())  # the decoder start excluded
    rt = nllb_peer_run["runtimes"]
    assert [o["ids"] for o in rt["pytorch"]["outputs"]] == direct
    for name in ("transformers", "optimum_fp32", "ct2_float32"):
        assert [o["ids"] for o in rt[name]["outputs"]] == direct, name
        assert rt[name]["comparison"]["identical_to_reference"] == 1.0
    assert 0.0 <= rt["ct2_int8"]["comparison"]["identical_to_reference"] <= 1.0


# --- T5 (MADLAD-400's structure): CTranslate2 converts it; Optimum's cache graphs do not fit it --------


@pytest.fixture(scope="module")
def madlad_peer_run(peer_cache, tmp_path_factory):
    from bench.speed import run
    from service.speedrun import SpeedOptions
    from test_t5 import _folders

    _, export_dir = _folders("madlad-tiny")
    options = SpeedOptions(forced_tokens=FORCED, latency_sentences=4, throughput_sentences=4, batch_sizes=(2,),
                           sweep_lengths=(), warmup=1, floor=False, ct2_probe_rounds=0)
    return export_dir, run(export_dir, default_sample(4), options, tmp_path_factory.mktemp("madlad-peers") / "out",
                           backend_names=["pytorch"], peer_names=["transformers", "optimum_fp32", "ct2_float32"],
                           peer_python=PEER_PYTHON, peer_cache=peer_cache, log=lambda m: None)


def test_madlad_peers_read_the_target_token_and_ct2_is_token_identical(madlad_peer_run):
    """CTranslate2 converts T5 (its own loader) and, given `<2zh>` before each source, matches
    generate() token for token; Optimum's export sizes its cache heads as d_model / heads, which
    MADLAD's structure (d_kv apart from it) contradicts, so it fails at the first cached step."""
    export_dir, results = madlad_peer_run
    rt = results["runtimes"]
    reference = [o["ids"] for o in rt["pytorch"]["outputs"]]
    assert len(reference) == 4 and all(len(ids) == FORCED for ids in reference)
    for name in ("transformers", "ct2_float32"):
        assert rt[name]["tokenization_mismatches"] == []  # the peer's tokenizer puts <2zh> first, as ours
        assert [o["ids"] for o in rt[name]["outputs"]] == reference, name
    assert set(results["failed"]) == {"optimum_fp32"}
    assert "past_key_values" in results["failed"]["optimum_fp32"] and "Expected: 16" in results["failed"]["optimum_fp32"]
