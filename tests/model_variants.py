"""A second version of the tiny model: the same tokenizer and architecture, perturbed weights.

Rollout tests need two model versions that answer differently. Rebuilding with another seed
would retrain; nudging the output head of the built model with seeded noise is instant and
gives a different content hash and different greedy answers.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

_variants: dict[str, Path] = {}


def derive_variant(source: Path, target: Path, seed: int = 1, scale: float = 1.0) -> Path:
    """Copies a model folder, adding seeded noise (`scale` x the tensor's std) to its output head."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target, dirs_exist_ok=True)
    tensors = load_file(str(source / "model.safetensors"))
    head = tensors["lm_head.weight"]
    noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(seed), dtype=head.dtype)
    tensors["lm_head.weight"] = (head + noise * head.std() * scale).contiguous()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="session")
def tiny_model_v2_dir(tiny_model_dir, tmp_path_factory) -> Path:
    if "v2" not in _variants:
        _variants["v2"] = derive_variant(tiny_model_dir, tmp_path_factory.mktemp("tiny-model-v2"))
    return _variants["v2"]
