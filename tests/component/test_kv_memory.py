"""The torch engine's in-memory session reuse: a session's next turn continues from the KV
its last turn left, with the same tokens a full recompute gives, within a bounded LRU."""

from __future__ import annotations

import pytest_asyncio

from services.worker.engine import EngineRequest, Sampling
from services.worker.torch.engine import TorchEngine
from tests.model_fixtures import tiny_model_dir  # noqa: F401

TEXT = "The customer paid for the winter coat with Apple Pay. Support answered the question. "


async def run(
    engine: TorchEngine, ids: list[int], session: str = "", tenant: str = "acme", max_tokens: int = 20
) -> tuple[list[int], int | None]:
    tokens: list[int] = []
    prefill = None
    request = EngineRequest("r", tuple(ids), (), Sampling(max_tokens=max_tokens, temperature=0.0), tenant, session)
    async for delta in engine.generate(request):
        tokens += delta.token_ids
        if prefill is None:
            prefill = delta.prefill_tokens
    return tokens, prefill


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines(tiny_model_dir):
    remembering = TorchEngine(tiny_model_dir, "tiny", max_concurrency=2, eos_token_ids=(), memory_sessions=2)
    plain = TorchEngine(tiny_model_dir, "tiny", max_concurrency=2, eos_token_ids=())
    for e in (remembering, plain):
        await e.start()
    yield remembering, plain
    for e in (remembering, plain):
        await e.stop()


async def test_next_turn_continues_from_memory_with_identical_tokens(engines):
    engine, plain = engines
    p1 = engine.tokenize(TEXT)
    a1, prefill1 = await run(engine, p1, session="m1")
    assert prefill1 == len(p1)
    p2 = p1 + a1 + engine.tokenize(" Then the coat shipped.")
    a2, prefill2 = await run(engine, p2, session="m1")
    # Everything the last turn fed (prompt and all but its last answer token) is reused.
    assert prefill2 == len(p2) - (len(p1) + len(a1) - 1)
    assert a2 == (await run(plain, p2))[0]
    assert engine.stats().kv_tokens == 0 and engine.stats().extra["session_memory_tokens"] > 0


async def test_an_edited_history_reuses_only_the_common_prefix(engines):
    engine, plain = engines
    p1 = engine.tokenize(TEXT * 2)
    a1, _ = await run(engine, p1, session="m2")
    edited = p1[:10] + engine.tokenize(" Something else entirely. ") + p1[10:]
    a2, prefill = await run(engine, edited, session="m2")
    assert len(edited) - prefill == 10
    assert a2 == (await run(plain, edited))[0]


async def test_other_tenants_and_evicted_sessions_recompute(engines):
    engine, _plain = engines
    p1 = engine.tokenize(TEXT)
    await run(engine, p1, session="m3")
    assert (await run(engine, p1 + [5], session="m3", tenant="globex"))[1] == len(p1) + 1
    for other in ("m4", "m5"):  # capacity 2: m3 falls out
        await run(engine, p1, session=other)
    assert (await run(engine, p1 + [5], session="m3"))[1] == len(p1) + 1
