"""The shipped model's conventions, and the training code on a tiny synthetic corpus."""
from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from corpus import dev_sentences, read_pairs  # noqa: E402
from train import data, loop  # noqa: E402
from train.model import ModelSize, build_model, count_parameters  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "assets" / "marian-en-zh-small"


# -- the shipped model --------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    from transformers import MarianMTModel, MarianTokenizer

    tok = MarianTokenizer.from_pretrained(str(SHIPPED))
    model = MarianMTModel.from_pretrained(str(SHIPPED))
    return tok, model


def test_shipped_size_limits(shipped):
    # The demo's budget (issue 18): at most 30M parameters and 120 MB on disk.
    _, model = shipped
    assert count_parameters(model) <= 30_000_000
    assert (SHIPPED / "model.safetensors").stat().st_size <= 120 * 1000 * 1000
    leftovers = [p.name for p in SHIPPED.iterdir() if p.suffix in (".pt", ".bin", ".txt", ".log")]
    assert leftovers == []


def test_shipped_special_ids(shipped):
    tok, model = shipped
    vocab = tok.get_vocab()
    pad = len(vocab) - 1
    assert (vocab["</s>"], vocab["<unk>"], vocab["<pad>"]) == (0, 1, pad)
    assert (tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (0, 1, pad)
    cfg = model.config
    assert cfg.vocab_size == len(vocab)
    assert (cfg.pad_token_id, cfg.decoder_start_token_id, cfg.eos_token_id) == (pad, pad, 0)
    gen = model.generation_config
    assert gen.bad_words_ids == [[pad]] and gen.max_length == 512 and not gen.do_sample
    # config.json carries the same decoding setting for tools that read it there.
    raw = json.loads((SHIPPED / "config.json").read_text())
    assert raw["bad_words_ids"] == [[pad]] and raw["max_length"] == 512 and raw["num_beams"] == gen.num_beams
    assert raw.get("no_repeat_ngram_size", 0) == (gen.no_repeat_ngram_size or 0)
    assert raw.get("repetition_penalty", 1.0) == (gen.repetition_penalty or 1.0)
    assert (raw["activation_function"], raw["max_position_embeddings"], raw["scale_embedding"]) == ("swish", 512, True)


def test_shipped_tokenizer_round_trip(shipped):
    tok, _ = shipped
    ids = tok("Click OK to save the document.").input_ids
    assert ids[-1] == 0 and 1 not in ids
    zh = "点击「确定」，保存文档。"
    tgt = tok(text_target=zh).input_ids
    assert tgt[-1] == 0 and 1 not in tgt
    assert tok.decode(tgt, skip_special_tokens=True) == zh


def test_shipped_translates(shipped):
    tok, model = shipped
    enc = tok(["My father works in a factory."], return_tensors="pt")
    out = model.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=32)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert "工厂" in text, text


def test_shipped_scores_meet_floor():
    result = json.loads((SHIPPED / "eval.json").read_text())
    assert result["whole"]["rows"] == 500
    assert result["whole"]["bleu"] >= 10 and result["whole"]["chrf"] >= 10
    assert result["tatoeba"]["rows"] + result["docs"]["rows"] == 500


def test_examples_file():
    lines = (REPO / "assets" / "examples.tsv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "en" and len(lines) - 1 == 12
    dev_en = set(dev_sentences())
    assert len(dev_en) > 400
    assert not dev_en & set(lines[1:])


# -- data and batching --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["train.tsv.gz", "extra.tsv.gz"])
def test_training_files_disjoint_from_dev(name):
    dev = read_pairs(REPO / "data" / "dev.tsv", require_zh=True)
    dev_en, dev_zh = {data.dev_key(p.en) for p in dev}, {data.dev_key(p.zh) for p in dev}
    pairs = read_pairs(REPO / "data" / name, require_zh=True)
    assert len(pairs) > 6000
    assert not [p for p in pairs if data.dev_key(p.en) in dev_en or data.dev_key(p.zh) in dev_zh]


def test_dev_key_folds_case_width_and_punctuation():
    assert data.dev_key("Where is the  station?") == data.dev_key("where is the station") == "whereisthestation"
    assert data.dev_key("今天很冷。") == data.dev_key("今天很冷") and data.dev_key("ＡＢＣ，") == "abc"
    assert data.dev_key("今天很冷。") != data.dev_key("今天不冷。")


def test_read_tsv_never_merges_quoted_rows(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text('source\ten\tzh\nx\tSay "hi\t说“嗨\nx\tthen" bye\t然后再见\n', encoding="utf-8")
    pairs = read_pairs(path)
    assert [p.en for p in pairs] == ['Say "hi', 'then" bye']


def test_filter_reasons():
    P = data.Pair
    pairs = [
        P("Click %s to continue.", "点击 %s 以继续。", "a"),
        P("Click %s to continue.", "点击 %s 以继续。", "a"),                 # duplicate
        P("", "空", "a"),                                                   # empty
        P("A long English sentence with many words in it.", "好", "a"),     # ratio
        P("This string was never translated at all.", "This string was never translated at all.", "a"),
        P("Choose Edit - Undo.", "选择「编辑 - 撤销」。", "libreoffice_help"),
    ]
    kept, stats = data.filter_pairs(pairs)
    assert [p.zh for p in kept] == ["点击 %s 以继续。", "选择「编辑 - 撤销」。"]
    assert stats["dropped"] == {"duplicate": 1, "empty": 1, "length_ratio": 1, "untranslated": 1}
    # Full-width Chinese punctuation survives normalisation.
    kept, _ = data.filter_pairs([P("Yes, no?", "是，否？", "a")])
    assert kept[0].zh == "是，否？"


def test_batches_respect_token_budget_and_shift():
    rng = random.Random(0)
    encoded = [([5] * rng.randint(2, 30) + [0], [6] * rng.randint(2, 30) + [0]) for _ in range(500)]
    batches = loop.make_batches(encoded, 400, random.Random(1))
    assert sorted(i for b in batches for i in b) == list(range(500))
    for b in batches:
        longest = max(max(len(encoded[i][0]), len(encoded[i][1])) for i in b)
        assert len(b) == 1 or longest * len(b) * 2 <= 400
    input_ids, mask, dec_in, labels = loop.collate(encoded, batches[0], pad=99)
    row = encoded[batches[0][0]][1]
    assert dec_in[0, 0] == 99 and dec_in[0, 1 : len(row)].tolist() == row[:-1]
    assert labels[0, : len(row)].tolist() == row and (labels[0, len(row) :] == -100).all()
    assert (mask == input_ids.ne(99)).all()


def test_inverse_sqrt_schedule():
    f = loop.inverse_sqrt(100)
    assert f(50) == pytest.approx(0.5) and f(100) == pytest.approx(1.0) and f(400) == pytest.approx(0.5)
    # a warm start continues the source run's schedule: step 0 of it is step 300 of the source
    assert loop.inverse_sqrt(100, offset=300)(100) == pytest.approx(f(400))


# -- a tiny end-to-end run ----------------------------------------------------------------

NOUNS = [("apple", "苹果"), ("book", "书"), ("cat", "猫"), ("file", "文件"), ("window", "窗口")]
VERBS = [("open", "打开"), ("close", "关闭"), ("save", "保存"), ("delete", "删除")]


def _corpus(folder: Path) -> None:
    rows = [("src", f"Please {v} the {n} number {k}.", f"请{vz}第{k}个{nz}。")
            for k in range(10) for v, vz in VERBS for n, nz in NOUNS]
    folder.mkdir()
    (folder / "train.tsv").write_text("source\ten\tzh\n" + "".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    dev = [("tatoeba", "Please open the cat number 3.", "请打开第3个猫。"),
           ("doc", "Please save the file number 7.", "请保存第7个文件。")]
    (folder / "dev.tsv").write_text("source\ten\tzh\n" + "".join("\t".join(r) + "\n" for r in dev), encoding="utf-8")


TINY = ["--d-model", "32", "--heads", "2", "--ffn", "64", "--encoder-layers", "1", "--decoder-layers", "1",
        "--src-vocab", "60", "--tgt-vocab", "60", "--dev-subset", "2", "--max-tokens", "800",
        "--checkpoint-minutes", "100"]


def test_training_cli_and_resume(tmp_path):
    from train.__main__ import main
    from transformers import MarianMTModel, MarianTokenizer

    corpus = tmp_path / "corpus"
    _corpus(corpus)
    # Two training files, as data/train.tsv.gz + data/extra.tsv.gz: both are read.
    lines = (corpus / "train.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    (corpus / "train.tsv").write_text("".join(lines[:151]), encoding="utf-8")
    (corpus / "extra.tsv").write_text(lines[0] + "".join(lines[151:]), encoding="utf-8")
    out, run = tmp_path / "model", tmp_path / "run"
    common = ["--out", str(out), "--train", str(corpus / "train.tsv"), str(corpus / "extra.tsv"),
              "--dev", str(corpus / "dev.tsv"), "--run-dir", str(run), *TINY,
              "--num-beams", "2", "--no-repeat-ngram-size", "3"]
    main([*common, "--max-steps", "3", "--no-eval"])
    first = json.loads((run / "summary.json").read_text())
    assert first["steps"] == 3 and first["pairs_used"] == 200
    assert first["filter"]["read"] == 200
    main([*common, "--max-steps", "6", "--resume"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6
    assert "resumed at step 3" in (run / "train.log").read_text()
    result = json.loads((out / "eval.json").read_text())
    assert result["whole"]["rows"] == 2 and result["tatoeba"]["rows"] == 1
    assert 0 <= result["whole"]["repeat4_share"] <= result["whole"]["repeat3_share"] <= 1
    # The chosen decoding setting is shipped in both files and is the one the scores were made with.
    # (repetition_penalty not given: the shipped default, 1.2)
    assert result["decoding_options"] == {"num_beams": 2, "repetition_penalty": 1.2, "no_repeat_ngram_size": 3}
    tok = MarianTokenizer.from_pretrained(str(out))
    model = MarianMTModel.from_pretrained(str(out))
    pad = len(tok.get_vocab()) - 1
    assert model.config.decoder_start_token_id == pad and model.generation_config.bad_words_ids == [[pad]]
    gen = model.generation_config
    assert (gen.num_beams, gen.no_repeat_ngram_size, gen.repetition_penalty) == (2, 3, 1.2)
    raw = json.loads((out / "config.json").read_text())
    assert (raw["num_beams"], raw["no_repeat_ngram_size"]) == (2, 3)
    assert count_parameters(model) == summary["parameters"]
    # Each checkpoint left a snapshot; the learning curve scores them on the whole dev file.
    from train.curve import curve_table, score_run

    assert sorted(p.name for p in (run / "snapshots").iterdir()) == ["step-3.pt", "step-6.pt"]
    assert [r["step"] for r in score_run(run, corpus / "dev.tsv", only={6})] == [6]
    rows = score_run(run, corpus / "dev.tsv")
    assert [r["step"] for r in rows] == [3, 6] and rows[1]["minutes"] is not None
    assert json.loads((run / "curve.json").read_text()) == rows
    assert score_run(run, corpus / "dev.tsv") == rows  # already scored: nothing redone
    assert curve_table(rows).count("\n") == 3

    # A warm start from that model: its weights, size and tokenizer, a fresh optimizer, and the
    # learning rate continuing its schedule (step 0 here is step 6 there).
    warm_out, warm_run = tmp_path / "warm", tmp_path / "warm-run"
    main(["--out", str(warm_out), "--train", str(corpus / "train.tsv"), "--dev", str(corpus / "dev.tsv"),
          "--run-dir", str(warm_run), "--init-from", str(out), "--schedule-offset", "6", "--warmup", "2",
          "--lr", "1e-3", "--max-steps", "1", "--no-eval", "--dev-subset", "2", "--checkpoint-minutes", "100"])
    assert MarianTokenizer.from_pretrained(str(warm_out)).get_vocab() == tok.get_vocab()
    warm = MarianMTModel.from_pretrained(str(warm_out))
    assert count_parameters(warm) == summary["parameters"]
    log = (warm_run / "train.log").read_text()
    assert f"warm start from {out}" in log
    state = torch.load(warm_run / "checkpoint-latest.pt", weights_only=False)
    assert state["scheduler"]["_last_lr"][0] == pytest.approx(1e-3 * (2 / 7) ** 0.5)  # step 1 + 6


def test_training_cli_rejects_bad_decoding(capsys):
    from train.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--num-beams", "0"])
    assert "num_beams" in capsys.readouterr().err
    assert parse_args(["--out", "x"]).train[-1].name == "extra.tsv.gz"


# -- evaluation -----------------------------------------------------------------------------

def test_repeated_token_runs():
    from train.evaluate import longest_run, repeat_share

    assert longest_run("风风风风风风很很很。") == 6
    assert longest_run("今天很冷。") == 1
    # Words and numbers count as one token each, as sacrebleu's zh tokenizer splits them.
    assert longest_run("版本 3 3 3 3") == 4 and longest_run("aaaa") == 1
    hyps = ["空单元格不计数或被被被被", "今天很冷。", "哈哈哈", "好好好好好"]
    assert repeat_share(hyps) == 0.5 and repeat_share(hyps, min_run=3) == 0.75 and repeat_share([]) == 0.0


def test_decoding_setting():
    from transformers import GenerationConfig

    from train.evaluate import Decoding, sweep_table

    d = Decoding.parse("5:1.2:3")
    assert (d.num_beams, d.repetition_penalty, d.no_repeat_ngram_size) == (5, 1.2, 3)
    assert Decoding.parse("4") == Decoding(num_beams=4)
    assert d.generate_kwargs() == {"num_beams": 5, "do_sample": False, "repetition_penalty": 1.2,
                                   "no_repeat_ngram_size": 3}
    for bad in ("0", "5:0.5", "5:1.0:-1", "1:2:3:4"):
        with pytest.raises(ValueError):
            Decoding.parse(bad)
    assert Decoding.of(GenerationConfig(num_beams=4, no_repeat_ngram_size=3)) == Decoding(4, 1.0, 3)
    table = sweep_table([{**dataclasses.asdict(d), "bleu": 30.1, "chrf": 27.0, "tatoeba_bleu": 22.5,
                          "docs_bleu": 33.0, "repeat4_share": 0.012, "repeat3_share": 0.05, "decode_seconds": 40}])
    assert table.splitlines()[-1] == "| 5 | 1.2 | 3 | 30.10 | 27.00 | 22.50 | 33.00 | 1.2% | 5.0% | 40 |"


def test_no_repeat_ngram_removes_stutter(tmp_path):
    """The decoding options really reach generate(): n-gram blocking caps a looping model's runs."""
    from train.evaluate import Decoding, longest_run, translate
    from train.tokenizer import train_spm, write_tokenizer

    corpus = tmp_path / "corpus"
    _corpus(corpus)
    pairs = read_pairs(corpus / "train.tsv")
    src = train_spm([p.en for p in pairs], tmp_path / "spm" / "source", 60, 1.0)
    tgt = train_spm([p.zh for p in pairs], tmp_path / "spm" / "target", 60, 1.0, "identity")
    tok = write_tokenizer(tmp_path / "tok", src, tgt, [p.zh for p in pairs[:5]])
    model = build_model(len(tok.get_vocab()), ModelSize(d_model=32, heads=2, ffn=64, encoder_layers=1, decoder_layers=1))
    # An untrained model that always prefers one Chinese piece: greedy repeats it to the length cap.
    piece = tok.get_vocab()[tok.spm_target.encode("猫", out_type=str)[-1]]
    with torch.no_grad():
        model.final_logits_bias[0, piece] = 50.0
    greedy = translate(model, tok, ["Please open the cat number 3."])[0]
    blocked = translate(model, tok, ["Please open the cat number 3."], decoding=Decoding(no_repeat_ngram_size=1))[0]
    assert longest_run(greedy) >= 4, greedy
    assert longest_run(blocked) <= 1, blocked


def test_loss_goes_down(tmp_path):
    """A few updates on one repeated batch must cut the loss: the loop really learns."""
    from train.tokenizer import train_spm, write_tokenizer

    corpus = tmp_path / "corpus"
    _corpus(corpus)
    pairs = read_pairs(corpus / "train.tsv")
    src = train_spm([p.en for p in pairs], tmp_path / "spm" / "source", 60, 1.0)
    tgt = train_spm([p.zh for p in pairs], tmp_path / "spm" / "target", 60, 1.0, "identity")
    tok = write_tokenizer(tmp_path / "tok", src, tgt, [p.zh for p in pairs[:5]])
    encoded = loop.encode_pairs(tok, pairs, 128)
    model = build_model(len(tok.get_vocab()), ModelSize(d_model=32, heads=2, ffn=64, encoder_layers=1, decoder_layers=1))
    trainer = loop.Trainer(model, tok, encoded, [], tmp_path / "run", loop.TrainOptions(lr=3e-3, warmup=5, label_smoothing=0.0))
    batch = loop.collate(encoded, list(range(0, 200, 4)), model.config.pad_token_id)
    first = trainer.loss(batch)[0].detach()
    for _ in range(60):
        loss, _ = trainer.loss(batch)
        trainer.optimizer.zero_grad()
        loss.backward()
        trainer.optimizer.step()
        trainer.scheduler.step()
    last = trainer.loss(batch)[0].detach()
    # An untrained model is near-uniform over the vocabulary; 60 updates must cut that by 40%.
    assert abs(float(first) - math.log(len(tok.get_vocab()))) < 0.3
    assert float(last) < 0.6 * float(first), (float(first), float(last))
