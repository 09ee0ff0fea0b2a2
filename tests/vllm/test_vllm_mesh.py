"""The mesh on vLLM: a router, two vLLM worker processes (vLLM's CPU build), the cache
service on Redis, the backfill service on the Kafka broker, real etcd; every request through
the public API.

A worker serving streams is killed with SIGKILL (its whole process group: the worker and
vLLM's engine process) while greedy and seeded sampled streams are in flight: every stream
must equal its uninterrupted reference token for token, and none may be a degraded answer.
A JSON-Schema request is answered VALID through vLLM's guided decoding, and a request whose
deadline passes mid-stream leaves nothing running on the workers. A vLLM warm standby is
loaded and unroutable until promoted, then serves. A session whose worker is killed between
turns continues on the other vLLM worker from the prefix the first one saved in the cache.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import pytest

from tests.vllm.conftest import require_vllm

require_vllm()

from ballast.v1 import common_pb2  # noqa: E402
from services.cache.client import KVCacheClient  # noqa: E402
from services.cli.client import chat_request, collect  # noqa: E402
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec  # noqa: E402
from services.cli.etcd_view import list_workers  # noqa: E402
from services.common.membership import make_client  # noqa: E402
from services.common.worker_roles import SERVING, request_role  # noqa: E402
from tests.integration.test_mesh import (  # noqa: E402
    etcd_config,
    metric_value,
    registered_ids,
    router_routes_to,
    scrape,
)
from tests.served import assert_served  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

STREAM_TOKENS = 600
PROMPTS = [f"Customer {i} asks about order {2000 + i} and when it will be delivered." for i in range(4)]
SEEDED = {"temperature": 0.9, "seed": 4242}
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "order": {"type": "integer", "minimum": 0, "maximum": 9999},
            "status": {"type": "string", "enum": ["shipped", "late"]},
        },
        "required": ["order", "status"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, bench_model_dir):
    # The bench preset, not the tiny model: on the tiny one vLLM finishes a whole stream long
    # before the router has relayed it, so a kill would rarely hit generation in flight.
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("vllm-mesh"),
        model_dir=bench_model_dir,
        workers=2,
        engine="vllm",
        # Everything shares two cores here; a kill is seen on the connection, not by the lease.
        lease_ttl_s=10,
        worker_capacity=8,
        overrides={
            "router": {
                # vLLM on two shared cores steps slower than the torch engine: no false stalls.
                "stall": {"s_timeout_s": 5.0, "a_timeout_s": 5.0, "b_timeout_s": 5.0},
                "retry": {"ratio": 1.0, "min_retries_per_s": 20.0, "max_attempts": 4},
                # Two vLLM engines share two cores with everything else: after the kill, one
                # worker serves every stream, more slowly than tier A's default 2 s budget
                # assumes, and these clients do not accept degraded answers.
                "scheduling": {"slow_start_s": 0.5, "tiers": {"A": {"budget_s": 30.0}}},
            },
        },
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


def request(prompt: str, seeded: bool):
    options = SEEDED if seeded else {}
    return chat_request(prompt, max_tokens=STREAM_TOKENS, raw_prompt=True, allow_degraded=False, **options)


async def worker_loads(mesh) -> dict:
    """Streams in flight per worker now (their live /metrics, not the heartbeat, which lags by
    up to a second)."""
    return {w.name: metric_value(await scrape(w.metrics_port), "ballast_worker_in_flight") for w in mesh.workers()}


async def test_a_deadline_ends_the_stream_and_frees_the_vllm_request(mesh, router):
    message = chat_request(PROMPTS[0], max_tokens=STREAM_TOKENS, raw_prompt=True, allow_degraded=False)
    # The deadline is a quarter of the whole answer's time measured here: it ends the stream
    # midway on a fast machine and on a slow one alike.
    loop = asyncio.get_running_loop()
    started = loop.time()
    whole = await collect(router, message, LOCAL_API_KEY, timeout=120)
    answer_s = loop.time() - started
    assert whole.finished.usage.completion_tokens == STREAM_TOKENS
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(router, message, LOCAL_API_KEY, timeout=answer_s / 4)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The worker saw the cancellation and aborted its vLLM request: nothing stays in flight.
    deadline = loop.time() + 15
    while any((loads := await worker_loads(mesh)).values()):
        assert loop.time() < deadline, f"streams still in flight after the deadline: {loads}"
        await asyncio.sleep(0.1)


async def worker_metric(worker, name: str, **labels) -> float:
    return metric_value(await scrape(worker.metrics_port), name, **labels)


async def cache_blocks(mesh) -> int:
    cache = next(s for s in mesh.services if s.name == "cache")
    client = KVCacheClient(cache.address)
    try:
        return (await client.stats(5.0)).blocks
    finally:
        await client.close()


def conversation(turns: list[tuple[str, str]], session_id: str):
    message = chat_request("", max_tokens=24, session_id=session_id, allow_degraded=False)
    del message.conversation.messages[:]
    for role, content in turns:
        message.conversation.messages.add(role=role, content=content)
    return message


async def test_a_session_whose_vllm_worker_died_continues_on_the_other_from_the_stored_prefix(mesh, router):
    question = (
        "I ordered a blue kettle two weeks ago, order 5120, and the tracking page still says "
        "that the label was created but nothing has been shipped. What happened to it?"
    )
    served_before = {w.name: await worker_metric(w, "ballast_worker_requests_total") for w in mesh.workers()}
    stored_before = await cache_blocks(mesh)
    first = await collect(router, conversation([("user", question)], "vllm-session"), LOCAL_API_KEY, timeout=120)
    assert_served(first)
    served = {w.name: await worker_metric(w, "ballast_worker_requests_total") for w in mesh.workers()}
    victim = next((w for w in mesh.workers() if served[w.name] > served_before[w.name]), None)
    assert victim is not None, f"no worker counted the turn: {served_before} -> {served}"
    # The worker that served the turn saves the session's blocks through the KV connector, in
    # the background: wait until the cache holds them. (Its save counts reach /metrics with
    # vLLM's next engine step, so they are not the thing to wait on.)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while await cache_blocks(mesh) <= stored_before:
        assert loop.time() < deadline, "the session's blocks never reached the cache"
        await asyncio.sleep(0.2)
    survivor = next(w for w in mesh.workers() if w is not victim)
    victim.process.kill()
    try:
        turns = [("user", question), ("assistant", first.text), ("user", "Can you refund it instead?")]
        restored_before = await worker_metric(survivor, "ballast_worker_kv_prefix_tokens_total", source="cache")
        second = await collect(router, conversation(turns, "vllm-session"), LOCAL_API_KEY, timeout=120)
        assert_served(second)
        deadline = loop.time() + 15
        while await worker_metric(survivor, "ballast_worker_kv_prefix_tokens_total", source="cache") <= restored_before:
            assert loop.time() < deadline, "the surviving worker restored nothing from the cache"
            await asyncio.sleep(0.2)
        # The same turn recomputed (no session: no restore) gives the same answer.
        reference = await collect(router, conversation(turns, ""), LOCAL_API_KEY, timeout=120)
        assert_served(reference)
        assert second.token_ids == reference.token_ids
    finally:
        await asyncio.to_thread(mesh.restart_service, victim)
    deadline = loop.time() + 60
    while victim.name not in await registered_ids(mesh):
        assert loop.time() < deadline, "the restarted worker did not register"
        await asyncio.sleep(0.2)


async def kill_a_worker_under_streams(mesh, router, keys) -> tuple[list, object]:
    """Starts a stream per key and SIGKILLs the worker with the most of them in flight once
    every stream has sent tokens; returns the streams' results and the killed worker."""
    arrived: dict[tuple[str, bool], int] = {}

    def counter(key):
        def on_tokens(tokens) -> None:
            arrived[key] = arrived.get(key, 0) + len(tokens.token_ids)

        return on_tokens

    streams = [
        asyncio.create_task(
            collect(router, request(p, seeded), LOCAL_API_KEY, timeout=180, on_tokens=counter((p, seeded)))
        )
        for p, seeded in keys
    ]
    # Kill a worker that is generating streams which have already sent tokens (one killed
    # before its first token is retried, not resumed). Its live in-flight count says it is
    # still generating: vLLM can finish a stream while the router still relays it.
    victim = None
    deadline = asyncio.get_running_loop().time() + 60
    while victim is None:
        assert asyncio.get_running_loop().time() < deadline, "the streams never got under way"
        if sum(n >= 4 for n in arrived.values()) == len(keys):
            loads = await worker_loads(mesh)
            busiest = max(loads, key=loads.get)
            if loads[busiest] >= 2:
                victim = next(w for w in mesh.workers() if w.name == busiest)
                break
        await asyncio.sleep(0.01)
    victim.process.kill()
    unfinished_at_kill = sum(not s.done() for s in streams)
    results = await asyncio.gather(*streams)
    assert unfinished_at_kill > 0, "every stream had finished before the kill"
    return results, victim


# A kill aimed by the workers' in-flight counts can still land after the victim's streams
# ended (their last tokens already on the way to the router): that kill proves nothing, so the
# worker is started again and the streams run anew, a bounded number of times.
KILL_ROUNDS = 3


async def test_kill9_mid_stream_greedy_and_seeded_streams_equal_their_references(mesh, router):
    references = {}
    for seeded in (False, True):
        results = await asyncio.gather(
            *[collect(router, request(p, seeded), LOCAL_API_KEY, timeout=120) for p in PROMPTS]
        )
        for prompt, result in zip(PROMPTS, results):
            assert_served(result)
            assert len(result.token_ids) > 64, "the reference stream is too short to be cut"
            references[(prompt, seeded)] = result.token_ids

    keys = [(p, seeded) for p in PROMPTS for seeded in (False, True)]
    loop = asyncio.get_running_loop()
    resumed = 0
    for _ in range(KILL_ROUNDS):
        results, victim = await kill_a_worker_under_streams(mesh, router, keys)
        for key, result in zip(keys, results):
            assert_served(result)
            assert result.token_ids == references[key], key
            assert result.indices == list(range(len(result.token_ids)))
        resumed = sum(r.finished.resumes for r in results)
        if resumed:
            break
        await asyncio.to_thread(mesh.restart_service, victim)
        deadline = loop.time() + 60
        while victim.name not in await registered_ids(mesh):
            assert loop.time() < deadline, "the restarted worker did not register"
            await asyncio.sleep(0.2)
        # Routable again before the next round: its streams must have somewhere to resume.
        await router_routes_to(mesh, {victim.name})
    assert resumed >= 1, f"no stream was on the killed worker in {KILL_ROUNDS} kills"


async def test_a_json_schema_request_is_answered_valid_through_guided_decoding(router):
    message = chat_request("Reply in JSON: status of order 7041?", max_tokens=48, allow_degraded=False)
    message.response_format = SCHEMA
    result = await collect(router, message, LOCAL_API_KEY, timeout=120)
    assert_served(result)
    assert result.finished.structured_status == common_pb2.STRUCTURED_VALID, result.finished
    jsonschema.validate(json.loads(result.finished.structured_output), json.loads(SCHEMA))


async def test_a_vllm_standby_is_loaded_unroutable_and_serves_once_promoted(mesh, router):
    """vLLM's CPU build has no sleep mode: a CPU standby keeps its engine loaded, takes no
    traffic, and serves as soon as its role says so."""
    standby = await asyncio.to_thread(mesh.start_worker, {"BALLAST__WORKER__STANDBY": "true"})
    config = etcd_config(mesh)
    (record,) = [r for r, _ in await list_workers(config) if r.id == standby.name]
    assert record.standby and not record.routable
    # Promote it through its role key, as the autoscaler's executor does.
    client = make_client(config)
    await client.connect()
    try:
        await request_role(client, config, standby.name, SERVING, record.lease_id)
    finally:
        await client.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while not next(r for r, _ in await list_workers(config) if r.id == standby.name).routable:
        assert loop.time() < deadline, "the promoted standby never became routable"
        await asyncio.sleep(0.1)
    before = metric_value(await scrape(standby.metrics_port), "ballast_worker_requests_total")
    results = await asyncio.gather(
        *[
            collect(
                router,
                chat_request(f"{p} (after promotion)", max_tokens=32, raw_prompt=True, allow_degraded=False),
                LOCAL_API_KEY,
                timeout=120,
            )
            for p in PROMPTS * 3
        ]
    )
    for result in results:
        assert_served(result)
    assert metric_value(await scrape(standby.metrics_port), "ballast_worker_requests_total") > before
