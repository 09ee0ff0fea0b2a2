"""A query of death is contained: on a mesh of three sim workers, each run under its keeper
(`worker.respawn`) and armed with the `crash_on_marker` knob, a request whose prompt holds the
marker costs at most two worker processes, gets the quarantine error (never a degraded
answer), is refused at once under a new request id, is counted, is never replayed by the
backfill (a degraded copy handed to Kafka is parked), and the pool serves a normal request
meanwhile and has every worker back once the keepers restarted them. Requests lost with
workers while they waited for their first token are not quarantined: copies of one prompt
lost with one worker count it once, and a request queued behind a full prefill batch on two
workers killed one after the other has one of the two losses excused."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import pytest

from ballast.v1 import inference_pb2_grpc
from bench.hostile_poison import process_running
from services.cli.client import chat_request, collect, open_channel
from services.cli.mesh import LOCAL_API_KEY, Mesh, MeshSpec
from services.cli.poison_view import parked, quarantined
from services.common.degraded.codec import Level, degraded_request_pb, kafka_key, make_ticket
from services.common.etcd_client import make_client
from services.common.faults import REASON_KEY
from services.common.generation import Sampling
from services.common.quarantine import request_fingerprint
from services.config import load_config
from services.router.requests import InferenceRequest, Message
from services.worker.keeper import serving_pid
from services.worker.sim import faults_key
from tests.integration.test_clusters_mesh import worker_leases
from tests.integration.test_mesh import metric_value, registered_ids, router_routes_to, scrape
from tests.served import assert_served

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(400)]

MARKER = "QUERY-OF-DEATH-4711"
POISON = f"Summarise the attached contract. {MARKER}"
WORKERS = 3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    spec = MeshSpec(
        state_dir=tmp_path_factory.mktemp("poison"),
        model_dir=tiny_model_dir,
        workers=WORKERS,
        engine="sim",
        lease_ttl_s=3,
        worker_capacity=4,
        overrides={
            "worker": {"respawn": True, "sim_faults": {"crash_on_marker": MARKER}},
            # Hung workers hold requests without a stall for as long as a test needs them held;
            # a short prefill batch, so a line of three on a worker holds a queued request.
            "router": {
                "stall": {"s_timeout_s": 60, "a_timeout_s": 60, "b_timeout_s": 60},
                "quarantine": {"max_prefill_batch": 2},
                # A restarted worker takes its share at once: the tests place lines by count.
                "scheduling": {"slow_start_s": 0},
            },
        },
    )
    running = Mesh(spec).start()
    yield running
    running.stop()


def serving_pids(mesh) -> dict[str, int | None]:
    """The pid each keeper's worker runs under now (None between a death and the restart)."""
    pids = {worker.name: serving_pid(worker.pid) for worker in mesh.workers()}
    return {name: pid if process_running(pid) else None for name, pid in pids.items()}


def lost(before: dict, after: dict) -> int:
    return sum(1 for name, pid in before.items() if after.get(name) != pid)


def none_died(running_then: dict, now: dict) -> bool:
    """Every worker that was running then runs still (keepers may have restarted others since)."""
    return all(now.get(name) == pid for name, pid in running_then.items() if pid is not None)


def port_of(mesh, name: str) -> int:
    return next(s for s in mesh.services if s.name == name).metrics_port


async def refusal(router, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await collect(router, request, LOCAL_API_KEY, timeout=60)
    return raised.value


def reason_of(error: grpc.aio.AioRpcError) -> str | None:
    return next((v for k, v in (error.trailing_metadata() or ()) if k == REASON_KEY), None)


async def wait_all_serving(mesh, before: dict, timeout: float = 60.0) -> dict:
    """Until every keeper runs a worker again and all are registered in etcd."""
    deadline = time.monotonic() + timeout
    while True:
        now = serving_pids(mesh)
        if all(now.values()) and {w.name for w in mesh.workers()} <= await registered_ids(mesh):
            return now
        assert time.monotonic() < deadline, f"the keepers did not bring every worker back: {before} -> {now}"
        await asyncio.sleep(0.2)


async def test_a_query_of_death_costs_two_workers_and_is_quarantined(mesh):
    before = await wait_all_serving(mesh, {})
    router_port, backfill_port = port_of(mesh, "router"), port_of(mesh, "backfill")
    async with open_channel(mesh.router_address) as channel:
        router = inference_pb2_grpc.InferenceStub(channel)
        # The pool serves before the poison (and the prompt alone, without the marker, is harmless).
        assert_served(
            await collect(
                router, chat_request("Summarise the attached contract.", max_tokens=8), LOCAL_API_KEY, timeout=60
            )
        )

        # Degradation is allowed (the default): the answer must still be the quarantine error.
        error = await refusal(router, chat_request(POISON, max_tokens=16, request_id="poison-1"))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reason_of(error) == "quarantined"
        assert MARKER not in (error.details() or "")
        after_poison = serving_pids(mesh)
        assert lost(before, after_poison) == 2, f"{before} -> {after_poison}"

        # The third worker never saw it, and serves at once (no degraded answer, no wait for keepers).
        served = await collect(
            router, chat_request("Where is my order?", max_tokens=8, allow_degraded=False), LOCAL_API_KEY, timeout=60
        )
        assert_served(served)

        # A client retry under a new request id is refused before any worker sees it.
        untouched = serving_pids(mesh)
        again = await refusal(router, chat_request(POISON, max_tokens=16, request_id=f"poison-{uuid.uuid4().hex}"))
        assert again.code() == grpc.StatusCode.FAILED_PRECONDITION and reason_of(again) == "quarantined"
        assert none_died(untouched, serving_pids(mesh))

    # Over the OpenAI-compatible API too: 422 with code `quarantined` and a Retry-After, no worker lost.
    import httpx

    async with httpx.AsyncClient(
        base_url=mesh.http_base_url, timeout=60, headers={"Authorization": f"Bearer {LOCAL_API_KEY}"}
    ) as http:
        reply = await http.post(
            "/chat/completions",
            json={"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": POISON}]},
        )
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["code"] == "quarantined" and int(reply.headers["Retry-After"]) > 0
    assert none_died(untouched, serving_pids(mesh))

    text = await scrape(router_port)
    assert metric_value(text, "ballast_router_quarantine_total", event="quarantined") == 1
    assert metric_value(text, "ballast_router_quarantine_total", event="refused") >= 1

    # The router shared it through etcd, by fingerprint only.
    config = load_config(mesh.config_path, environ={})
    entries = await quarantined(config.etcd)
    assert [e.workers_lost for e in entries] == [2]
    poison_request = InferenceRequest(
        request_id="poison-1",
        session_id="",
        tenant="local",
        model="tiny",
        sampling=Sampling(max_tokens=16),
        tier="A",
        messages=(Message("user", POISON),),
    )
    assert entries[0].fingerprint == request_fingerprint(poison_request)

    # A degraded copy of it in Kafka (as a router that degraded it before the quarantine would
    # have written it) is parked by the backfill: never replayed, no worker lost.
    ticket = make_ticket("local", "poison-degraded-earlier")
    record = degraded_request_pb(
        poison_request,
        ticket=ticket,
        tier="A",
        level=Level.RULES,
        reason="no_worker",
        degraded_text="(rules)",
        degraded_by="rules",
        received_at=time.time(),
    )
    from services.router.degrade.handoff import HandOff, HandOffSettings

    handoff = HandOff(
        HandOffSettings(
            outbox_path=mesh.state_dir / "poison-outbox.sqlite", bootstrap=mesh.kafka.bootstrap, delivery_timeout_s=5
        )
    )
    await handoff.start()
    try:
        await handoff.submit(kafka_key("", ticket), record.SerializeToString())
    finally:
        await handoff.stop(10.0)
    deadline = time.monotonic() + 120
    while metric_value(await scrape(backfill_port), "ballast_backfill_dead_lettered_total", cause="quarantined") < 1:
        assert time.monotonic() < deadline, "the backfill did not park the quarantined request"
        await asyncio.sleep(0.5)
    backfill_text = await scrape(backfill_port)
    assert metric_value(backfill_text, "ballast_backfill_replays_total") == 0
    assert [p.ticket for p in await parked(config.redis, "ballast:backfill:")] == [ticket]

    # The keepers restarted the two workers; the poison cost nothing more meanwhile.
    back = await wait_all_serving(mesh, after_poison)
    assert lost(before, back) == 2
    async with open_channel(mesh.router_address) as channel:
        router = inference_pb2_grpc.InferenceStub(channel)
        for i in range(WORKERS * 2):
            assert_served(
                await collect(
                    router, chat_request(f"Order {i}?", max_tokens=4, allow_degraded=False), LOCAL_API_KEY, timeout=60
                )
            )
    assert serving_pids(mesh) == back


async def test_the_benchmark_case_reports_its_goals_met(mesh):
    from bench.hostile_poison import poison_case

    await wait_all_serving(mesh, {})
    result = await poison_case(mesh, park_wait_s=120)
    assert result["answer_code"] == "FAILED_PRECONDITION" and result["answer_reason"] == "quarantined"
    assert not result["answer_degraded"]
    assert result["workers_lost"] <= 2 and result["retry_refused"] and result["retry_workers_lost"] == 0
    assert result["backfill_replays"] == 0 and result["parked"]
    assert result["served_again_s"] is not None


async def in_flight(mesh) -> dict[str, float]:
    """Each worker's streams in flight, leaving out a worker whose metrics do not answer (one
    killed by a test before, still starting again under its keeper: it listens on new ports,
    read from its latest READY line)."""
    held = {}
    for worker in mesh.workers():
        mesh.refresh_ready(worker)
        try:
            held[worker.name] = metric_value(await scrape(worker.metrics_port), "ballast_worker_in_flight")
        except ConnectionError:  # refused, or reset by a worker killed under the scrape
            continue
    return held


async def hang_ready(mesh):
    """Once every worker serves and answers its metrics: the etcd settings, a client for the
    fault knobs (the caller closes it), the router's metrics port and its quarantine count."""
    await wait_all_serving(mesh, {})
    deadline = time.monotonic() + 60
    while len(await in_flight(mesh)) < WORKERS:
        assert time.monotonic() < deadline, "a worker's metrics never came back"
        await asyncio.sleep(0.2)
    etcd = load_config(mesh.config_path, environ={}).etcd
    router_port = port_of(mesh, "router")
    return etcd, make_client(etcd), router_port, await quarantined_count(router_port)


async def quarantined_count(router_port: int) -> float:
    return metric_value(await scrape(router_port), "ballast_router_quarantine_total", event="quarantined")


async def lift_hang(client, etcd, names: list[str]) -> None:
    for name in names:
        await client.delete(faults_key(etcd.prefix, name).encode())


async def test_a_worker_lost_with_many_copies_of_one_prompt_in_prefill_quarantines_nothing(mesh):
    """Copies of one popular prompt wait for their first token on every worker (all hung); one
    worker's lease is revoked from outside (as an overload that starves its keep-alive or an
    etcd hiccup would let it lapse). The copies it held count one worker lost against the
    prompt, not one each: nothing is quarantined, and every copy is served once the workers
    run again."""
    etcd, client, router_port, quarantined_before = await hang_ready(mesh)
    names = [w.name for w in mesh.workers()]
    prompt = "Which parcels leave the depot today?"
    try:
        for name in names:
            await client.put(faults_key(etcd.prefix, name).encode(), b'{"hang": true}')
        async with open_channel(mesh.router_address) as channel:
            router = inference_pb2_grpc.InferenceStub(channel)
            copies = [
                asyncio.create_task(
                    collect(
                        router,
                        chat_request(prompt, max_tokens=8, allow_degraded=False, request_id=f"copy-{i}"),
                        LOCAL_API_KEY,
                        timeout=120,
                    )
                )
                for i in range(2 * WORKERS)
            ]
            # Two copies at least on one worker (six over three): that worker's lease goes.
            deadline = time.monotonic() + 30
            while True:
                held = await in_flight(mesh)
                if sum(held.values()) == len(copies):
                    break
                assert time.monotonic() < deadline, f"the copies never all reached the workers: {held}"
                await asyncio.sleep(0.05)
            victim = max(held, key=held.__getitem__)
            assert held[victim] >= 2
            moved_before = await moved_off_lost_workers(router_port)
            await client.revoke_lease((await worker_leases(etcd))[victim])
            # Until the router moved every copy the victim held (the worker takes a new lease at
            # once, under the same name: its name leaving the routing gauge may never be seen).
            await wait_moved_off_lost_workers(router_port, moved_before + held[victim])
            await lift_hang(client, etcd, names)
            for answer in await asyncio.gather(*copies):
                assert_served(answer)
            assert_served(
                await collect(
                    router, chat_request(prompt, max_tokens=8, allow_degraded=False), LOCAL_API_KEY, timeout=60
                )
            )
    finally:
        await lift_hang(client, etcd, names)
        await client.close()
    assert await quarantined_count(router_port) == quarantined_before


async def moved_off_lost_workers(router_port: int) -> float:
    """Requests the router moved off a worker it lost (its lease or its connection)."""
    text = await scrape(router_port)
    return sum(
        metric_value(text, "ballast_router_worker_retries_total", reason=reason)
        for reason in ("lease_lost", "worker_lost")
    )


async def wait_moved_off_lost_workers(router_port: int, count: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (moved := await moved_off_lost_workers(router_port)) < count:
        assert time.monotonic() < deadline, f"the router moved {moved} requests off lost workers, not {count}"
        await asyncio.sleep(0.05)


async def wait_held(mesh, names: list[str], count: int, timeout: float = 30.0) -> dict[str, float]:
    """Until the workers `names` hold `count` streams in flight between them."""
    deadline = time.monotonic() + timeout
    while True:
        held = {name: n for name, n in (await in_flight(mesh)).items() if name in names}
        if sum(held.values()) == count:
            return held
        assert time.monotonic() < deadline, f"the workers {names} never held {count} streams: {held}"
        await asyncio.sleep(0.05)


async def wait_restarted(mesh, killed: dict[str, int | None], names: list[str], timeout: float = 60.0) -> None:
    """Until the keepers of `names` run new workers (not the pids in `killed`) and the router
    routes to each."""
    deadline = time.monotonic() + timeout
    while True:
        now = serving_pids(mesh)
        if all(now[name] is not None and now[name] != killed[name] for name in names):
            break
        assert time.monotonic() < deadline, f"the keepers did not restart {names}: {killed} -> {now}"
        await asyncio.sleep(0.1)
    await router_routes_to(mesh, set(names), timeout=max(1.0, deadline - time.monotonic()))


async def test_a_request_queued_behind_a_full_prefill_batch_on_two_lost_workers_is_served(mesh):
    """Every worker hangs (nothing leaves prefill) and holds two requests waiting for their
    first token; a third request joins the line of one of them, behind a full prefill batch as
    the router counts it (`max_prefill_batch: 2`; the sim itself prefills all its slots at
    once, so this exercises the router's rule, not an engine's batch). That worker is killed:
    its three requests move to the other two workers, at the ends of their lines. Then both of
    those are killed. The third request has been on two workers that died under it without a
    token, as a query of death would have, but behind others both times: its first loss is
    excused and only the second counts (1 of 2), so it is not quarantined, nor is any other
    request, and every one is served once the hang is lifted, by the workers the keepers
    restarted. (Without the rule it is quarantined, as are the two moved with it.)"""
    etcd, client, router_port, quarantined_before = await hang_ready(mesh)
    names = [w.name for w in mesh.workers()]
    try:
        for name in names:
            await client.put(faults_key(etcd.prefix, name).encode(), b'{"hang": true}')
        async with open_channel(mesh.router_address) as channel:
            router = inference_pb2_grpc.InferenceStub(channel)

            def send(prompt: str, request_id: str) -> asyncio.Task:
                request = chat_request(prompt, max_tokens=8, allow_degraded=False, request_id=request_id)
                return asyncio.create_task(collect(router, request, LOCAL_API_KEY, timeout=150))

            ahead = [send(f"Track parcel {i} for me.", f"ahead-{i}") for i in range(2 * WORKERS)]
            held = await wait_held(mesh, names, len(ahead))
            assert sorted(held.values()) == [2] * WORKERS, f"the router did not spread the line: {held}"
            queued = send("Which depot holds my parcel?", "queued")
            held = await wait_held(mesh, names, len(ahead) + 1)
            first = max(held, key=held.__getitem__)
            pids = serving_pids(mesh)
            os.kill(pids[first], signal.SIGKILL)
            # The three it held go to the ends of the other two workers' lines (before its
            # keeper has it back): the queued request is on one of them.
            others = [name for name in names if name != first]
            await wait_held(mesh, others, len(ahead) + 1)
            # The first runs again (and the router routes to it) before the others die, so
            # that their requests have a worker to move to.
            await wait_restarted(mesh, pids, [first])
            for name in others:
                os.kill(pids[name], signal.SIGKILL)
            await wait_restarted(mesh, pids, others)
            await lift_hang(client, etcd, names)
            for answer in await asyncio.gather(*ahead, queued):
                assert_served(answer)
    finally:
        await lift_hang(client, etcd, names)
        await client.close()
    assert await quarantined_count(router_port) == quarantined_before
