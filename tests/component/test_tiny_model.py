"""The generated tiny model: reproducible build, standard loading, chat template, description."""

from __future__ import annotations

import json
import shutil

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.model_files import describe_model, model_version
from services.worker.tiny_model import (
    BOS,
    IM_END,
    SPECIAL_TOKENS,
    build_tiny_model,
    ensure_tiny_model,
    render_chat,
)
from tests.model_fixtures import tiny_model_dir  # noqa: F401

EXPECTED_FILES = {
    "ballast.json",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
MESSAGES = [
    {"role": "system", "content": "You are a helpful shopping assistant."},
    {"role": "user", "content": "可以用支付宝付款吗？"},
]


def test_rebuild_is_byte_identical(tiny_model_dir, tmp_path):
    progress: list[str] = []
    again = build_tiny_model(tmp_path / "again", preset="tiny", progress=progress.append)
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert names == {p.name for p in again.iterdir()} == EXPECTED_FILES
    for name in sorted(names):
        assert (tiny_model_dir / name).read_bytes() == (again / name).read_bytes(), name
    assert model_version(again) == model_version(tiny_model_dir)
    assert "training tokenizer" in progress and "initialising weights" in progress


def test_loads_with_transformers_and_generates(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == model.config.vocab_size == 512
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert model.config.max_position_embeddings == 2048
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tokenizer.bos_token == BOS and tokenizer.eos_token == IM_END

    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert tokenizer.decode(out[0], skip_special_tokens=False).startswith(prompt)


def test_chat_template_renders_chatml(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert (
        rendered
        == render_chat(MESSAGES, add_generation_prompt=True)
        == (
            "<|begin_of_text|><|im_start|>system\nYou are a helpful shopping assistant.<|im_end|>\n"
            "<|im_start|>user\n可以用支付宝付款吗？<|im_end|>\n<|im_start|>assistant\n"
        )
    )
    turn = [*MESSAGES, {"role": "assistant", "content": "可以。"}]
    assert tokenizer.apply_chat_template(turn, tokenize=False) == render_chat(turn)
    # Special tokens stay whole, and no BOS is added on top of the template's own.
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert ids[:2] == [0, 2] and ids.count(0) == 1


def test_describe_model(tiny_model_dir):
    d = describe_model(tiny_model_dir, "tiny")
    assert d.name == "tiny" and len(d.version) == 16
    assert d.max_context == 2048
    assert d.tokenizer_json == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert "<|im_start|>" in d.chat_template
    assert (d.bos_token, d.eos_token) == (BOS, IM_END)
    assert d.eos_token_ids == (3, 1)


def test_version_changes_with_content_only(tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "ballast.json").write_text("{}")  # build notes do not define the model
    assert model_version(copy) == model_version(tiny_model_dir)
    config = json.loads((copy / "generation_config.json").read_text())
    config["eos_token_id"] = [3]
    (copy / "generation_config.json").write_text(json.dumps(config))
    assert model_version(copy) != model_version(tiny_model_dir)


def test_ensure_does_not_rebuild_a_complete_folder(tiny_model_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    before = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    assert ensure_tiny_model(copy, "tiny") == copy
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == before


def test_bench_preset_is_larger(tmp_path):
    folder = build_tiny_model(tmp_path / "bench", preset="bench")
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 2048 and config["max_position_embeddings"] == 8192
    assert config["hidden_size"] >= 256 and config["num_hidden_layers"] >= 4
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    meta = json.loads((folder / "ballast.json").read_text())
    assert meta["preset"] == "bench" and meta["parameters"] > 4_000_000


def test_a_folder_built_from_an_older_preset_is_not_current(tmp_path):
    import dataclasses
    import json

    from services.worker.tiny_model import PRESETS, built_preset

    assert built_preset(tmp_path) is None  # not Ballast's: never rebuilt over
    spec = dataclasses.asdict(PRESETS["tiny"])
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "ballast.json").write_text(json.dumps({"preset": "tiny", "spec": spec}))
    assert built_preset(tmp_path) == ("tiny", True)
    (tmp_path / "ballast.json").write_text(json.dumps({"preset": "tiny", "spec": {**spec, "heads": 4}}))
    assert built_preset(tmp_path) == ("tiny", False)
    (tmp_path / "ballast.json").write_text(json.dumps({"preset": "tiny"}))  # built before specs were kept
    assert built_preset(tmp_path) == ("tiny", False)
