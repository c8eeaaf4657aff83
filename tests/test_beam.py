"""Beam search and the model's own generation config, in every backend, against transformers'
`generate()` itself (5.24): ids, sequence scores, n-best lists, per-step log-probs.

Two models:
- `peaked`: the tiny fixture with a random `final_logits_bias` (std 3, eos 0.3 below the best
  token) and a generation config of its own (num_beams 4, length_penalty 0.6, max_length 21, pad
  as a bad word). The tiny fixture's random weights give every token nearly the same log-prob, so
  generate()'s float32 sums tie (values 1e-6 apart become equal) and `torch.topk` breaks those
  ties its own way; the bias spreads the scores apart, so these tests compare the search, not
  float32 tie-breaking. Its outputs hardly depend on the input (random weights), but eos is a
  candidate at every step, so hypotheses finish all along and the finished lists, the stop rules
  and length penalties decide between ending at once and running to the cap.
- the embedded model (assets/marian-en-zh-small), exported once per session (conftest), on dev sentences.

generate() gets `bad_words_ids=[[pad]]` where the model's generation config lacks it: the sidecar
masks pad at every step (`special_tokens.bad_words_ids`), so that is the same option. Greedy search
never forces eos at the length cap (its results keep reporting the cut), so greedy comparisons
turn `forced_eos_token_id` off in generate().
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backends import BACKEND_NAMES, SessionConfig, load_backends, load_manifest
from backends.manifest import FORMAT_VERSION, GENERATE_DEFAULTS, MANIFEST_NAME, UnsupportedGeneration, generation_section
from conftest import REPO, cached, dev_sentences

FP32 = ("pytorch", "ort_fp32_single_step", "ort_fp32_kv_cache")
APPROX = ("ort_fp16", "ort_int8")
PEAKED_GENERATION = {"num_beams": 4, "length_penalty": 0.6, "max_length": 21}  # and pad as a bad word

# Mixed lengths: one short, one long, punctuation, a question.
TEXTS = [
    "Hi.",
    "Click OK to save the document and close the window when you are done.",
    "Where is the nearest train station?",
    "The quick brown fox jumps over the lazy dog, and then it runs back into the forest again.",
]


# --- fixtures ---------------------------------------------------------------------------------------


def _make_peaked(tiny_model_dir: Path, out: Path) -> None:
    import torch
    from transformers import MarianMTModel

    model = MarianMTModel.from_pretrained(tiny_model_dir).eval()
    generator = torch.Generator().manual_seed(0)
    bias = torch.randn(model.final_logits_bias.shape, generator=generator) * 3  # (1, V)
    bias[0, model.config.eos_token_id] = bias.max() - 0.3
    with torch.no_grad():
        model.final_logits_bias.copy_(bias)
    pad = model.config.pad_token_id
    for key, value in {**PEAKED_GENERATION, "bad_words_ids": [[pad]]}.items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(out)
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)


def _export(src: Path, out: Path) -> Path:
    from export.pipeline import ExportOptions, export

    # The fp32 graphs' own parity is the export tests' job; here the decoding is under test.
    return export(str(src), ExportOptions(out=out, verify=False, threads=2), log=lambda *a, **k: None)


@pytest.fixture(scope="module")
def peaked_folder(tiny_model_dir) -> Path:
    """The peaked model (models/peaked) and its export (exports/peaked), built once (conftest's cache)."""

    def make(folder: Path) -> None:
        _make_peaked(tiny_model_dir, folder / "models" / "peaked")
        _export(folder / "models" / "peaked", folder / "exports" / "peaked")

    return cached("marian-peaked", make, tiny_model_dir, _make_peaked, _export, PEAKED_GENERATION)


@pytest.fixture(scope="module")
def peaked_model_dir(peaked_folder) -> Path:
    return peaked_folder / "models" / "peaked"


@pytest.fixture(scope="module")
def peaked_export_dir(peaked_folder) -> Path:
    return peaked_folder / "exports" / "peaked"


@pytest.fixture(scope="module")
def peaked(peaked_export_dir):
    return load_backends(peaked_export_dir, session=SessionConfig(threads=2))


@pytest.fixture(scope="module")
def embedded(embedded_export_dir):
    return load_backends(embedded_export_dir, session=SessionConfig(threads=2))


class Reference:
    """transformers' generate() on a model folder, with our tokenizer's exact input ids."""

    def __init__(self, model_dir: Path, backend):
        import torch
        import transformers
        from transformers import MarianMTModel

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(2)
        self.model = MarianMTModel.from_pretrained(model_dir).eval()
        self.backend = backend
        self.pad = self.model.config.pad_token_id

    def __call__(self, texts: list[str], greedy: bool = False, **options) -> list[dict]:
        """One entry per text: ids and scores of its num_return_sequences hypotheses, and the
        processed log-prob generate() gave each token of the best one."""
        import torch

        batch = self.backend.tokenizer.encode(texts, self.backend.manifest.max_source_tokens)
        extra = {"forced_eos_token_id": None} if greedy else {}
        bad_words = options.pop("bad_words_ids", [[self.pad]])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=torch.from_numpy(batch.input_ids),
                attention_mask=torch.from_numpy(batch.attention_mask),
                do_sample=False,
                bad_words_ids=bad_words,
                output_scores=True,
                return_dict_in_generate=True,
                **extra,
                **options,
            )
        n = out.sequences.shape[0] // len(texts)
        rows = out.sequences.tolist()
        results = []
        for s in range(len(texts)):
            ids = [[t for t in row[1:] if t != self.pad] for row in rows[s * n : (s + 1) * n]]
            best = ids[0]
            if getattr(out, "sequences_scores", None) is None:  # greedy
                steps = [float(torch.log_softmax(out.scores[t][s], -1)[best[t]]) for t in range(len(best))]
                scores = None
            else:
                scores = out.sequences_scores[s * n : (s + 1) * n].tolist()
                beams = out.beam_indices[s * n].tolist()
                steps = [float(out.scores[t][beams[t], best[t]]) for t in range(len(best))]
            results.append({"ids": ids, "scores": scores, "steps": steps})
        return results


@pytest.fixture(scope="module")
def peaked_generate(peaked_model_dir, peaked):
    return Reference(peaked_model_dir, peaked["pytorch"])


@pytest.fixture(scope="module")
def embedded_generate(embedded, embedded_export_dir):
    from backends.pytorch import source_model_of

    return Reference(source_model_of(load_manifest(embedded_export_dir)), embedded["pytorch"])


def assert_same_as_generate(translations, expected, where: str):
    for i, (t, e) in enumerate(zip(translations, expected, strict=True)):
        assert [h.token_ids for h in t.hypotheses] == e["ids"], f"{where}, sentence {i}"
        assert t.token_ids == e["ids"][0] and len(t.scores) == len(t.token_ids), f"{where}, sentence {i}"
        if e["scores"] is not None:
            assert np.allclose([h.score for h in t.hypotheses], e["scores"], atol=1e-4), (where, i)
            assert t.score == t.hypotheses[0].score
        # the per-step records along the chosen hypothesis, as generate() scored them (greedy: the
        # log-softmax of the processed logits, i.e. over the tokens the masks leave)
        assert np.allclose([s.logprob for s in t.scores], e["steps"], atol=1e-4), (where, i)


# --- the sidecar: the model's generation config ---------------------------------------------------


def test_our_copy_of_generate_defaults_is_the_installed_transformers_one():
    from transformers import GenerationConfig

    assert GENERATE_DEFAULTS == GenerationConfig._get_default_generation_params()


def test_the_output_layer_bias_is_kept_only_where_it_adds_something(tiny_export_dir, peaked_export_dir):
    """An all-zero final_logits_bias (the tiny fixture's) is left out of the KV decoder, a pass over
    (b, V) saved each step; the peaked fixture's random one stays (its beam tests against
    generate() depend on it)."""
    import onnx

    def bias_adds(export_dir):
        graph = onnx.load(str(load_manifest(export_dir).graph_path("decoder"))).graph
        return [n.name for n in graph.node if n.op_type == "Add" and "final_logits_bias" in n.input]

    assert bias_adds(tiny_export_dir) == []
    assert len(bias_adds(peaked_export_dir)) == 1


def test_the_sidecar_records_the_generation_config(tiny_export_dir, peaked_export_dir, peaked_model_dir):
    tiny = load_manifest(tiny_export_dir)
    assert tiny.data["format_version"] == FORMAT_VERSION == 8
    g = tiny.data["generation"]
    # transformers 5 derives the tiny model's generation config from its config: forced eos 0,
    # no max_length (generate()'s model-agnostic 20 tokens are not copied: the position limit holds).
    assert (g["num_beams"], g["forced_eos_token_id"], g["max_new_tokens"], g["min_new_tokens"]) == (1, 0, None, 0)
    assert g["source"]["file"] == "generation_config.json" and len(g["source"]["sha256"]) == 64
    peaked = load_manifest(peaked_export_dir).generation
    assert (peaked.num_beams, peaked.max_new_tokens, peaked.early_stopping, peaked.length_penalty) == (4, 20, False, 0.6)
    pad = tiny.special.pad
    assert peaked.bad_words_ids == ((pad,),) and peaked.forced_eos_token_id == 0


def _section(**config):
    special = {"pad": 99, "eos": 0, "decoder_start": 99}
    return generation_section(
        {"eos_token_id": 0, "pad_token_id": 99, "decoder_start_token_id": 99, **config},
        special=special, limit=511, vocab_size=100,
    )


@pytest.mark.parametrize(
    "config, named",
    [
        ({"do_sample": True, "temperature": 0.7, "top_p": 0.9}, ["do_sample=True", "temperature=0.7", "top_p=0.9"]),
        ({"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5}, ["num_beam_groups=2", "diversity_penalty=0.5"]),
        ({"force_words_ids": [[5]]}, ["force_words_ids=[[5]]"]),
        ({"suppress_tokens": [3], "encoder_no_repeat_ngram_size": 3}, ["suppress_tokens=[3]", "encoder_no_repeat_ngram_size=3"]),
        ({"sequence_bias": [[[5], -1.0]], "guidance_scale": 1.5}, ["sequence_bias", "guidance_scale=1.5"]),
        ({"eos_token_id": 7}, ["eos_token_id=7 (the model config says 0)"]),
    ],
)
def test_generation_options_the_backends_lack_are_refused_by_name(config, named):
    with pytest.raises(UnsupportedGeneration, match="the model's generation config sets options") as e:
        _section(**config)
    for name in named:
        assert name in str(e.value)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_beams": 32}, r"num_beams must be an integer in 1\.\.16"),
        ({"num_beams": 2, "num_return_sequences": 3}, r"num_return_sequences must be an integer in 1\.\.2"),
        ({"early_stopping": "sometimes"}, r"early_stopping must be one of: False, True, 'never'"),
        ({"bad_words_ids": [[100]]}, r"outside the vocabulary \(0\.\.99\): \[100\]"),
        ({"max_length": 1}, r"max_new_tokens must be an integer in 1\.\.511, got 0"),
    ],
)
def test_generation_values_outside_the_valid_ranges_are_refused(config, message):
    with pytest.raises(UnsupportedGeneration, match=message):
        _section(**config)


def test_generation_section_maps_lengths_bad_words_and_inert_options():
    g = _section(
        max_length=200, min_length=5, num_beams=4, early_stopping="never", length_penalty=0.6,
        bad_words_ids=[[0], [3, 4], [99]], no_repeat_ngram_size=3, repetition_penalty=1.2, temperature=0.5,
        num_assistant_tokens=5, renormalize_logits=True, output_scores=True,
    )
    assert (g["max_new_tokens"], g["min_new_tokens"]) == (199, 4)  # the decoder start counts in max_length
    assert g["bad_words_ids"] == [[3, 4], [99]]  # a lone eos is never banned (as generate() does)
    assert (g["num_beams"], g["early_stopping"], g["length_penalty"]) == (4, "never", 0.6)
    assert (g["no_repeat_ngram_size"], g["repetition_penalty"], g["renormalize_logits"]) == (3, 1.2, True)
    assert set(g["inert"]) == {"temperature", "num_assistant_tokens"}  # recorded, with the reason
    assert "sampling" in g["inert"]["temperature"]
    assert _section(max_new_tokens=900)["max_new_tokens"] == 511  # capped at the position limit


def test_export_refuses_a_sampling_model_before_exporting_anything(tiny_model_dir, tmp_path):
    from export.pipeline import ExportOptions, export

    src = tmp_path / "sampling"
    shutil.copytree(tiny_model_dir, src)
    config = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "top_k": 20}))
    with pytest.raises(UnsupportedGeneration, match=r"do_sample=True, top_k=20"):
        export(str(src), ExportOptions(out=tmp_path / "out", threads=1), log=lambda *a, **k: None)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_an_older_export_is_refused_and_made_again(tiny_model_dir, tiny_export_dir, tmp_path):
    from backends import ManifestError
    from export.ensure import reusable

    out = tmp_path / "tiny"
    shutil.copytree(tiny_export_dir, out)
    data = json.loads((out / MANIFEST_NAME).read_text())
    (out / MANIFEST_NAME).write_text(json.dumps({**data, "format_version": 2}))
    with pytest.raises(ManifestError, match=r"older export \(format v2\); this version reads v8.*re-run the export"):
        load_manifest(out)
    ok, why = reusable(str(tiny_model_dir), out)
    assert not ok and "older export (format v2)" in why
    # the same export, but the source's generation config is not the one it was made from
    data["generation"]["source"]["sha256"] = "0" * 64
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    ok, why = reusable(str(tiny_model_dir), out)
    assert not ok and why == f"the generation config in {tiny_model_dir} (generation_config.json) changed since {out} was exported"


# --- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_beams": 0}, r"num_beams must be an integer in 1\.\.16 \(1: greedy search\), got 0"),
        ({"num_beams": 17}, r"num_beams must be an integer in 1\.\.16"),
        ({"num_beams": True}, r"num_beams must be an integer in 1\.\.16"),
        ({"num_beams": "4"}, r"num_beams must be an integer in 1\.\.16"),
        ({"num_beams": 4, "num_return_sequences": 5}, r"num_return_sequences must be an integer in 1\.\.4 \(at most num_beams, 4\)"),
        ({"num_beams": 1, "num_return_sequences": 2}, r"num_return_sequences must be an integer in 1\.\.1"),
        ({"length_penalty": float("nan")}, r"length_penalty must be a finite number, got nan"),
        ({"length_penalty": "1"}, r"length_penalty must be a finite number"),
        ({"early_stopping": "yes"}, r"early_stopping must be one of: False, True, 'never'; got 'yes'"),
        ({"early_stopping": 1}, r"early_stopping must be one of"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number > 0 \(1\.0: off\), got 0\.0"),
        ({"no_repeat_ngram_size": -1}, r"no_repeat_ngram_size must be an integer in 0\.\.20 \(0: off\)"),
        ({"max_new_tokens": 600}, r"max_new_tokens must be an integer in 1\.\.511"),
        ({"min_new_tokens": 30}, r"min_new_tokens must be an integer in 0\.\.20"),
    ],
)
def test_a_bad_option_value_is_a_clear_error_naming_the_valid_range(peaked, options, message):
    for backend in peaked.values():
        with pytest.raises(ValueError, match=message):
            backend.translate(["Hello."], **options)


# --- the peaked tiny model against generate() -------------------------------------------------------


def test_defaults_are_the_models_own_generation_config(peaked, peaked_generate):
    """No options at all: both decode as the generation config says (4 beams, length penalty 0.6,
    20 new tokens); the same as asking for it."""
    expected = peaked_generate(TEXTS)
    explicit = {"num_beams": 4, "length_penalty": 0.6, "max_new_tokens": 20}
    for name in FP32:
        out = peaked[name].translate(TEXTS)
        assert_same_as_generate(out, expected, name)
        assert [t.token_ids for t in out] == [t.token_ids for t in peaked[name].translate(TEXTS, **explicit)]
        assert all(len(t.hypotheses) == 1 for t in out)


def test_the_grid_sees_both_eos_and_the_length_cap(peaked_generate):
    """The comparisons below must see hypotheses that end at eos and ones cut at the cap."""
    lengths = set()
    for options in GRID:
        (e,) = peaked_generate(TEXTS[:1], max_new_tokens=14, num_return_sequences=options["num_beams"], **options)
        lengths |= {len(ids) for ids in e["ids"]}
    assert min(lengths) < 14 and max(lengths) == 14, lengths


GRID = [
    {"num_beams": 2},
    {"num_beams": 4},
    {"num_beams": 5},
    {"num_beams": 2, "early_stopping": True},
    {"num_beams": 4, "early_stopping": True},
    {"num_beams": 5, "early_stopping": True},
    {"num_beams": 2, "early_stopping": "never"},
    {"num_beams": 4, "early_stopping": "never"},
    {"num_beams": 5, "early_stopping": "never"},
    {"num_beams": 4, "length_penalty": 0.6},
    {"num_beams": 4, "length_penalty": 2.0},
    {"num_beams": 5, "length_penalty": 2.0, "early_stopping": "never"},
    {"num_beams": 4, "length_penalty": 0.6, "early_stopping": "never"},
]


@pytest.mark.parametrize("options", GRID, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_beam_search_equals_generate_on_a_padded_batch_and_one_by_one(peaked, peaked_generate, options):
    """The whole n-best list (num_return_sequences = num_beams) and its scores."""
    options = {"max_new_tokens": 14, "num_return_sequences": options["num_beams"], **options}
    expected = peaked_generate(TEXTS, **options)
    for name in FP32:
        batched = peaked[name].translate(TEXTS, **options)
        assert_same_as_generate(batched, expected, f"{name} batch")
        if name == "pytorch":
            continue  # the slowest here; one by one is checked on the ORT engines
        for text, b in zip(TEXTS, batched):
            (single,) = peaked[name].translate([text], **options)
            assert [h.token_ids for h in single.hypotheses] == [h.token_ids for h in b.hypotheses], (name, text)
            assert np.allclose([h.score for h in single.hypotheses], [h.score for h in b.hypotheses], atol=1e-5)


def test_num_beams_1_is_greedy_and_equals_generate(peaked, peaked_generate):
    options = {"max_new_tokens": 14, "min_new_tokens": 2}
    expected = peaked_generate(TEXTS, greedy=True, num_beams=1, **options)
    for name in FP32:
        out = peaked[name].translate(TEXTS, num_beams=1, **options)
        assert_same_as_generate(out, expected, name)
        assert [t.hypotheses[0].token_ids for t in out] == [t.token_ids for t in out]


@pytest.mark.parametrize("beams", [1, 2, 4, 5])
def test_n_best_lists_and_their_scores_equal_generates(peaked, peaked_generate, beams):
    options = {"max_new_tokens": 12, "min_new_tokens": 2, "num_beams": beams, "num_return_sequences": beams}
    if beams == 1:
        options["num_return_sequences"] = 1
    expected = peaked_generate(TEXTS, greedy=beams == 1, **options)
    for name in FP32:
        out = peaked[name].translate(TEXTS, **options)
        assert_same_as_generate(out, expected, name)
        for t in out:
            assert len(t.hypotheses) == options["num_return_sequences"]
            scores = [h.score for h in t.hypotheses]
            assert scores == sorted(scores, reverse=True)  # best first
            assert [h.text for h in t.hypotheses][0] == t.text


def test_hypotheses_at_the_length_cap_end_with_the_forced_eos(peaked, peaked_generate):
    """max_new_tokens 5 with eos masked until then: every hypothesis is cut at the cap, where the
    model's config forces eos (log-prob 0), as generate() does."""
    options = {"num_beams": 4, "max_new_tokens": 5, "min_new_tokens": 4, "num_return_sequences": 2, "length_penalty": 1.0}
    expected = peaked_generate(TEXTS, **options)
    eos = peaked["pytorch"].special.eos
    for name in FP32:
        out = peaked[name].translate(TEXTS, **options)
        assert_same_as_generate(out, expected, name)
        for t in out:
            assert len(t.token_ids) == 5 and t.token_ids[-1] == eos and t.scores[-1].logprob == 0.0
            assert t.stop_reason == "max_new_tokens"
            assert math.isclose(t.score, sum(s.logprob for s in t.scores) / 5, abs_tol=1e-9)


@pytest.mark.parametrize(
    "options",
    [
        {"repetition_penalty": 1.5},
        {"repetition_penalty": 0.7},
        {"no_repeat_ngram_size": 2},
        {"no_repeat_ngram_size": 1},
        {"no_repeat_ngram_size": 3, "repetition_penalty": 1.3, "length_penalty": 0.6},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
@pytest.mark.parametrize("beams", [1, 4])
def test_repetition_penalty_and_no_repeat_ngrams_equal_generate(peaked, peaked_generate, options, beams):
    options = {"max_new_tokens": 14, "min_new_tokens": 3, "num_beams": beams, **options}
    expected = peaked_generate(TEXTS, greedy=beams == 1, **options)
    for name in FP32:
        out = peaked[name].translate(TEXTS, **options)
        assert_same_as_generate(out, expected, name)
        if options.get("no_repeat_ngram_size") == 1:
            assert all(len(set(t.token_ids)) == len(t.token_ids) for t in out)


def test_the_sidecars_defaults_are_used_and_overridden_per_call(peaked, peaked_export_dir, tmp_path):
    """An export whose generation section says early_stopping 'never', length_penalty 0.6 and
    3 hypotheses decodes so without options, and each call can still override them."""
    out = tmp_path / "export"
    shutil.copytree(peaked_export_dir, out)
    data = json.loads((out / MANIFEST_NAME).read_text())
    data["generation"].update(early_stopping="never", length_penalty=0.6, num_return_sequences=3)
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    backend = load_backends(out, names=("ort_fp32_kv_cache",), session=SessionConfig(threads=2))["ort_fp32_kv_cache"]
    same = peaked["ort_fp32_kv_cache"]
    defaults = backend.translate(TEXTS)
    explicit = same.translate(TEXTS, early_stopping="never", length_penalty=0.6, num_return_sequences=3)
    assert [[h.token_ids for h in t.hypotheses] for t in defaults] == [[h.token_ids for h in t.hypotheses] for t in explicit]
    assert all(len(t.hypotheses) == 3 for t in defaults)
    greedy = backend.translate(TEXTS, num_beams=1, num_return_sequences=1)
    assert [t.token_ids for t in greedy] == [t.token_ids for t in same.translate(TEXTS, num_beams=1)]


@pytest.mark.parametrize("rule", ["renormalize_logits", "forced_bos_token_id", "bad_words_ids"])
@pytest.mark.parametrize("beams", [1, 4])
def test_the_models_fixed_rules_from_the_sidecar_equal_generate(peaked_export_dir, peaked_generate, tmp_path, rule, beams):
    """Rules only the model's generation config sets (not per-call options): renormalizing after
    the processors, a forced first token, a two-token bad word (the start of today's best output)."""
    options = {"num_beams": beams, "max_new_tokens": 10, "min_new_tokens": 3, "repetition_penalty": 1.3}
    if beams > 1:
        options["num_return_sequences"] = 2
    pad = load_manifest(peaked_export_dir).special.pad
    first = peaked_generate(TEXTS[:1], greedy=beams == 1, **options)[0]["ids"][0]
    value = {"renormalize_logits": True, "forced_bos_token_id": 5, "bad_words_ids": [[pad], first[:2]]}[rule]
    expected = peaked_generate(TEXTS, greedy=beams == 1, **{rule: value}, **options)
    out = tmp_path / "export"
    shutil.copytree(peaked_export_dir, out)
    data = json.loads((out / MANIFEST_NAME).read_text())
    data["generation"][rule] = value
    (out / MANIFEST_NAME).write_text(json.dumps(data))
    backends = load_backends(out, names=FP32, session=SessionConfig(threads=2))
    for name in FP32:
        translations = backends[name].translate(TEXTS, **options)
        assert_same_as_generate(translations, expected, name)
        if rule == "forced_bos_token_id":
            assert all(t.token_ids[0] == 5 and t.scores[0].logprob == 0.0 for t in translations)
        if rule == "bad_words_ids":
            assert all(t.token_ids[:2] != first[:2] for t in translations)


def test_step_records_follow_the_chosen_hypothesis(peaked):
    (t,) = peaked["ort_fp32_kv_cache"].translate([TEXTS[1]], num_beams=4, top_k=6, max_new_tokens=14, length_penalty=1.0)
    for step, (token, s) in enumerate(zip(t.token_ids, t.scores)):
        assert s.token_id == token and len(s.top_ids) == len(s.top_logprobs) == 6
        assert s.top_logprobs == sorted(s.top_logprobs, reverse=True)
        assert s.logprob <= s.top_logprobs[0] + 1e-12  # the beam's pick need not be its own best
        if token in s.top_ids:
            assert s.top_logprobs[s.top_ids.index(token)] == pytest.approx(s.logprob, abs=1e-12)
    assert math.isclose(t.score, sum(s.logprob for s in t.scores) / len(t.token_ids), abs_tol=1e-9)
    assert t.stop_reason in ("eos", "max_new_tokens") and t.non_finite_steps == []


# --- engines: expand once, reorder the cache, never a numpy round trip -------------------------------


def test_kv_cache_stays_in_ort_and_cross_attention_is_computed_once(peaked, monkeypatch):
    import onnxruntime as ort

    backend = peaked["ort_fp32_kv_cache"]
    engine = backend.model
    to_numpy, from_numpy = [], []
    real_numpy, real_from = ort.OrtValue.numpy, ort.OrtValue.ortvalue_from_numpy

    def spy_numpy(self):
        to_numpy.append(tuple(self.shape()))
        return real_numpy(self)

    def spy_from(array, *args, **kwargs):
        from_numpy.append(np.asarray(array).shape)
        return real_from(array, *args, **kwargs)

    runs = {"encoder": 0, "gather": []}
    real_encoder, real_gather = engine.encoder.run_with_ort_values, engine._gather

    def encoder_run(*args, **kwargs):
        runs["encoder"] += 1
        return real_encoder(*args, **kwargs)

    def gather(values, index):
        runs["gather"].append((len(values), tuple(values[0].shape()), index.tolist()))
        out = real_gather(values, index)
        assert all(isinstance(v, ort.OrtValue) for v in out)
        return out

    monkeypatch.setattr(ort.OrtValue, "numpy", spy_numpy)
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(spy_from))
    monkeypatch.setattr(engine.encoder, "run_with_ort_values", encoder_run)
    monkeypatch.setattr(engine, "_gather", gather)
    out = backend.translate(TEXTS[:2], num_beams=4, max_new_tokens=10, min_new_tokens=10)
    layers = engine.layers
    assert runs["encoder"] == 1
    # The cross-attention keys/values stay at one row per sentence (the decoder shares them across
    # a sentence's beams). The first step runs once per sentence; then its self-attention cache is
    # widened to 4 rows each, and every later gather is a reorder of that cache.
    assert engine.shared_cross
    (widen_n, widen_shape, widen_index), *reorders = runs["gather"]
    assert widen_n == 2 * layers and widen_shape[0] == 2 and widen_shape[2] == 1
    assert widen_index == [0, 0, 0, 0, 1, 1, 1, 1]
    assert reorders and all(n == 2 * layers and shape[0] == 8 for n, shape, _ in reorders)
    assert all(len(shape) == 3 for shape in to_numpy)  # only the logits (rows, 1, V) leave ORT
    assert all(len(shape) < 4 or shape[2] == 0 for shape in from_numpy)  # no cache enters from numpy
    assert all(len(t.token_ids) == 10 for t in out)


def test_pytorch_reorders_with_transformers_own_cache_reorder(peaked, monkeypatch):
    from transformers.cache_utils import EncoderDecoderCache

    calls = []
    real = EncoderDecoderCache.reorder_cache

    def spy(self, beam_idx):
        calls.append(beam_idx.tolist())
        return real(self, beam_idx)

    monkeypatch.setattr(EncoderDecoderCache, "reorder_cache", spy)
    peaked["pytorch"].translate(TEXTS[:2], num_beams=3, max_new_tokens=8, min_new_tokens=8)
    assert calls and all(len(c) == 6 for c in calls)
    assert all(max(c[:3]) < 3 <= min(c[3:]) for c in calls)  # a sentence's beams come from its own rows


def test_ort_beam_search_never_imports_torch(peaked_export_dir):
    code = (
        "import sys; from backends import load_backends; "
        f"b = load_backends({str(peaked_export_dir)!r}, names=('ort_fp32_single_step', 'ort_fp32_kv_cache', 'ort_fp16', 'ort_int8')); "
        "[x.translate(['Hello world.', 'Where is it?'], num_beams=3, max_new_tokens=6) for x in b.values()]; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


# --- the tiny fixture itself (random weights: near-ties everywhere) ------------------------------------


@pytest.mark.parametrize("beams", [2, 4])
def test_every_backend_runs_beam_search_on_the_tiny_fixture_and_batches_equal_one_by_one(tiny_backends, beams):
    texts = dev_sentences(3)
    for name, backend in tiny_backends.items():
        batched = backend.translate(texts, num_beams=beams, max_new_tokens=8, min_new_tokens=4, num_return_sequences=2)
        for text, b in zip(texts, batched):
            assert 4 <= len(b.token_ids) <= 8 and len(b.hypotheses) == 2 and b.non_finite_steps == []
            if name in FP32:
                (single,) = backend.translate([text], num_beams=beams, max_new_tokens=8, min_new_tokens=4, num_return_sequences=2)
                assert [h.token_ids for h in single.hypotheses] == [h.token_ids for h in b.hypotheses], (name, text)


# --- the embedded model against generate() --------------------------------------------------------------


EMBEDDED_GRID = [
    {"num_beams": 4, "early_stopping": True},
    {"num_beams": 5, "early_stopping": True},
    {"num_beams": 2},
    {"num_beams": 4, "early_stopping": "never", "length_penalty": 0.6},
    {"num_beams": 4, "length_penalty": 2.0, "num_return_sequences": 3},
    {"num_beams": 4, "max_new_tokens": 6},  # every hypothesis hits the cap (no forced eos in this model)
    {"num_beams": 4, "no_repeat_ngram_size": 3, "repetition_penalty": 1.2},
]


@pytest.fixture(scope="module")
def embedded_texts() -> list[str]:
    return dev_sentences(6) + TEXTS[:2]


@pytest.mark.parametrize("options", EMBEDDED_GRID, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_embedded_model_beam_search_equals_generate(embedded, embedded_generate, embedded_texts, options, artifacts_dir):
    options = {"max_new_tokens": 48, **options}
    expected = embedded_generate(embedded_texts, **options)
    for name in FP32:
        assert_same_as_generate(embedded[name].translate(embedded_texts, **options), expected, name)
    if options["max_new_tokens"] == 6:
        out = embedded["ort_fp32_kv_cache"].translate(embedded_texts, **options)
        eos = embedded["ort_fp32_kv_cache"].special.eos
        capped = [t.token_ids[-1] != eos for t in out]
        assert sum(capped) >= len(out) // 2  # no forced eos in this model: cut hypotheses end without one
        for t, cut in zip(out, capped):
            assert (t.stop_reason, len(t.token_ids) == 6) == (("max_new_tokens", True) if cut else ("eos", len(t.token_ids) == 6))
    # fp16 / int8: agreement reported, identity not required
    report = {}
    for name in APPROX:
        out = embedded[name].translate(embedded_texts, **options)
        same = sum(t.token_ids == e["ids"][0] for t, e in zip(out, expected))
        tokens = sum(len(e["ids"][0]) for e in expected)
        agree = sum(a == b for t, e in zip(out, expected) for a, b in zip(t.token_ids, e["ids"][0]))
        report[name] = {"identical": same, "of": len(out), "token_agreement": round(agree / tokens, 4)}
        assert agree / tokens >= 0.5, (name, report[name])
    path = artifacts_dir / "beam_fp16_int8_agreement.json"
    previous = json.loads(path.read_text()) if path.is_file() else {}
    previous[json.dumps(options, sort_keys=True)] = report
    path.write_text(json.dumps(previous, indent=1))


def test_embedded_model_batches_equal_one_by_one(embedded, embedded_texts):
    options = {"num_beams": 4, "early_stopping": True, "max_new_tokens": 48, "num_return_sequences": 2}
    for name in ("ort_fp32_kv_cache", "ort_fp32_single_step"):
        batched = embedded[name].translate(embedded_texts, **options)
        for text, b in zip(embedded_texts, batched):
            (single,) = embedded[name].translate([text], **options)
            assert [h.token_ids for h in single.hypotheses] == [h.token_ids for h in b.hypotheses], (name, text)
            assert np.allclose([h.score for h in single.hypotheses], [h.score for h in b.hypotheses], atol=1e-5)


def test_export_verification_checks_the_models_own_decoding(peaked_export_dir, tiny_export_dir):
    from export import verify

    sentences = ["The cat sat on the mat.", "Open the file menu and choose Save as.", "Hello!"]
    own = verify.model_decoding_parity(peaked_export_dir, sentences, 12, threads=2)
    assert own["options"]["num_beams"] == 4 and own["options"]["length_penalty"] == 0.6
    assert own["sentences"] == 3
    for name in ("ort_fp32_single_step", "ort_fp32_kv_cache"):
        assert own["backends"][name]["identical_ids"] == 3, own["backends"][name]
    assert verify.model_decoding_parity(tiny_export_dir, sentences, 12, threads=2) is None  # greedy: checked as greedy
    # A beam-search mismatch fails the export, named as such.
    broken = {**own, "backends": {"ort_fp32_kv_cache": {**own["backends"]["ort_fp32_kv_cache"], "identical_ids": 2}}}
    failures = verify.judge({"cases": []}, None, broken)
    assert failures and failures[0].startswith("ort_fp32_kv_cache: beam 4 ids identical on 2/3")


@pytest.mark.slow
def test_the_opus_sized_fixture_decodes_as_the_published_model(tmp_path, monkeypatch):
    """transformers 5 no longer derives num_beams from config.json: the fixture writes the published
    model's decoding (4 beams, bad word 65000, max_length 512) into its generation config."""
    import dataclasses

    from transformers import MarianMTModel

    from export import fixtures

    small = dataclasses.replace(  # a smaller tokenizer sample: the model keeps its full shape
        fixtures.FIXTURES["opus-mt-random"], source_spm_size=400, target_spm_size=1000, sample_pairs=3000,
        target_coverage=0.98,
    )
    monkeypatch.setitem(fixtures.FIXTURES, "opus-mt-random", small)
    out = fixtures.build("opus-mt-random", tmp_path / "opus")
    model = MarianMTModel.from_pretrained(out)
    g = model.generation_config
    assert (g.num_beams, g.max_length, g.bad_words_ids, g.forced_eos_token_id) == (4, 512, [[65000]], 0)
    assert model.config.vocab_size == 65001


def test_benchmarks_time_greedy_search_unless_told_even_when_the_model_beams(peaked):
    """The speed protocol's adapter: the peaked model's own config asks for 4 beams, the benchmark
    (and the app's quick run, which states greedy) must time greedy search unless given beams."""
    from runtime.protocol import BackendRuntime

    backend = peaked["ort_fp32_kv_cache"]
    texts = ["The cat sat on the mat.", "Open the file menu and choose Save as."]
    greedy = [t.token_ids for t in backend.translate(texts, num_beams=1, max_new_tokens=12)]
    beams = [t.token_ids for t in backend.translate(texts, max_new_tokens=12)]  # the model's own: 4 beams
    assert greedy != beams  # else this test could not tell them apart
    assert [o.ids for o in BackendRuntime(backend).translate(texts, 12, 0)] == greedy
    assert [o.ids for o in BackendRuntime(backend, {"num_beams": 4}).translate(texts, 12, 0)] == beams


class _Rows:
    """An engine wrapper that records the rows of each step; `keep` only where `dropping`."""

    def __init__(self, inner, dropping: bool):
        self.inner, self.rows = inner, []
        self.encode, self.expand, self.reorder = inner.encode, inner.expand, inner.reorder
        if dropping:
            self.keep = inner.keep

    def step(self, state, decoder_ids):
        self.rows.append(decoder_ids.shape[0])
        return self.inner.step(state, decoder_ids)


@pytest.mark.parametrize("n", [1, 4], ids=["greedy", "beam4"])
@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_finished_sentences_are_dropped_and_change_no_number(embedded, name, n):
    """Both searches stop computing a sentence once it is done (as CTranslate2 does): greedy search
    once it has ended, beam search once no running beam can beat its n finished hypotheses. The
    engine's rows shrink by whole sentences, in groups, and every sentence's ids, log-probs (beam
    search: its n-best list and scores) equal those of the whole batch computed to the end, which is
    what generate() does (the parity tests against it run with the drops). The embedded model: a
    trained model's sentences end at different steps."""
    from backends.backend import Backend
    from backends.decoding import _KEEP_FRACTION

    backend = embedded[name]
    texts = ["Hi.", "OK", *dev_sentences(6), "Click OK to save the document and close the window when you are done."]
    extra = {"num_return_sequences": 2} if n > 1 else {}
    runs = {}
    for dropping in (False, True):
        engine = _Rows(backend.model, dropping)
        wrapped = Backend(name, engine, backend.tokenizer, backend.manifest, backend.info)
        runs[dropping] = (wrapped.translate(texts, num_beams=n, max_new_tokens=64, **extra), engine.rows)
    (full, full_rows), (dropped, dropped_rows) = runs[False], runs[True]
    rows = n * len(texts)
    assert set(full_rows) == {rows}
    lengths = sorted(len(t.token_ids) for t in full)
    assert lengths[0] < lengths[-1], lengths  # sentences end at different steps: something to drop
    assert dropped_rows[0] == rows and dropped_rows[-1] < rows and dropped_rows == sorted(dropped_rows, reverse=True)
    assert all(r % n == 0 for r in dropped_rows)  # beam search: every beam of a sentence together
    drops = [(a, b) for a, b in zip(dropped_rows, dropped_rows[1:]) if b < a]
    if n == 1:
        # Greedy search drops rows in groups (a quarter of those computed, at least one sentence),
        # not at every finish: each drop copies every cache tensor.
        assert drops and all(a - b >= max(1, a // _KEEP_FRACTION) for a, b in drops), drops
    else:
        # Beam search's drops ride on the reorder's copy: a sentence goes as soon as it is done.
        assert drops and any(a - b == n for a, b in drops), drops
    if name == "ort_int8":
        # Dynamic quantization scales each step's activations over all the rows it is given, so
        # int8's numbers depend on a sentence's batch neighbours anyway; fewer neighbours, other numbers.
        assert sum(a.token_ids == b.token_ids for a, b in zip(full, dropped)) >= len(texts) // 2
        return
    assert len(dropped_rows) == len(full_rows)
    for a, b in zip(full, dropped):
        assert a.token_ids == b.token_ids and a.text == b.text
        if n > 1:
            assert [(h.text, h.token_ids) for h in a.hypotheses] == [(h.text, h.token_ids) for h in b.hypotheses]
            np.testing.assert_allclose([h.score for h in a.hypotheses], [h.score for h in b.hypotheses], atol=1e-5)
        np.testing.assert_allclose([s.logprob for s in a.scores], [s.logprob for s in b.scores], atol=1e-5)
        assert [s.top_ids for s in a.scores] == [s.top_ids for s in b.scores]


@pytest.mark.parametrize("name", ["ort_fp32_kv_cache", "ort_fp16", "ort_int8"])
def test_kv_engines_share_each_sentences_cross_attention_across_its_beams(embedded, name):
    """The export's decoders take the cross-attention inputs once per sentence: `expand` leaves them
    at one row per sentence, `keep` shrinks them by sentence and refuses a part of a sentence's beams."""
    engine = embedded[name].model
    assert engine.shared_cross
    batch = embedded[name].tokenizer.encode(["The cat sat on the mat.", "Open the file.", "Save it."], 64)
    state = engine.encode(batch.input_ids, batch.attention_mask)
    engine.expand(state, 4)
    decoder_ids = np.full((12, 1), embedded[name].special.decoder_start, dtype=np.int64)
    assert engine.step(state, decoder_ids).shape[0] == 12
    assert state.cross[0].shape()[0] == 3 and state.past[0].shape()[0] == 12 and state.mask.shape[0] == 3
    engine.keep(state, np.arange(4, 12))
    assert state.cross[0].shape()[0] == 2 and state.past[0].shape()[0] == 8
    assert np.array_equal(state.mask, batch.attention_mask[1:])
    with pytest.raises(ValueError, match="whole sentences"):
        engine.keep(state, np.array([0, 1, 2, 4, 5, 6, 7, 3]))


@pytest.mark.parametrize("name", ["ort_fp32_kv_cache", "ort_int8"])
def test_kv_engines_run_the_first_beam_step_once_per_sentence(embedded, name):
    """Until a beam has chosen a token, a sentence's beams are copies of one row: the first step
    runs once per sentence and its logits and cache are repeated, with the numbers of each sentence
    entered four times. Beams that already differ all run."""
    backend = embedded[name]
    engine, start = backend.model, backend.special.decoder_start
    batch = backend.tokenizer.encode(["The cat sat on the mat.", "Open the file.", "Save it."], 64)
    shared = engine.encode(batch.input_ids, batch.attention_mask)
    engine.expand(shared, 4)
    assert shared.past[0].shape()[0] == 3  # not widened before the first step
    ids = np.full((12, 1), start, dtype=np.int64)
    copies = np.array(engine.step(shared, ids))
    np.testing.assert_array_equal(copies, np.repeat(copies[::4], 4, axis=0))
    assert shared.past[0].shape()[0] == 12 and shared.beams == 4

    entered = engine.encode(np.repeat(batch.input_ids, 4, axis=0), np.repeat(batch.attention_mask, 4, axis=0))
    np.testing.assert_allclose(engine.step(entered, ids), copies, atol=1e-4)
    nxt = np.concatenate([ids, np.argmax(copies, axis=-1)[:, None]], axis=1)
    np.testing.assert_allclose(engine.step(shared, nxt), engine.step(entered, nxt), atol=1e-4)

    apart = engine.encode(batch.input_ids, batch.attention_mask)
    engine.expand(apart, 4)
    differ = ids.copy()
    differ[5, 0] = backend.special.eos  # one beam of the second sentence starts elsewhere
    every = np.array(engine.step(apart, differ))
    assert apart.past[0].shape()[0] == 12 and np.abs(every[5] - copies[5]).max() > 1e-3
    if name != "ort_int8":  # int8 quantizes each step's activations by the whole batch's range
        same = np.flatnonzero(differ[:, 0] == start)
        np.testing.assert_allclose(every[same], copies[same], atol=1e-4)


def test_beam_search_rows_must_be_whole_sentences():
    from backends.beam_search import BeamSearchDecoder
    from backends.generation import GenerationDefaults, SpecialTokens
    from backends.options import DecodeOptions

    special = SpecialTokens(pad=0, eos=1, decoder_start=0, unk=2, bad_words_ids=(0,))
    options = DecodeOptions(max_new_tokens=5, num_beams=2).resolved(5)
    decoder = BeamSearchDecoder(3, special, options, GenerationDefaults(), 1)
    logits = np.zeros((4, 8), dtype=np.float32)
    ids = np.zeros((6, 1), dtype=np.int64)
    with pytest.raises(ValueError, match="every beam of each sentence"):
        decoder.update(0, ids, logits, np.array([0, 2, 3, 4]))
    # sentences 0 and 2 (rows 0, 1, 4, 5): sentence 1's rows continue themselves with pad
    next_ids, beam_idx, _ = decoder.update(0, ids, logits, np.array([0, 1, 4, 5]))
    assert next_ids.shape == (6, 2) and list(next_ids[2:4, 1]) == [0, 0] and list(beam_idx[2:4]) == [2, 3]
    assert set(beam_idx[:2]) <= {0, 1} and set(beam_idx[4:]) <= {4, 5}
