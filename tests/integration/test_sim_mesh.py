"""Sixteen simulated workers (`worker.engine: sim`), each its own process with a real gRPC
server registered in etcd, behind the router: streams spread over them, and when some are
killed with SIGKILL mid-stream every stream still equals its uninterrupted reference token
for token (the sim's tokens depend on the position only, as a seeded real engine's do).
Their fault knobs, set through etcd while they run, act as they say."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import pytest

from services.cli.client import chat_request, collect
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from tests.integration.victims import Answering, token_counter, worker_answering
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(600)]

WORKERS = 16
STREAMS = 32
TOKENS = 150  # about 1.5 s per stream with the default profile


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("sim-mesh"),
        model_dir=tiny_model_dir,
        workers=WORKERS,
        engine="sim",
        lease_ttl_s=3,
        worker_capacity=4,
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


def request(i: int, seeded: bool):
    options = {"temperature": 0.8, "seed": 100 + i} if seeded else {}
    return chat_request(
        f"Customer {i} asks about order {3000 + i}.",
        max_tokens=TOKENS,
        raw_prompt=True,
        allow_degraded=False,
        **options,
    )


KILLED = 4
# While victims are chosen, every sim worker runs this many times slower (its own knob), so the
# batch's streams last while the test reads sixteen workers' metrics on a busy machine; the
# gaps between tokens stay far under the router's stall timeouts.
SLOWDOWN = 10.0
# A batch in which a victim had finished its streams when its kill landed proves less than it
# claims: another batch runs (the victims started again first), up to this many.
FAULT_BATCHES = 3


async def test_streams_survive_sim_workers_killed_mid_stream(mesh, router):
    keys = [(i, i % 2 == 1) for i in range(STREAMS)]
    references = await asyncio.gather(*(collect(router, request(i, s), LOCAL_API_KEY, timeout=120) for i, s in keys))
    for reference in references:
        assert_served(reference)
        assert len(reference.token_ids) == TOKENS
    rng = random.Random(20261203)
    outcomes: list[dict] = []
    for _batch in range(FAULT_BATCHES):
        alive = [w for w in mesh.workers() if w.process.alive()]
        on_workers = await Answering.read(alive)
        await set_all_faults(mesh, alive, {"slowdown": SLOWDOWN})
        received = [0] * len(keys)
        streams = [
            asyncio.create_task(
                collect(router, request(i, s), LOCAL_API_KEY, timeout=120, on_tokens=token_counter(received, n))
            )
            for n, (i, s) in enumerate(keys)
        ]
        # Victims: workers read in the middle of answering a stream of the batch (16 processes
        # share this machine's cores: when that is depends on it), killed together once four
        # are found, so no stream is resumed on a worker about to be killed.
        victims: list = []
        try:
            while len(victims) < KILLED:
                victim = await worker_answering(
                    [w for w in alive if w not in victims], on_workers, streams, rng, received
                )
                if victim is None:
                    break
                victims.append(victim)
            # Every victim is signalled before any is reaped (a reap waits for the process to
            # end, which on a busy machine takes a while each): they die together.
            for victim in victims:
                os.killpg(victim.pid, signal.SIGKILL)
            for victim in victims:
                victim.process.kill()
        finally:
            await clear_faults(mesh, alive)
        results = await asyncio.gather(*streams)
        for result, reference in zip(results, references):
            assert_served(result)
            assert result.token_ids == reference.token_ids
            assert result.indices == list(range(TOKENS))
        outcomes.append({"kills": len(victims), "resumes": sum(r.finished.resumes for r in results)})
        if len(victims) == KILLED and outcomes[-1]["resumes"] >= len(victims):
            break
        for victim in victims:
            await asyncio.to_thread(mesh.restart_service, victim)
    else:
        pytest.fail(f"in {FAULT_BATCHES} batches {KILLED} kills never each hit a stream in flight: {outcomes}")


async def set_faults(mesh, worker_name: str, faults: dict | None) -> None:
    """Writes (or, with None, deletes) a sim worker's fault key in the mesh's etcd."""
    from services.common.etcd_client import make_client
    from services.config import load_config
    from services.worker.sim import faults_key

    etcd = load_config(mesh.config_path, environ={}).etcd
    client = make_client(etcd)
    try:
        key = faults_key(etcd.prefix, worker_name).encode()
        if faults is None:
            await client.delete(key)
        else:
            await client.put(key, json.dumps(faults).encode())
    finally:
        await client.close()


async def set_all_faults(mesh, workers, faults: dict) -> None:
    await asyncio.gather(*(set_faults(mesh, w.name, faults) for w in workers))


async def clear_faults(mesh, workers) -> None:
    await asyncio.gather(*(set_faults(mesh, w.name, None) for w in workers))


async def test_fault_knobs_set_through_etcd_while_the_workers_run(mesh, router):
    from tests.integration.test_failover import routed_temperature, wait_routing

    workers = [w for w in mesh.workers() if w.process.alive()]

    # Fail after 20 tokens, set on two workers while each is in the middle of answering a
    # stream: those streams still end whole and exact, resumed elsewhere. A batch whose
    # streams had all finished there when the knob landed proves nothing: another runs.
    keys = [(i, True) for i in range(8)]
    references = await asyncio.gather(*(collect(router, request(i, s), LOCAL_API_KEY, timeout=120) for i, s in keys))
    rng = random.Random(20261204)
    for _batch in range(FAULT_BATCHES):
        on_workers = await Answering.read(workers)
        await set_all_faults(mesh, workers, {"slowdown": SLOWDOWN})
        received = [0] * len(keys)
        streams = [
            asyncio.create_task(
                collect(router, request(i, s), LOCAL_API_KEY, timeout=120, on_tokens=token_counter(received, n))
            )
            for n, (i, s) in enumerate(keys)
        ]
        failing: list = []
        try:
            while len(failing) < 2:
                worker = await worker_answering(
                    [w for w in workers if w not in failing], on_workers, streams, rng, received
                )
                if worker is None:
                    break
                await set_faults(mesh, worker.name, {"fail_after_tokens": 20})
                failing.append(worker)
            await clear_faults(mesh, [w for w in workers if w not in failing])  # full speed again
            results = await asyncio.gather(*streams)
        finally:
            await clear_faults(mesh, workers)
        for result, reference in zip(results, references):
            assert_served(result)
            assert result.token_ids == reference.token_ids
        if sum(r.finished.resumes for r in results) >= 1:
            break
    else:
        pytest.fail(f"in {FAULT_BATCHES} batches no stream was on a worker when it began to fail")
    hot, sick, doomed = [w for w in workers if w not in failing][:3]

    # A reported temperature reaches the router and takes the worker out as hot; cleared, back in.
    await set_faults(mesh, hot.name, {"temperature_c": 95})
    await wait_routing(mesh, hot.name, "hot")
    assert await routed_temperature(mesh, hot.name) == 95
    await set_faults(mesh, hot.name, None)
    await wait_routing(mesh, hot.name, "none")

    # Failing health: out of routing as unhealthy; cleared, back in.
    await set_faults(mesh, sick.name, {"fail_health": True})
    await wait_routing(mesh, sick.name, "unhealthy")
    await set_faults(mesh, sick.name, None)
    await wait_routing(mesh, sick.name, "none")

    # A value that does not parse changes nothing and leaves the worker up.
    await set_faults(mesh, sick.name, {"no_such_knob": 1})
    assert_served(await collect(router, request(0, False), LOCAL_API_KEY, timeout=60))
    assert sick.process.alive()
    await set_faults(mesh, sick.name, None)

    # Crash: the process ends at once, without deregistering.
    await set_faults(mesh, doomed.name, {"crash": True})
    deadline = time.monotonic() + 20
    while doomed.process.alive():
        assert time.monotonic() < deadline, "the worker did not crash"
        await asyncio.sleep(0.05)
    assert doomed.process.exit_status() == 70


async def test_idle_workers_keep_their_leases_without_rewriting_their_records(mesh, router):
    """A record is written when it changes: idle workers only refresh their leases, so they
    stay members without waking every router's watch once a second."""
    from services.cli.etcd_view import list_workers
    from services.common.etcd_client import make_client
    from services.common.membership import workers_prefix
    from services.config import load_config

    etcd = load_config(mesh.config_path, environ={}).etcd
    alive = {w.name for w in mesh.workers() if w.process.alive()}

    async def revisions() -> dict[str, int]:
        client = make_client(etcd)
        try:
            prefix = workers_prefix(etcd)
            return {kv.key.decode()[len(prefix) :]: kv.mod_revision for kv in await client.get_prefix(prefix.encode())}
        finally:
            await client.close()

    # Idle once no record says work is in flight (streams of the tests before have ended).
    deadline = time.monotonic() + 30
    while any(record.in_flight for record, _ in await list_workers(etcd)):
        assert time.monotonic() < deadline, "the workers never went idle"
        await asyncio.sleep(0.2)
    await asyncio.sleep(2 * etcd.heartbeat_s)  # the last change's write is out
    before = await revisions()
    assert alive <= set(before)
    await asyncio.sleep(etcd.lease_ttl_s + 2 * etcd.heartbeat_s)  # past a whole lease
    after = await revisions()
    assert alive <= set(after), "an idle worker's lease lapsed"
    assert {name: after[name] for name in alive} == {name: before[name] for name in alive}
    assert_served(await collect(router, request(0, False), LOCAL_API_KEY, timeout=60))
