"""The simulated engine passes the engine conformance suite (streams, determinism, exact
greedy and seeded resume, stop strings, abort, bad input, guided decoding), over the tiny
model's tokenizer, and what only the sim has: fault knobs and its guided draws."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest

from services.worker.sim import SimEngine, SimProfile
from tests.engine_conformance import EngineConformance, EngineFactory, factory_fixture
from tests.engine_conformance import conf_engine, endless  # noqa: F401  (fixtures)

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Fast, so the suite's long streams take a fraction of a second.
FAST = SimProfile(
    source="tests",
    prefill_base_ms=1.0,
    prefill_ms_per_token=0.001,
    decode_base_ms=0.5,
    decode_ms_per_seq=0.05,
    decode_ms_per_kv_token=0.0,
    max_num_seqs=4,
    jitter=0.1,
    seed=3,
)


def _make(model_dir: Path, eos_token_ids: Sequence[int] | None = None, max_concurrency: int = 4) -> SimEngine:
    return SimEngine(model_dir, "conformance", FAST, max_concurrency=max_concurrency, eos_token_ids=eos_token_ids)


engine_factory = factory_fixture(EngineFactory("sim", _make))


@pytest.fixture(scope="module")
def conformance_model_dir(tiny_model_dir):
    return tiny_model_dir


class TestSimConformance(EngineConformance):
    pass


def _request(max_tokens: int = 30):
    from services.common.generation import Sampling
    from services.worker.engine import EngineRequest

    return EngineRequest(
        request_id="faults",
        prompt_ids=(5, 6, 7),
        generated_ids=(),
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
    )


async def test_fail_after_k_tokens_fails_the_stream_there(tiny_model_dir):
    from services.common.errors import Unavailable
    from services.worker.sim import SimFaults

    engine = SimEngine(tiny_model_dir, "faults", FAST, faults=SimFaults(fail_after_tokens=7))
    await engine.start()
    got = []
    with pytest.raises(Unavailable):
        async for delta in engine.generate(_request()):
            got += delta.token_ids
    assert len(got) == 7
    engine.set_faults(SimFaults())
    whole = [t async for d in engine.generate(_request()) for t in d.token_ids]
    assert len(whole) == 30 and whole[:7] == got  # cleared: the same stream, whole
    assert engine.stats().running == 0  # the failed stream gave its slot back


async def test_kv_in_use_counts_every_running_context_and_is_given_back(tiny_model_dir):
    from services.common.errors import Unavailable
    from services.worker.sim import SimFaults

    engine = SimEngine(tiny_model_dir, "kv", FAST)
    await engine.start()
    first, second = engine.generate(_request(max_tokens=10)), engine.generate(_request(max_tokens=10))
    await anext(first)
    await anext(second)
    # Three prompt ids and one generated token each.
    assert engine.stats().kv_tokens == 8
    await anext(first)
    assert engine.stats().kv_tokens == 9
    await first.aclose()
    assert engine.stats().kv_tokens == 4
    await second.aclose()
    engine.set_faults(SimFaults(fail_after_tokens=3))
    with pytest.raises(Unavailable):
        async for _ in engine.generate(_request()):
            pass
    assert engine.stats().kv_tokens == 0 and engine.stats().running == 0


async def test_a_hung_engine_produces_nothing_until_cleared(tiny_model_dir):
    import asyncio

    from services.worker.sim import SimFaults

    engine = SimEngine(tiny_model_dir, "faults", FAST, faults=SimFaults(hang=True))
    await engine.start()
    got = []

    async def consume():
        async for delta in engine.generate(_request(10)):
            got.extend(delta.token_ids)

    task = asyncio.create_task(consume())
    for _ in range(20):  # many hang polls' worth of the loop: nothing may come out
        await asyncio.sleep(0.02)
    assert got == [] and not task.done()
    engine.set_faults(SimFaults())
    await asyncio.wait_for(task, 10)
    assert len(got) == 10


async def test_steps_count_prefill_chunks_and_decode_steps_and_stand_still_while_hung(tiny_model_dir):
    """The count a worker reports as its engine's progress: a prompt of three chunks is three
    steps, each token after the first one more; a hung engine's count does not move."""
    import asyncio
    from dataclasses import replace

    from services.worker.sim import SimFaults

    engine = SimEngine(tiny_model_dir, "steps", replace(FAST, prefill_chunk_tokens=2))
    await engine.start()
    assert engine.steps == 0
    [d async for d in engine.generate(_request(5))]  # 3 prompt tokens: chunks of 2 and 1
    assert engine.steps == 2 + 4
    engine.set_faults(SimFaults(hang=True))
    stream = engine.generate(_request(5))
    first = asyncio.create_task(anext(stream))
    for _ in range(20):  # many hang polls' worth of the loop
        await asyncio.sleep(0.02)
    assert engine.steps == 6 and not first.done()
    engine.set_faults(SimFaults())
    await asyncio.wait_for(first, 10)
    await stream.aclose()
    assert engine.steps > 6


async def test_a_resumed_stream_waiting_for_a_slot_goes_before_a_fresh_one_of_its_tier(tiny_model_dir):
    """Admission by `scheduling_priority`, as vLLM and the torch engine admit: a stream that
    broke elsewhere (it carries generated ids) waits one tier ahead of its own."""
    import asyncio
    from dataclasses import replace

    engine = SimEngine(tiny_model_dir, "admission", FAST, max_concurrency=1)
    await engine.start()
    running = engine.generate(_request(1000))
    await anext(running)  # holds the one slot
    fresh = engine.generate(_request(5))
    resumed = engine.generate(replace(_request(5), request_id="resumed", generated_ids=(9, 10)))
    order: list[str] = []

    async def first(name: str, stream) -> None:
        await anext(stream)
        order.append(name)
        await stream.aclose()  # the slot goes on to the next in line

    waiters = [asyncio.create_task(first("fresh", fresh))]
    for _ in range(5):  # the fresh one queues first
        await asyncio.sleep(0)
    waiters.append(asyncio.create_task(first("resumed", resumed)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert engine.stats().waiting == 2 and order == []
    await running.aclose()
    await asyncio.wait_for(asyncio.gather(*waiters), 10)
    assert order == ["resumed", "fresh"]


async def test_slowdown_scales_every_wait(tiny_model_dir, monkeypatch):
    import asyncio

    from services.worker.sim import SimFaults
    from services.worker.sim import engine as engine_module

    steady = SimProfile(
        source="tests",
        prefill_base_ms=4.0,
        prefill_ms_per_token=0.0,
        decode_base_ms=2.0,
        decode_ms_per_seq=0.0,
        decode_ms_per_kv_token=0.0,
        max_num_seqs=4,
        jitter=0.0,
    )
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(seconds, *args):
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(engine_module.asyncio, "sleep", recording_sleep)
    engine = SimEngine(tiny_model_dir, "faults", steady, faults=SimFaults(slowdown=3.0))
    await engine.start()
    waits.clear()
    [d async for d in engine.generate(_request(5))]
    assert waits == pytest.approx([0.012] + [0.006] * 4)


ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order": {"type": "integer"},
        "status": {"type": "string", "enum": ["shipped", "late"]},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["order", "status", "note"],
    "additionalProperties": False,
}


async def _guided(engine: SimEngine, seed: int, generated: tuple[int, ...] = (), max_tokens: int = 48):
    import json

    from services.common.generation import Sampling
    from services.worker.engine import EngineRequest

    request = EngineRequest(
        request_id=f"guided-{seed}",
        prompt_ids=(5, 6, 7),
        generated_ids=generated,
        sampling=Sampling(max_tokens=max_tokens, temperature=1.0, seed=seed),
        response_format=json.dumps(ORDER_SCHEMA),
    )
    tokens, text, finish = [], "", None
    async for delta in engine.generate(request):
        tokens += delta.token_ids
        text += delta.text
        finish = delta.finish_reason
    return tokens, text, finish


async def test_a_json_schema_answer_follows_the_schema_and_a_resume_continues_it_exactly(tiny_model_dir):
    import json

    import jsonschema

    from services.worker.engine import FinishReason

    engine = _make(tiny_model_dir)
    await engine.start()
    complete = 0
    for seed in range(12):
        tokens, text, finish = await _guided(engine, seed)
        if finish == FinishReason.STOP:
            # Ended by the engine: the document is complete and conforms.
            jsonschema.validate(json.loads(text), ORDER_SCHEMA)
            complete += 1
        for k in (1, len(tokens) // 2):
            rest, _, rest_finish = await _guided(engine, seed, tuple(tokens[:k]), 48 - k)
            assert tokens[:k] + rest == tokens, (seed, k)
            assert rest_finish == finish
    # Closing ids are tried often enough that most documents end within 48 tokens.
    assert complete >= 9, complete


async def test_a_schema_that_cannot_be_guided_is_refused_before_anything_starts(tiny_model_dir):
    from services.common.errors import InvalidArgument
    from services.common.generation import Sampling
    from services.worker.engine import EngineRequest

    engine = _make(tiny_model_dir)
    await engine.start()
    request = EngineRequest(
        request_id="bad-schema",
        prompt_ids=(5, 6, 7),
        generated_ids=(),
        sampling=Sampling(max_tokens=8),
        response_format='{"type": "no-such-type"}',
    )
    with pytest.raises(InvalidArgument):
        engine.generate(request)
    assert engine.stats().running == 0


async def test_a_complete_document_that_could_go_on_ends_at_a_drawn_eos(tiny_model_dir):
    """A top-level number is complete after its first digit and may go on: the sim draws the
    EOS on a closing step, and ends there as every engine does (the EOS is never sent)."""
    from services.common.generation import Sampling
    from services.worker.engine import EngineRequest, FinishReason

    engine = _make(tiny_model_dir)
    await engine.start()
    finishes, at_eos = set(), 0
    for seed in range(8):
        request = EngineRequest(
            request_id=f"number-{seed}",
            prompt_ids=(5, 6, 7),
            generated_ids=(),
            sampling=Sampling(max_tokens=64, temperature=1.0, seed=seed),
            response_format='{"type": "integer"}',
        )
        deltas = [d async for d in engine.generate(request)]
        tokens = [t for d in deltas for t in d.token_ids]
        finishes.add(deltas[-1].finish_reason)
        assert not set(tokens) & set(engine.model.eos_token_ids)
        assert isinstance(int("".join(d.text for d in deltas)), int)
        # Ended by the EOS (a last delta without tokens), or by a number nothing may follow ("0").
        at_eos += deltas[-1].token_ids == []
    assert finishes == {FinishReason.STOP} and at_eos >= 4, at_eos
