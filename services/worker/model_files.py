"""Reads what a worker publishes about a Hugging Face model folder, without loading weights.

`model_version` is a content hash of everything that changes a model's output (weights,
config, tokenizer, chat template), so two replicas agree on a version exactly when they
would generate the same tokens, and KV blocks are never shared across versions.
`describe_model` gathers the ModelDescription fields: tokenizer.json bytes, chat template,
BOS/EOS tokens and ids, and the maximum context.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from services.worker.engine import ModelDescription

# Files that define a model's behaviour. Anything else in the folder (READMEs, build notes,
# our own ballast.json) is ignored so it cannot change the version.
_VERSIONED_NAMES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_CHUNK = 1 << 20


def _versioned_files(model_dir: Path) -> list[Path]:
    files = [model_dir / n for n in _VERSIONED_NAMES if (model_dir / n).is_file()]
    files += [p for p in model_dir.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES]
    return sorted(set(files), key=lambda p: p.name)


def model_version(model_dir: Path, length: int = 16) -> str:
    """A short hex sha256 over the names and bytes of the model's defining files."""
    model_dir = Path(model_dir)
    files = _versioned_files(model_dir)
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in files):
        raise FileNotFoundError(f"no weights (*.safetensors / *.bin) in {model_dir}")
    digest = hashlib.sha256()
    for path in files:
        # Name and size delimit each file, so moving bytes between files changes the hash.
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()[:length]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str:
    # tokenizer_config.json stores special tokens either as strings or AddedToken dicts.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def read_chat_template(model_dir: Path) -> str:
    """The default chat template: chat_template.jinja (transformers 5 layout) or the
    `chat_template` entry of tokenizer_config.json; "" when the model has none."""
    model_dir = Path(model_dir)
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(model_dir / "tokenizer_config.json").get("chat_template", "")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template", "") for t in template}
        template = named.get("default") or next(iter(named.values()), "")
    return template or ""


def max_context(config: dict[str, Any]) -> int:
    """The longest sequence (prompt + output) the model accepts."""
    text_config = config.get("text_config") or config
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        if text_config.get(key):
            return int(text_config[key])
    raise ValueError("config.json names no maximum context length")


def describe_model(model_dir: Path, name: str, version: str | None = None) -> ModelDescription:
    """The ModelDescription of the folder. EOS ids are every id that ends generation:
    generation_config's list, the config's, and the tokenizer's eos token."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    gen_config = _read_json(model_dir / "generation_config.json")
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    tokenizer_json = (model_dir / "tokenizer.json").read_bytes()
    vocab = _vocabulary(json.loads(tokenizer_json))

    bos = _token_content(tok_config.get("bos_token"))
    eos = _token_content(tok_config.get("eos_token"))
    eos_ids = _as_ids(gen_config.get("eos_token_id")) + _as_ids(config.get("eos_token_id"))
    if eos in vocab:
        eos_ids.append(vocab[eos])
    return ModelDescription(
        name=name,
        version=version or model_version(model_dir),
        max_context=max_context(config),
        tokenizer_json=tokenizer_json,
        chat_template=read_chat_template(model_dir),
        bos_token=bos,
        eos_token=eos,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),  # de-duplicated, first-seen order
    )


def _vocabulary(tokenizer: dict[str, Any]) -> dict[str, int]:
    raw = tokenizer.get("model", {}).get("vocab") or {}
    if isinstance(raw, dict):
        vocab = dict(raw)
    else:  # unigram models store a list of [piece, score]
        vocab = {piece: i for i, (piece, _score) in enumerate(raw)}
    vocab.update({t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])})
    return vocab
