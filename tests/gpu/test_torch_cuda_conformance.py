"""The engine conformance suite on the torch engine on a CUDA GPU (sampling stays on the
CPU, so seeded resumes are exact there too), and the GPU memory probe. Skips without a GPU."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import cuda_skip_reason

if cuda_skip_reason():
    pytest.skip(f"torch on CUDA: {cuda_skip_reason()}", allow_module_level=True)

from services.worker.vllm import VllmSettings, check_engine_config, read_model_facts  # noqa: E402
from services.worker.vllm.checks import gpu_memory_bytes  # noqa: E402
from tests.engine_conformance import EngineConformance, factory_fixture, torch_factory  # noqa: E402
from tests.engine_conformance import conf_engine, endless  # noqa: E402,F401  (fixtures)
from tests.model_fixtures import tiny_model_dir  # noqa: E402,F401

engine_factory = factory_fixture(torch_factory(device="cuda", name="torch-cuda"))


@pytest.fixture(scope="module")
def conformance_model_dir(tiny_model_dir):  # noqa: F811
    return tiny_model_dir


class TestTorchCudaConformance(EngineConformance):
    pass


def test_gpu_memory_probe_and_plan(tiny_model_dir):  # noqa: F811
    import torch

    total = gpu_memory_bytes()
    # NVML and the CUDA runtime may disagree by what the driver reserves.
    assert abs(total - torch.cuda.get_device_properties(0).total_memory) < (2 << 30)
    plan = check_engine_config(VllmSettings(kv_cache_dtype="float32"), read_model_facts(tiny_model_dir), total)
    # The tiny model: 2 x 2 layers x 4 heads x 16 x 4 bytes = 1 KiB of KV per token.
    assert plan.kv_bytes_per_token == 1024 and plan.kv_capacity_tokens > 1_000_000
