"""A session outlives the workers that served it: the whole local mesh as subprocesses. Over
five turns, the worker of each turn is killed (SIGKILL) once its KV is saved and comes back
empty; the next turn, served through the router by a worker that never saw the session,
restores the session's prefix from the cache service and streams exactly the tokens a full
recompute gives."""

from __future__ import annotations

import asyncio
import time

import pytest

from ballast.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.cli.client import chat_request, collect, open_channel
from services.cli.etcd_view import list_workers
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.common.processes import free_port
from services.config import load_config
from services.router.tokenization import ModelTokenizer
from tests.integration.test_mesh import metric_value, scrape

# Five worker restarts on a busy machine take a while.
pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(300)]

TURN1 = (
    "The customer paid for the winter coat with Apple Pay. Support answered the question about "
    "the running shoes. We shipped the coffee maker to the new address. "
) * 3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    cache_port = free_port()
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("kv-mesh"),
        model_dir=tiny_model_dir,
        workers=2,
        lease_ttl_s=3,
        worker_capacity=4,
        cache_port=cache_port,
        overrides={"worker": {"cache_address": f"127.0.0.1:{cache_port}", "kv_block_tokens": 16}},
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


async def wait_metric(port: int, name: str, at_least: float, timeout: float = 20.0, **labels) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if metric_value(await scrape(port), name, **labels) >= at_least:
                return True
        except OSError:
            pass
        await asyncio.sleep(0.2)
    return False


async def recompute(address: str, text: str, max_tokens: int) -> list[int]:
    """Greedy tokens straight from a worker without a session: nothing restored."""
    async with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        tokenizer = ModelTokenizer.from_model_info(await stub.GetModelInfo(worker_pb2.ModelInfoRequest()))
        request = worker_pb2.WorkerGenerateRequest(
            prompt_ids=tokenizer.tokenizer.encode(text).ids,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0),
        )
        ids: list[int] = []
        async for event in stub.Generate(request, timeout=60):
            ids.extend(event.tokens.token_ids)
        return ids


USER_TURNS = [
    " Then the customer asked about the refund for the coat.",
    " Next they wanted the running shoes in a larger size.",
    " They asked whether the coffee maker has a warranty.",
    " Finally they asked when the refund would arrive.",
]


async def worker_counters(mesh) -> dict[str, tuple[float, float, float, float]]:
    """Per worker name: (requests served, prompt tokens prefilled, prefix tokens restored from
    cache, sessions saved)."""
    counters = {}
    for worker in mesh.workers():
        text = await scrape(worker.metrics_port)
        counters[worker.name] = (
            metric_value(text, "ballast_worker_requests_total"),
            metric_value(text, "ballast_worker_prefill_tokens_total"),
            metric_value(text, "ballast_worker_kv_prefix_tokens_total", source="cache"),
            metric_value(text, "ballast_worker_kv_saves_total", outcome="saved"),
        )
    return counters


async def wait_lease_gone(mesh, name: str, timeout: float = 15.0) -> None:
    etcd = load_config(mesh.config_path, environ={}).etcd
    deadline = time.monotonic() + timeout
    while name in {record.id for record, _ in await list_workers(etcd)}:
        assert time.monotonic() < deadline, f"the killed worker {name} kept its lease"
        await asyncio.sleep(0.2)


async def test_five_turns_with_a_kill_between_each_restore_and_match_an_uninterrupted_session(mesh, router):
    """Every turn runs on a worker that never saw the previous one: the one that served it was
    killed (SIGKILL) after saving and came back empty. Each later turn restores the session
    from the cache (prefilling less than its prompt) and gives the tokens a recompute gives."""
    text = TURN1.replace("winter coat", "wool scarf")
    for turn, user in enumerate([""] + USER_TURNS, start=1):
        text += user
        before = await worker_counters(mesh)
        answer = await collect(
            router,
            chat_request(text, max_tokens=16, raw_prompt=True, session_id="kv-five", allow_degraded=False),
            LOCAL_API_KEY,
        )
        assert answer.finished is not None and answer.finished.degradation == common_pb2.DEGRADATION_NONE
        # A worker counts a request once its stream has ended, which may be just after the
        # client saw the last event: wait for the count rather than race it.
        deadline = time.monotonic() + 15
        while True:
            after = await worker_counters(mesh)
            served = [name for name in after if after[name][0] > before[name][0]]
            if served or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert len(served) == 1, f"turn {turn}: served by {served}"
        server = next(w for w in mesh.workers() if w.name == served[0])
        reference = await recompute(server.address, text, 16)
        assert answer.token_ids == reference, f"turn {turn} differs from an uninterrupted session"
        if turn > 1:
            prompt_tokens = answer.finished.usage.prompt_tokens
            prefilled = after[server.name][1] - before[server.name][1]
            restored = after[server.name][2] - before[server.name][2]
            assert restored >= 16 and prefilled < prompt_tokens, (
                f"turn {turn}: prefilled {prefilled} of {prompt_tokens} tokens, restored {restored}"
            )
        text += answer.text
        if turn == len(USER_TURNS) + 1:
            break
        # Killed only once this turn's KV is written, as a worker lost between turns would be.
        assert await wait_metric(
            server.metrics_port, "ballast_worker_kv_saves_total", before[server.name][3] + 1, outcome="saved"
        )
        server.process.kill()
        await wait_lease_gone(mesh, server.name)
        await asyncio.to_thread(mesh.restart_service, server)
