"""The engine conformance suite on vLLM (VllmEngine over AsyncLLM) on a CUDA GPU.

Skips without a GPU or without vLLM. Two engines run at once (EOS on and off), each with a
quarter of the GPU's memory (BALLAST_GPU_MEMORY_UTILIZATION overrides). Seeded resumes must
be exact, as on CPUs: Ballast's logits processor draws by (seed, position) (see
services/worker/vllm/processors.py); tests/vllm/ holds the same suite on vLLM's CPU build.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from tests.gpu.conftest import vllm_skip_reason

if vllm_skip_reason():
    pytest.skip(f"vLLM conformance: {vllm_skip_reason()}", allow_module_level=True)

from services.worker.engine import EngineRequest, Sampling  # noqa: E402
from services.worker.vllm import VllmEngine, VllmSettings, check_engine_config, read_model_facts  # noqa: E402
from services.worker.vllm.checks import gpu_memory_bytes  # noqa: E402
from tests.engine_conformance import EngineConformance, EngineFactory, factory_fixture  # noqa: E402
from tests.engine_conformance import conf_engine, endless  # noqa: E402,F401  (fixtures)

UTILIZATION = float(os.environ.get("BALLAST_GPU_MEMORY_UTILIZATION", "0.25"))


def gpu_settings(model_dir) -> VllmSettings:
    """16-bit weights run as stored with a KV cache of their dtype; the bench preset is
    stored in float32, which vLLM's attention kernels do not take, so it runs in float16."""
    facts = read_model_facts(model_dir)
    length = min(2048, facts.max_position_embeddings)
    if facts.weights_dtype == "float32":
        return VllmSettings(
            kv_cache_dtype="float16", dtype="float16", gpu_memory_utilization=UTILIZATION, max_model_len=length
        )
    return VllmSettings(kv_cache_dtype=facts.weights_dtype, gpu_memory_utilization=UTILIZATION, max_model_len=length)


def vllm_factory() -> EngineFactory:
    def make(model_dir, eos_token_ids=None, max_concurrency=4):
        settings = replace(gpu_settings(model_dir), max_concurrency=max_concurrency)
        return VllmEngine(model_dir, "conformance", settings, eos_token_ids=eos_token_ids)

    return EngineFactory("vllm", make, exact_seeded_resume=True, idle_timeout_s=10.0)


engine_factory = factory_fixture(vllm_factory())


@pytest.fixture(scope="module")
def conformance_model_dir(gpu_model_dir):
    return gpu_model_dir


class TestVllmEngineConformance(EngineConformance):
    async def test_reports_vllm_kv_use(self, endless):
        request = EngineRequest("kv", tuple(endless.tokenize("The customer paid")), (), Sampling(max_tokens=200))
        stream = endless.generate(request)
        for _ in range(20):
            await stream.__anext__()
        stats = endless.stats()
        await stream.aclose()
        assert stats.running == 1 and stats.kv_capacity_tokens > endless.model.max_context
        assert 0.0 < stats.kv_used < 1.0, stats


def test_plan_matches_the_gpu(gpu_model_dir):
    plan = check_engine_config(gpu_settings(gpu_model_dir), read_model_facts(gpu_model_dir), gpu_memory_bytes())
    assert plan.gpu_memory_bytes and plan.kv_capacity_tokens > plan.max_model_len
