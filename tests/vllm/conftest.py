"""The vLLM tier: Ballast's vLLM engine on real vLLM (its CPU build here and in CI, `vllm`
on a GPU machine), the same tiny model folder the torch engine serves.

One vLLM engine per test module keeps the tier short: vLLM takes 30-80 s to start on two busy
cores. Where vLLM is not installed the tier skips with the reason, unless BALLAST_REQUIRE_VLLM
is set (`make test` sets it): then a missing vLLM fails the run instead of passing it quietly.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ENV = "BALLAST_REQUIRE_VLLM"


def vllm_missing_reason() -> str:
    """Why vLLM cannot run here; "" when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install 'ballast[vllm]' on CPUs, 'ballast[gpu]' on GPUs)"
    return ""


def require_vllm() -> None:
    """Skips the calling module without vLLM, or fails it where vLLM is required."""
    reason = vllm_missing_reason()
    if not reason:
        return
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def cpu_settings(**overrides):
    """VllmSettings for the tiny model on vLLM's CPU build: float32 weights and KV, no CUDA
    graphs, 1 GiB of KV cache."""
    from services.worker.vllm import VllmSettings

    fields = {"kv_cache_dtype": "float32", "enforce_eager": True, "max_concurrency": 8}
    fields.update(overrides)
    return VllmSettings(**fields)
