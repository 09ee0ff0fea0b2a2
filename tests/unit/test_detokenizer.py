"""Incremental detokenization (UTF-8 hold-back, resume) and stop strings."""

from __future__ import annotations

import random

import pytest

from services.worker.detokenizer import IncrementalDetokenizer, StopMatcher, TextStream
from services.worker.tiny_model import SPECIAL_TOKENS, corpus, train_tokenizer

TEXT = "Your order 12345 has shipped. 您的订单已经发货，预计3天到达。Thanks 🎁 ok"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(corpus(), 512)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids]


def test_streamed_text_concatenates_to_full_decode(tok):
    ids = tok.encode(TEXT).ids
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_partial_characters_are_held_back(tok):
    # Byte tokens of one Chinese character: nothing is released until the last byte.
    byte_ids = [tok.token_to_id(c) for c in "äº¬"]  # byte-level alphabet spelling of 京
    assert None not in byte_ids
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in byte_ids] == ["", "", "京"]


@pytest.mark.parametrize("skip_special", [True, False])
def test_random_ids_including_invalid_utf8_match_full_decode(tok, skip_special):
    rng = random.Random(5)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special)
        text = "".join(_stream(detok, ids)) + detok.flush()
        assert text == tok.decode(ids, skip_special_tokens=skip_special)


def test_resume_emits_only_text_of_new_tokens(tok):
    rng = random.Random(9)
    vocab = tok.get_vocab_size()
    samples = [tok.encode(TEXT).ids] + [[rng.randrange(vocab) for _ in range(25)] for _ in range(50)]
    for ids in samples:
        for k in range(len(ids) + 1):
            first = IncrementalDetokenizer(tok)
            sent = "".join(_stream(first, ids[:k]))  # what the first replica streamed
            resumed = IncrementalDetokenizer(tok, initial_ids=ids[:k])
            rest = "".join(_stream(resumed, ids[k:])) + resumed.flush()
            assert sent + rest == tok.decode(ids)


def test_special_tokens_are_skipped_by_default(tok):
    ids = [tok.token_to_id(SPECIAL_TOKENS[2])] + tok.encode("hi").ids + [tok.token_to_id(SPECIAL_TOKENS[3])]
    detok = IncrementalDetokenizer(tok)
    assert "".join(_stream(detok, ids)) + detok.flush() == "hi"


def _feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = ""
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out += text
        if stopped:
            return out, True
    return out + matcher.flush(), False


def test_stop_string_is_cut_and_not_returned():
    assert _feed_all(StopMatcher(["\nuser"]), list("Hello there.\nuser: hi")) == ("Hello there.", True)
    assert _feed_all(StopMatcher(["END"]), ["abcE", "N", "Dxyz"]) == ("abc", True)
    assert _feed_all(StopMatcher(["END"]), ["no stop here"]) == ("no stop here", False)


def test_possible_stop_prefix_is_held_until_disambiguated():
    m = StopMatcher(["cd", "xyz"])
    assert m.feed("abc") == ("ab", False)  # "c" may start "cd"
    assert m.feed("x") == ("c", False)  # "x" may start "xyz"
    assert m.feed("y") == ("", False)
    assert m.feed("!") == ("xy!", False)
    assert m.flush() == ""


def test_earliest_stop_string_wins():
    assert _feed_all(StopMatcher(["world", "lo w"]), ["hello world"]) == ("hel", True)


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        StopMatcher([""])


def test_text_stream_with_stop_string_spanning_tokens_and_characters(tok):
    ids = tok.encode(TEXT).ids
    stream = TextStream(tok, stops=["已经发货"])
    out, stopped = "", False
    for i in ids:
        text, stopped = stream.push(i)
        out += text
        if stopped:
            break
    assert stopped and out == "Your order 12345 has shipped. 您的订单"


def test_text_stream_resume_with_held_stop_prefix(tok):
    ids = tok.encode(TEXT).ids
    for k in range(len(ids) + 1):
        first = TextStream(tok, stops=["Thanks!"])
        sent = "".join(first.push(i)[0] for i in ids[:k])
        resumed = TextStream(tok, stops=["Thanks!"], initial_ids=ids[:k])
        rest = "".join(resumed.push(i)[0] for i in ids[k:]) + resumed.finish()
        assert sent + rest == TEXT
