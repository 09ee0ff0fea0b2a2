"""The simulated engine passes the engine conformance suite (streams, determinism, exact
greedy and seeded resume, stop strings, abort, bad input), over the tiny model's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest

from services.worker.sim import SimEngine, SimProfile
from tests.engine_conformance import EngineConformance, EngineFactory, factory_fixture
from tests.engine_conformance import conf_engine, endless  # noqa: F401  (fixtures)

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Fast, so the suite's long streams take a fraction of a second.
FAST = SimProfile(source="tests", prefill_base_ms=1.0, prefill_ms_per_token=0.001, decode_base_ms=0.5,
                  decode_ms_per_seq=0.05, decode_ms_per_kv_token=0.0, max_num_seqs=4, jitter=0.1, seed=3)


def _make(model_dir: Path, eos_token_ids: Sequence[int] | None = None, max_concurrency: int = 4) -> SimEngine:
    return SimEngine(model_dir, "conformance", FAST, max_concurrency=max_concurrency, eos_token_ids=eos_token_ids)


engine_factory = factory_fixture(EngineFactory("sim", _make))


@pytest.fixture(scope="module")
def conformance_model_dir(tiny_model_dir):
    return tiny_model_dir


class TestSimConformance(EngineConformance):
    pass
