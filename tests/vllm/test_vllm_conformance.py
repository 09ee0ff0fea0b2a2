"""The engine conformance suite on real vLLM, and what only the vLLM engine has to prove.

The same `EngineConformance` the torch engine passes, on VllmEngine over vLLM's AsyncLLM
(vLLM's CPU build here, with the tiny model folder), including exact seeded resumes. Beside
it: greedy tokens identical to vLLM's own generate for the same request, a resumed guided stream
handed from vLLM's structured outputs to Ballast's processor, the prefix cache salted per tenant,
and vLLM's scheduler stats in the engine's stats and its step count.

Both engines of the suite (EOS on and EOS off) share one AsyncLLM: EOS is a per-request
setting on vLLM, and one engine start is 30-80 s here.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
import pytest_asyncio

from tests.vllm.conftest import cpu_settings, require_vllm

require_vllm()

from services.worker.engine import EngineRequest, Sampling  # noqa: E402
from services.worker.vllm import VllmEngine  # noqa: E402
from services.worker.vllm.client import open_vllm_client  # noqa: E402
from tests.engine_conformance import (  # noqa: E402
    GUIDED_BUDGET,
    GUIDED_PROMPT,
    ORDER_SCHEMA,
    PROSE,
    EngineConformance,
    EngineFactory,
    factory_fixture,
    run,
)
from tests.engine_conformance import conf_engine, endless  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.timeout(300)


def guided_request(engine, generated=()) -> EngineRequest:
    prompt = tuple(engine.tokenize(GUIDED_PROMPT))
    return EngineRequest(
        "guided",
        prompt,
        tuple(generated),
        Sampling(max_tokens=GUIDED_BUDGET - len(generated), temperature=0.0),
        response_format=ORDER_SCHEMA,
    )


class _Unowned:
    """A vLLM client an engine uses but does not own: its shutdown is the module's."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def shutdown(self) -> None:
        pass


class SharedVllm:
    """Opens vLLM once for every engine of the module."""

    def __init__(self) -> None:
        self.client: Any = None

    def factory(self, api, model_dir, name, settings, plan):
        if self.client is None:
            self.client = open_vllm_client(api, model_dir, name, settings, plan)
        return _Unowned(self.client)

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown()
            self.client = None
            # Collect the engine now, while vLLM's modules are alive: its __del__ at
            # interpreter exit fails noisily on a half torn-down vLLM.
            gc.collect()


SHARED = SharedVllm()


def vllm_factory() -> EngineFactory:
    def make(model_dir, eos_token_ids=None, max_concurrency=8):
        return VllmEngine(
            model_dir,
            "conformance",
            cpu_settings(max_concurrency=max_concurrency),
            eos_token_ids=eos_token_ids,
            client_factory=SHARED.factory,
        )

    # Stats arrive with vLLM's engine steps: an aborted request leaves the snapshot a step late.
    return EngineFactory("vllm", make, exact_seeded_resume=True, idle_timeout_s=10.0)


engine_factory = factory_fixture(vllm_factory())


@pytest.fixture(scope="module")
def conformance_model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest_asyncio.fixture(scope="module", loop_scope="session", autouse=True)
async def shared_vllm():
    yield SHARED
    SHARED.close()


class TestVllmEngineConformance(EngineConformance):
    async def test_seeded_resume_is_exact_at_every_point(self, endless):
        n = 24
        options = {"temperature": 1.2, "top_p": 0.9, "seed": 20261201}
        full = await run(endless, PROSE, max_tokens=n, **options)
        for k in (1, 5, 13, n - 1):
            resumed = await run(endless, PROSE, generated=full.tokens[:k], max_tokens=n - k, **options)
            assert resumed.tokens == full.tokens[k:], k

    async def test_greedy_tokens_equal_vllms_own_generate(self, endless, shared_vllm):
        """The same request straight to vLLM (no Ballast processors in play: greedy, no
        extra arguments) gives the tokens the engine streamed."""
        api = endless.api
        prompt = endless.tokenize(PROSE)
        ours = await run(endless, prompt, max_tokens=32)
        params = api.sampling_params(temperature=0.0, max_tokens=32, ignore_eos=True, output_kind=api.delta_output_kind)
        theirs: list[int] = []
        async for out in shared_vllm.client.generate(api.tokens_prompt(prompt), params, "own-generate"):
            theirs += list(out.outputs[0].token_ids)
        assert ours.tokens == theirs

    async def test_a_resumed_guided_stream_is_guided_by_ballasts_processor(self, conf_engine):
        """vLLM's structured outputs guide a fresh stream; a resumed one (the suite's guided
        resume case) goes to Ballast's processor, with the same grammar."""
        full = [t async for d in conf_engine.generate(guided_request(conf_engine)) for t in d.token_ids]
        before = conf_engine.stats().extra["guided_resumes_total"]
        k = len(full) // 2
        rest = [t async for d in conf_engine.generate(guided_request(conf_engine, full[:k])) for t in d.token_ids]
        assert full[:k] + rest == full
        assert conf_engine.stats().extra["guided_resumes_total"] == before + 1

    async def test_prefix_cache_is_salted_by_tenant(self, endless):
        # vLLM's CPU blocks hold 128 tokens: a prompt of several blocks has whole blocks to share.
        prompt = tuple((endless.tokenize(PROSE + " ") * 12)[:400])

        async def prefill(tenant: str, rid: str) -> int:
            request = EngineRequest(rid, prompt, (), Sampling(max_tokens=1), tenant=tenant)
            deltas = [d async for d in endless.generate(request)]
            return deltas[0].prefill_tokens

        first = await prefill("tenant-a", "salt-1")
        again = await prefill("tenant-a", "salt-2")
        other = await prefill("tenant-b", "salt-3")
        assert first == len(prompt)
        assert again < len(prompt), "the same tenant's prefix was not reused"
        assert other == len(prompt), "another tenant reused this tenant's cached prefix"

    async def test_a_waiting_s_request_starts_before_a_b_request_queued_earlier(self, endless):
        """With every sequence busy, vLLM admits what waits by priority (tier S 0, B 2),
        not in arrival order: a worker holding more than it runs still starts S first."""
        prompt = tuple(endless.tokenize("The customer paid"))
        longest = endless.model.max_context - len(prompt) - 1

        def tier(rid: str, priority: int, max_tokens: int) -> EngineRequest:
            return EngineRequest(rid, prompt, (), Sampling(max_tokens=max_tokens), priority=priority)

        running = [endless.generate(tier(f"busy-{i}", 2, longest)) for i in range(cpu_settings().max_concurrency)]
        late_b = endless.generate(tier("late-b", 2, 4))
        s = endless.generate(tier("s", 0, 4))
        try:
            for stream in running:
                await stream.__anext__()  # each holds one of the engine's sequences
            b_first = asyncio.ensure_future(late_b.__anext__())
            await asyncio.sleep(0.3)
            s_first = asyncio.ensure_future(s.__anext__())
            await asyncio.sleep(0.3)
            assert not b_first.done() and not s_first.done(), "a sequence was free"
            await running[0].aclose()  # frees one sequence
            await asyncio.wait_for(s_first, 60)
            assert not b_first.done(), "the B request queued first took the freed sequence"
            await asyncio.wait_for(b_first, 60)  # and it runs once the next one frees
        finally:
            for stream in (*running, late_b, s):
                await stream.aclose()

    async def test_counts_vllm_steps_as_its_worker_reports_them(self, endless):
        """The steps a worker reports while a router's requests wait: vLLM hands each step's
        stats to the engine's logger, so the count moves by a step per decoded token at least."""
        before = endless.steps
        request = EngineRequest("steps", tuple(endless.tokenize("The customer paid")), (), Sampling(max_tokens=300))
        stream = endless.generate(request)
        received = 0
        while received < 20:
            received += len((await stream.__anext__()).token_ids)
        await stream.aclose()
        # The stats of the last step or two may still be on their way to the logger.
        assert endless.steps >= before + received - 2, (before, endless.steps, received)

    async def test_reports_vllm_kv_use_and_fragmentation(self, endless):
        prompt = tuple(endless.tokenize("The customer paid"))
        request = EngineRequest("kv", prompt, (), Sampling(max_tokens=300))
        stream = endless.generate(request)
        received = 0
        while received < 20:  # a delta may carry several tokens when the engine runs ahead
            received += len((await stream.__anext__()).token_ids)
        stats = endless.stats()
        await stream.aclose()
        assert stats.running == 1 and stats.kv_capacity_tokens > endless.model.max_context
        assert 0.0 < stats.kv_used < 1.0, stats
        assert 0.0 < stats.extra["kv_fragmentation"] < 1.0, stats.extra
        # The tokens the worker has seen, in vLLM's 128-token blocks: while they fill under
        # half a block, most of what the request holds is empty (the engine may be ahead of
        # the reader: that only adds held, unfilled room).
        if len(prompt) + received < 64:
            assert stats.extra["kv_fragmentation"] > 0.5, (received, stats.extra)


def test_the_plan_is_a_cpu_plan(tiny_model_dir):
    from services.worker.vllm import check_cpu_engine_config, read_model_facts

    plan = check_cpu_engine_config(cpu_settings(), read_model_facts(tiny_model_dir))
    assert plan.platform == "cpu" and plan.kv_capacity_tokens > plan.max_model_len
