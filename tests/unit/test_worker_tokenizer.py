"""The worker's tokenizer (services.worker.torch.tokenizer) on the tiny model folder: the plain
`tokenizers` path gives transformers' ids and text, and folders whose settings it would not
honour fall back to transformers' AutoTokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from services.worker.tiny_model import render_chat
from services.worker.torch.tokenizer import FastTokenizer, load_tokenizer
from tests.model_fixtures import tiny_model_dir  # noqa: F401

TEXTS = [
    "Where is my order 12345?",
    "Hello , world . It 's fine",
    "  spaced   out\n\ttabs ",
    "emoji 🙂 and accents é",
    "我的订单在哪里？",
    "可以用支付宝付款吗？ mixed 中文 and English",
    render_chat([{"role": "user", "content": "Can I pay with PayPal?"}], add_generation_prompt=True),
    render_chat(
        [
            {"role": "system", "content": "You are a helpful shopping assistant."},
            {"role": "user", "content": "我想退跑步鞋。"},
            {"role": "assistant", "content": "跑步鞋可以在七天内退货。"},
        ]
    ),
    "",
]


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir):
    """(ours, transformers') for the tiny model folder."""
    return (load_tokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True))


def test_tiny_model_gets_the_plain_tokenizer(tokenizers):
    ours, theirs = tokenizers
    assert isinstance(ours, FastTokenizer)
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizers, text):
    ours, theirs = tokenizers
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert all(isinstance(i, int) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(tokenizers, text):
    ours, theirs = tokenizers
    ids = theirs.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids) == text  # byte-level BPE round-trips exactly


def test_skip_special_tokens_drops_the_chat_markers(tokenizers):
    ours, _theirs = tokenizers
    text = render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ours.encode(text, add_special_tokens=False)
    assert ids[0] == 0  # <|begin_of_text|> is one special token, not its characters
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"


@pytest.mark.parametrize(
    "change",
    [
        {"clean_up_tokenization_spaces": True},
        {"tokenizer_class": "LlamaTokenizerFast"},
    ],
    ids=["clean-up-spaces", "other-tokenizer-class"],
)
def test_other_settings_fall_back_to_transformers(tiny_model_dir, tmp_path, change):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(change)
    config_file.write_text(json.dumps(config))

    tokenizer = load_tokenizer(folder)
    assert not isinstance(tokenizer, FastTokenizer)
    expected = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(tokenizer) is type(expected)
    text = "Where is my order 12345?"
    assert tokenizer.encode(text, add_special_tokens=False) == expected.encode(text, add_special_tokens=False)
