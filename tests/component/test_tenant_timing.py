"""A tenant cannot tell from time to first token whether another tenant has a prefix cached.

A real worker (torch engine, in-memory session reuse on, the cache service on Redis) serves
tenant A a first turn, then the same next-turn context three ways, in random order per trial:
A itself (its prefix is reused: the positive control, which must be measurably faster, so
the check has the power to see a difference), tenant B with A's very session id and context
(a cross-tenant hit would make it as fast as A), and tenant B with a fresh context of the
same length (cold). B's two timings must not differ beyond noise: a two-sided permutation
test on the difference of medians, at a level strict enough that noise alone fails it about
once in a thousand runs.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import uuid

import grpc
import pytest
import pytest_asyncio

from ballast.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.worker.app import create_server as create_worker
from tests.component.test_kv_worker import cache, etcd_prefix, worker_config  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

TRIALS = 30
CONTEXT_TOKENS = 700
ALPHA = 0.001


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def worker(etcd_server, tiny_model_dir, etcd_prefix, cache):  # noqa: F811
    app = await create_worker(
        worker_config(etcd_server, tiny_model_dir, etcd_prefix, cache.address, BALLAST__WORKER__KV_MEMORY_SESSIONS="16")
    )
    yield app
    await app.shutdown(grace_s=1.0)


async def ttft_ms(stub, prompt_ids: list[int], session: str, tenant: str, max_tokens: int = 2) -> float:
    request = worker_pb2.WorkerGenerateRequest(
        request_id=uuid.uuid4().hex,
        tenant=tenant,
        session_id=session,
        prompt_ids=prompt_ids,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    started = time.perf_counter()
    first = None
    async for event in stub.Generate(request, timeout=60):
        if first is None and event.HasField("tokens"):
            first = time.perf_counter()
    assert first is not None
    return (first - started) * 1000


def permutation_p(a: list[float], b: list[float], rng: random.Random, rounds: int = 4000) -> float:
    """Two-sided p-value of the difference of medians under exchangeability."""
    observed = abs(statistics.median(a) - statistics.median(b))
    pooled = a + b
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        if abs(statistics.median(pooled[: len(a)]) - statistics.median(pooled[len(a) :])) >= observed:
            hits += 1
    return (hits + 1) / (rounds + 1)


async def test_tenant_b_cannot_time_tenant_a_s_cached_prefix(worker, tiny_model_dir):
    rng = random.Random(20261201)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    samples: dict[str, list[float]] = {"a_reused": [], "b_on_a": [], "b_cold": []}
    async with grpc.aio.insecure_channel(worker.address, options=CHANNEL_OPTIONS) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        await ttft_ms(stub, [rng.randrange(4, vocab) for _ in range(64)], "", "warm-up")
        for trial in range(TRIALS):
            session = f"s-{trial}"
            first_turn = [rng.randrange(4, vocab) for _ in range(CONTEXT_TOKENS)]
            await ttft_ms(stub, first_turn, session, "tenant-a", max_tokens=4)
            context = first_turn + [rng.randrange(4, vocab) for _ in range(16)]
            fresh = [rng.randrange(4, vocab) for _ in range(len(context))]
            runs = [
                ("a_reused", context, session, "tenant-a"),
                ("b_on_a", context, session, "tenant-b"),
                ("b_cold", fresh, f"b-{trial}", "tenant-b"),
            ]
            rng.shuffle(runs)
            for name, ids, sess, tenant in runs:
                samples[name].append(await ttft_ms(stub, ids, sess, tenant))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    # The control: reuse within a tenant is visible, so the test can see a difference.
    assert medians["a_reused"] < medians["b_cold"], medians
    assert permutation_p(samples["a_reused"], samples["b_cold"], random.Random(1)) < ALPHA, medians
    # Across tenants: nothing to see.
    p = permutation_p(samples["b_on_a"], samples["b_cold"], random.Random(2))
    print(f"TTFT medians (ms): {medians}; p(B on A's prefix vs B cold) = {p:.3f}")
    assert p >= ALPHA, (p, medians)
