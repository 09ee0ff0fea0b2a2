"""SmolLM2-135M-Instruct, a trained model, on the vLLM engine (vLLM's CPU build here): the
shared SmolLM2 cases (tests/smollm2_cases.py). One vLLM engine for the module: a start
costs 30-80 s here."""

from __future__ import annotations

import gc

import pytest
import pytest_asyncio

from tests.vllm.conftest import cpu_settings, require_vllm

require_vllm()

from services.worker.vllm import VllmEngine  # noqa: E402
from tests.model_fixtures import smollm2_model_dir  # noqa: E402,F401  (fixture)
from tests.smollm2_cases import SmolLM2Cases, chat_ids  # noqa: E402,F401  (fixture)

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(smollm2_model_dir):
    engine = VllmEngine(smollm2_model_dir, "smollm2", cpu_settings(max_concurrency=4, max_model_len=2048))
    await engine.start()
    yield engine
    await engine.stop()
    # Collect vLLM's client now, while its modules are alive: its __del__ at interpreter exit
    # fails noisily on a half torn-down vLLM.
    gc.collect()


class TestSmolLM2OnVllm(SmolLM2Cases):
    pass
