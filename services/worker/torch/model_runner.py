"""The model behind the torch engine: forward passes over per-sequence KV caches.

Two runners with one shape, both used from the engine's compute thread only:
- `NativeRunner`: the plain-torch Llama-family decoder (services.worker.torch.llama). Decode steps
  of many sequences run as one batch, and the worker never imports transformers.
- `TransformersRunner`: any causal LM transformers can load, one sequence per forward pass.

`load_runner(..., runtime="auto")` picks the native one when it computes the model exactly
(`llama.supports`), else transformers; "native" or "transformers" forces one.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

import torch

RUNTIMES = ("auto", "native", "transformers")
# The native runner's KV pool at most: a 2-layer test model's slot of 2048 tokens is 1 MiB.
KV_POOL_BYTES = 256 << 20
KVPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class NativeRunner:
    name = "native"
    batched = True

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, kv_pool_slots: int = 0) -> None:
        """`kv_pool_slots`: sequences whose KV lives in the model's pool (batched attention);
        0 for none. The pool takes at most KV_POOL_BYTES."""
        from services.worker.torch.llama import LlamaModel

        self._model = LlamaModel(model_dir, dtype=dtype, device=device)
        if kv_pool_slots:
            self._model.attach_pool(kv_pool_slots, KV_POOL_BYTES)
        # Attribute access, as transformers' configs give it (for the KV block layout).
        self.config = SimpleNamespace(**self._model.config)

    def prefill(self, cache: Any, ids: Sequence[int]) -> tuple[torch.Tensor, Any]:
        if cache is None:
            cache = self._model.new_cache(len(ids) + 64)
        return self._model.prefill(cache, ids), cache

    def prefill_many(self, caches: Sequence[Any], id_lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[Any]]:
        caches = [
            self._model.new_cache(len(ids) + 64) if cache is None else cache for cache, ids in zip(caches, id_lists)
        ]
        return self._model.prefill_many(caches, id_lists), caches

    def decode(self, caches: Sequence[Any], tokens: Sequence[int]) -> tuple[torch.Tensor, list[Any]]:
        return self._model.decode(caches, tokens), list(caches)

    def from_pairs(self, pairs: KVPairs) -> Any:
        from services.worker.torch.llama import SequenceKV

        return SequenceKV.from_pairs(pairs, self._model.pool)

    def truncated(self, cache: Any, tokens: int) -> Any:
        return cache.truncated(tokens)


class TransformersRunner:
    name = "transformers"
    batched = False

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        self._model = model.to(device).eval()
        self._device = device
        self.config = self._model.config

    @torch.inference_mode()
    def prefill(self, cache: Any, ids: Sequence[int]) -> tuple[torch.Tensor, Any]:
        x = torch.tensor([list(ids)], dtype=torch.long, device=self._device)
        out = self._model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], out.past_key_values

    def prefill_many(self, caches: Sequence[Any], id_lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[Any]]:
        rows, new = [], []
        for cache, ids in zip(caches, id_lists):
            logits, cache = self.prefill(cache, ids)
            rows.append(logits)
            new.append(cache)
        return torch.stack(rows), new

    def decode(self, caches: Sequence[Any], tokens: Sequence[int]) -> tuple[torch.Tensor, list[Any]]:
        return self.prefill_many(caches, [[token] for token in tokens])

    def from_pairs(self, pairs: KVPairs) -> Any:
        from transformers import DynamicCache

        return DynamicCache(list(pairs), config=self._model.config)

    def truncated(self, cache: Any, tokens: int) -> Any:
        # Rebuilt rather than cropped in place: `crop` changed meaning across transformers 5
        # releases, and a pending save may still read the old tensors.
        from services.worker.kv.tensors import cache_pairs

        return self.from_pairs([(k[..., :tokens, :], v[..., :tokens, :]) for k, v in cache_pairs(cache)])


def load_runner(
    model_dir: Path, dtype: torch.dtype, device: torch.device, runtime: str = "auto", kv_pool_slots: int = 0
) -> NativeRunner | TransformersRunner:
    """The runner for the model in `model_dir` (see the module docstring for `runtime`);
    `kv_pool_slots` sizes the native runner's KV pool."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
    if runtime == "auto":
        from services.worker.torch.llama import supports

        config = json.loads((Path(model_dir) / "config.json").read_text())
        runtime = "native" if supports(config.get("text_config") or config) else "transformers"
    if runtime == "native":
        return NativeRunner(model_dir, dtype, device, kv_pool_slots)
    return TransformersRunner(model_dir, dtype, device)
