"""The sim engine's query of death: a request whose prompt holds `crash_on_marker` ends the
engine the way the worker says (`on_crash`) before any token; other requests are served."""

from __future__ import annotations

import pytest

from services.common.errors import Unavailable
from services.common.generation import Sampling
from services.worker.engine import EngineRequest
from services.worker.sim import SimEngine, SimFaults
from tests.component.test_sim_engine import FAST

pytestmark = pytest.mark.asyncio(loop_scope="session")

MARKER = "QUERY-OF-DEATH-7"


def _request(engine: SimEngine, text: str) -> EngineRequest:
    return EngineRequest(
        request_id=text[:8],
        prompt_ids=tuple(engine.tokenize(text)),
        generated_ids=(),
        sampling=Sampling(max_tokens=6, temperature=0.0),
    )


async def test_a_prompt_with_the_marker_kills_the_engine_before_any_token(tiny_model_dir):
    engine = SimEngine(tiny_model_dir, "marker", FAST, faults=SimFaults(crash_on_marker=MARKER))
    crashes: list[str] = []
    engine.on_crash = lambda: crashes.append("crash")
    await engine.start()
    served = [t async for d in engine.generate(_request(engine, "an ordinary question")) for t in d.token_ids]
    assert len(served) == 6 and crashes == []
    got: list[int] = []
    with pytest.raises(Unavailable):
        async for delta in engine.generate(_request(engine, f"please summarise {MARKER} now")):
            got += delta.token_ids
    assert got == [] and crashes == ["crash"]
    assert engine.stats().running == 0
