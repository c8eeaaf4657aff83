"""Splitting text into segments the model can read: nothing lost, every piece within the limit."""

from __future__ import annotations

import re

import pytest

from service.segment import clean, join_translations, split_text


def words_plus_eos(text: str) -> int:
    return len(text.split()) + 1


def no_whitespace(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Hello world. How are you? Fine!", ["Hello world.", "How are you?", "Fine!"]),
        ("Line one\nLine two", ["Line one", "Line two"]),
        ('He said "stop." Then left.', ['He said "stop."', "Then left."]),
        ("你好。世界！ok", ["你好。", "世界！", "ok"]),
        ("Version 2.5 is out.", ["Version 2.5 is out."]),
        ("...", ["..."]),
    ],
)
def test_sentences(text, expected):
    assert [s.text for s in split_text(text, words_plus_eos, 512)] == expected


def test_over_long_sentence_is_chunked_at_words_and_nothing_is_lost():
    text = " ".join(f"w{i}" for i in range(95)) + ". Short one."
    segments = split_text(text, words_plus_eos, 10)
    assert all(words_plus_eos(s.text) <= 10 for s in segments)
    assert [s.chunked for s in segments] == [True] * 11 + [False]
    assert no_whitespace("".join(s.text for s in segments)) == no_whitespace(text)
    assert all(text[s.start : s.end] == s.text for s in segments)


def test_one_endless_word_is_cut_at_characters():
    text = "a" * 500

    def count(s):
        return len(s) // 4 + 1

    segments = split_text(text, count, 20)
    assert all(count(s.text) <= 20 for s in segments)
    assert "".join(s.text for s in segments) == text
    assert len(segments) == 7


def test_clean_drops_control_characters_but_keeps_text():
    assert clean("a\x00b\x07c\nd\te") == "a b c\nd\te"
    assert clean("مرحبا 😀 你好") == "مرحبا 😀 你好"
    assert clean("\u200fRTL mark") == "\u200fRTL mark"  # format characters are text


def test_join_keeps_latin_words_apart_only():
    assert join_translations(["你好。", "世界。"]) == "你好。世界。"
    assert join_translations(["版本 2", "OK"]) == "版本 2 OK"
