"""One etcd session per process, against a real etcd that is stopped and started again.

A router app builds exactly one `EtcdSession` and every part that reaches etcd works over it
(membership, tiering rules, quarantine, rollouts, the autoscaler's reports, campaign and
decisions), so the process holds one etcd client at a time. A client dropped by one part costs
the elected leaders no term. After etcd restarts, membership, quarantine (both ways) and rollouts
follow it again on that same session, and at shutdown the app closes it once, after every part
stopped. A worker app and a sim host hold one session as well.

(gRPC shares one TCP connection among channels to the same address, so counting sockets would
not tell one session from several: the sessions and their clients are counted instead.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid

import pytest

from services.common import etcd_session
from services.common.etcd_client import make_client as raw_client
from services.common.config import EtcdConfig
from services.common.etcd_session import ETCD_ERRORS, EtcdCallCut, EtcdSession
from services.common.errors import Quarantined
from services.common.membership import WorkerRecord, worker_key
from services.common.quarantine import QuarantineEntry, quarantine_key, request_fingerprint
from services.router.app import RouterApp, create_server as create_router
from services.router.rollout.state import Rollout, rollout_key
from services.worker.app import create_server as create_worker
from services.worker.sim.faults import faults_key
from services.worker.sim.host import SimHost
from tests.component.conftest import make_config
from tests.component.test_quarantine_etcd import poison
from tests.polling import poll

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(180)]

FAST_ETCD = {"BALLAST__ETCD__RECONNECT_BACKOFF_S": "0.1"}
# A leader's refresh every 2 s, each with the default 2 s deadline: a loaded 2-core host does
# not end a term by itself while the test looks.
AUTOSCALER = {
    "BALLAST__AUTOSCALER__ENABLED": "true",
    "BALLAST__AUTOSCALER__TICK_S": "0.3",
    "BALLAST__AUTOSCALER__LEADER_TTL_S": "6",
}


class Census:
    """Every `EtcdSession` built, and every client a session connected, while it is installed."""

    def __init__(self, monkeypatch) -> None:
        self.sessions: list[EtcdSession] = []
        self.clients: list = []
        self.closes: dict[int, int] = {}
        built, connect = EtcdSession.__init__, etcd_session.make_client

        def record_session(session, *args, **kwargs) -> None:
            built(session, *args, **kwargs)
            self.sessions.append(session)

        def record_client(config):
            client = connect(config)
            self.clients.append(client)
            return client

        monkeypatch.setattr(EtcdSession, "__init__", record_session)
        monkeypatch.setattr(etcd_session, "make_client", record_client)

    def open_clients(self) -> list:
        # aetcd drops the channel on close(): a client with one is connected.
        return [c for c in self.clients if c.channel is not None]


async def in_etcd(config, action):
    """Runs `action(client)` on a client of the test's own (not the router's, not counted)."""
    return await in_etcd_of(config.etcd, action)


async def in_etcd_of(etcd: EtcdConfig, action):
    client = raw_client(etcd)
    await client.connect()
    try:
        return await action(client)
    finally:
        await client.close()


async def until_etcd_answers(config, timeout: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            await in_etcd(config, lambda c: c.get(b"/"))
            return
        except ETCD_ERRORS:
            assert asyncio.get_running_loop().time() < deadline, "etcd did not answer again"
            await asyncio.sleep(0.1)


def record(worker_id: str) -> bytes:
    # An address nothing listens on: membership holds records, it does not dial them.
    return WorkerRecord(id=worker_id, address="127.0.0.1:9", model="tiny", model_version="v1").to_json()


def parts_sessions(router: RouterApp) -> dict[str, EtcdSession]:
    quarantine = router.servicer.runner.quarantine
    rollouts = router.servicer.rollouts
    autoscaler = router.autoscaler
    assert autoscaler is not None and rollouts.leader is not None and rollouts._watch is not None
    assert quarantine.watch is not None and quarantine.publisher is not None
    return {
        "membership": router.membership.session,
        "rules": router.rules_watch.session,
        "quarantine watch": quarantine.watch.session,
        "quarantine publisher": quarantine.publisher.session,
        "rollout watch": rollouts._watch.session,
        "rollout gate lock": rollouts.leader.session,
        "rollout store": rollouts.session,
        "autoscaler": autoscaler.session,
        "autoscaler reports": autoscaler.board.session,
        "autoscaler lock": autoscaler.lock.session,
        "autoscaler executor": autoscaler.executor.session,
    }


async def test_a_router_holds_one_etcd_session_through_an_etcd_restart(restartable_etcd, tiny_model_dir, monkeypatch):
    prefix = f"/one-session-{uuid.uuid4().hex[:8]}/"
    config = make_config(restartable_etcd, tiny_model_dir, prefix, **FAST_ETCD, **AUTOSCALER)
    census = Census(monkeypatch)
    router = await create_router(config)
    closed_with: list[list[str]] = []
    try:
        assert census.sessions == [router.etcd], "the router app builds one session"
        sessions = parts_sessions(router)
        assert {name for name, s in sessions.items() if s is not router.etcd} == set()
        autoscaler, rollouts = router.autoscaler, router.servicer.rollouts
        assert autoscaler is not None and rollouts.leader is not None
        assert await autoscaler.lock.wait_leader(15) and await rollouts.leader.wait_leader(15)
        assert await poll(lambda: autoscaler.board.published.is_set() and router.membership.synced.is_set(), 15)
        assert len(census.open_clients()) == 1 and router.etcd._client in census.open_clients()

        # One part's failed call drops the shared client: every watch reads again on the next,
        # and the leaders keep their terms (only their keys or leases end a term).
        terms = (autoscaler.lock.terms, rollouts.leader.terms)
        syncs = router.membership._watch.syncs
        await router.etcd.reset()
        assert await poll(lambda: router.membership._watch.syncs > syncs, 15)
        await asyncio.sleep(1.0)  # the leaders' watches reopen after one backoff (0.1 s)
        assert autoscaler.lock.is_leader and rollouts.leader.is_leader
        assert (autoscaler.lock.terms, rollouts.leader.terms) == terms
        assert len(census.open_clients()) == 1

        await in_etcd(config, lambda c: c.put(worker_key(config.etcd, "before").encode(), record("before")))
        assert await router.membership.wait_for(lambda w: "before" in w, 10)

        await asyncio.to_thread(restartable_etcd.stop)
        assert await poll(lambda: not router.telemetry.dependencies.is_up("etcd"), 20)
        await asyncio.to_thread(restartable_etcd.restart)
        await until_etcd_answers(config)

        # Membership: the record from before the restart is kept, a new one arrives.
        await in_etcd(config, lambda c: c.put(worker_key(config.etcd, "after").encode(), record("after")))
        assert await router.membership.wait_for(lambda w: {"before", "after"} <= set(w), 20)
        assert await poll(lambda: router.telemetry.dependencies.is_up("etcd"), 10)

        # Quarantine, in: another router's entry reaches this router's store.
        quarantine = router.servicer.runner.quarantine
        elsewhere = QuarantineEntry("e" * 64, "acme", "worker_lost", time.time(), 2, 60.0)
        await in_etcd(
            config, lambda c: c.put(quarantine_key(prefix, elsewhere.fingerprint).encode(), elsewhere.to_json())
        )
        assert await poll(lambda: quarantine.store.get(elsewhere.fingerprint) is not None, 20)
        # Quarantine, out: this router's own reaches etcd.
        quarantine.worker_lost(poison("a"), "worker_lost", "w1")
        with pytest.raises(Quarantined):
            quarantine.worker_lost(poison("a"), "worker_lost", "w2")
        fp = request_fingerprint(poison("a"))
        key = quarantine_key(prefix, fp).encode()

        async def published() -> bool:
            return await in_etcd(config, lambda c: c.get(key)) is not None

        deadline = asyncio.get_running_loop().time() + 20
        while not await published():
            assert asyncio.get_running_loop().time() < deadline, "the quarantine entry never reached etcd"
            await asyncio.sleep(0.1)

        # Rollouts: a document written now is followed.
        document = Rollout(model="tiny", stable="v1", candidate="v2", weight=10.0)
        await in_etcd(config, lambda c: c.put(rollout_key(prefix, "tiny").encode(), document.to_json()))
        assert await poll(lambda: rollouts.rollouts.get("tiny") == document, 20)

        # The leaders campaign again on the same session, and the autoscaler decides again.
        assert await autoscaler.lock.wait_leader(20) and await rollouts.leader.wait_leader(20)
        ticks = autoscaler.ticks
        assert await poll(lambda: autoscaler.ticks > ticks, 20)
        decision = await in_etcd(config, lambda c: c.get(f"{prefix}scale/primary".encode()))
        assert decision is not None and json.loads(decision.value)["leader"] == autoscaler.router_id

        assert census.sessions == [router.etcd], "no part built a session of its own meanwhile"
        assert len(census.open_clients()) == 1 and router.etcd.connects >= 2

        # Shutdown closes the session once, after every part that uses it stopped.
        close = router.etcd.close

        async def close_last() -> None:
            closed_with.append(still_running(router))
            await close()

        monkeypatch.setattr(router.etcd, "close", close_last)
    finally:
        await router.shutdown(grace_s=1.0)
    assert closed_with == [[]], f"closed while these still ran: {closed_with}"
    assert census.open_clients() == [] and router.etcd._watches == set()


def still_running(router: RouterApp) -> list[str]:
    """The router's etcd parts whose background work has not stopped."""
    quarantine, rollouts, autoscaler = router.servicer.runner.quarantine, router.servicer.rollouts, router.autoscaler
    assert autoscaler is not None and rollouts.leader is not None and quarantine.publisher is not None
    tasks = {
        "membership": router.membership._watch._task,
        "rules": router.rules_watch._watch._task,
        "quarantine watch": quarantine.watch._watch._task if quarantine.watch is not None else None,
        "quarantine publisher": quarantine.publisher._task,
        "rollout gate lock": rollouts.leader._task,
        "autoscaler": autoscaler._task,
        "autoscaler reports": autoscaler.board._task,
        "autoscaler lock": autoscaler.lock._task,
    }
    running = [name for name, task in tasks.items() if task is not None and not task.done()]
    return running + [f"rollout task {t.get_name()}" for t in rollouts._tasks if not t.done()]


async def test_a_worker_holds_one_etcd_session_and_closes_it_last(etcd_server, tiny_model_dir, monkeypatch):
    prefix = f"/one-session-{uuid.uuid4().hex[:8]}/"
    census = Census(monkeypatch)
    app = await create_worker(make_config(etcd_server, tiny_model_dir, prefix, BALLAST__WORKER__ID="w1"))
    try:
        assert census.sessions == [app.etcd] and app.owns_etcd
        assert app.registration.session is app.etcd and app.standby is not None
        assert app.standby._watch.session is app.etcd
        await asyncio.wait_for(app.registration.registered.wait(), 10)
        assert len(census.open_clients()) == 1
    finally:
        await app.shutdown(grace_s=1.0)
    assert census.open_clients() == []
    assert await in_etcd(app.config, lambda c: c.get(worker_key(app.config.etcd, "w1").encode())) is None, (
        "the lease was revoked before the session closed"
    )


async def test_a_sim_host_shares_one_session_and_a_crash_ends_only_that_workers_part(
    etcd_server, tiny_model_dir, monkeypatch
):
    prefix = f"/one-session-{uuid.uuid4().hex[:8]}/"
    config = make_config(
        etcd_server,
        tiny_model_dir,
        prefix,
        BALLAST__WORKER__ENGINE="sim",
        BALLAST__WORKER__ID="sim",
        BALLAST__ETCD__HEARTBEAT_S="0.2",
    )
    census = Census(monkeypatch)
    host = SimHost(config, count=2)
    await host.start()
    try:
        assert census.sessions == [host.etcd]
        assert all(app.etcd is host.etcd and not app.owns_etcd for app in host.apps.values())
        survivor = host.apps[1]
        await host._crash(0)
        assert len(census.open_clients()) == 1, "a crashed worker leaves the shared session open"
        # The survivor's registration and fault watch still follow etcd on the shared session.
        assert survivor.sim_faults is not None
        await in_etcd(
            config, lambda c: c.put(faults_key(prefix, survivor.worker_id).encode(), b'{"temperature_c": 91}')
        )
        assert await poll(lambda: survivor.temperature.read() == 91, 10)
        assert await poll(lambda: json.loads(survivor.record().to_json())["temperature_c"] == 91, 5)

        async def published_temperature():
            got = await in_etcd(config, lambda c: c.get(worker_key(config.etcd, survivor.worker_id).encode()))
            return None if got is None else json.loads(got.value)["temperature_c"]

        deadline = asyncio.get_running_loop().time() + 10
        while await published_temperature() != 91:
            assert asyncio.get_running_loop().time() < deadline, "the survivor's record was not written"
            await asyncio.sleep(0.1)
    finally:
        await host.shutdown()
    assert census.open_clients() == [] and host.etcd._watches == set()


async def test_calls_cut_by_another_parts_reset_fail_as_etcd_errors_and_every_watch_goes_on(restartable_etcd):
    """Calls in flight on the shared client when another part drops it (etcd stopped with
    SIGSTOP, so they wait on it) fail as etcd errors: the watches that made them resync once
    etcd answers again, and a plain call raises `EtcdCallCut`, not a bare cancellation."""
    prefix = f"/cut-{uuid.uuid4().hex[:8]}/"
    # A long call deadline: the calls must still be waiting when the client is dropped.
    config = EtcdConfig(
        host=restartable_etcd.host, port=restartable_etcd.port, prefix=prefix, timeout_s=20.0, reconnect_backoff_s=0.05
    )
    session = EtcdSession(config)
    seen: dict[str, list[bytes]] = {"a": [], "b": []}
    watches = {
        name: session.watch_prefix(
            f"{prefix}{name}/".encode(), on_change=lambda change, name=name: seen[name].append(change.key)
        )
        for name in seen
    }
    pid = restartable_etcd.pid
    assert pid is not None
    try:
        for watch in watches.values():
            await watch.start()
        assert await poll(lambda: all(w.synced.is_set() for w in watches.values()), 15)

        os.kill(pid, signal.SIGSTOP)
        try:
            # One part's failure: every watch reads its prefix again, on a new client, and those
            # reads wait on the stopped etcd; a plain call waits beside them.
            connects = session.connects
            await session.reset()
            assert await poll(
                lambda: session.connects > connects and not any(w.synced.is_set() for w in watches.values()), 15
            )
            call = asyncio.create_task(session.get(f"{prefix}x".encode()))
            await asyncio.sleep(0.2)  # the loop starts the calls; each then waits on etcd
            assert not call.done()
            # Another part's failure drops that client with every call still on it.
            await session.reset()
            with pytest.raises(EtcdCallCut):
                await call
        finally:
            os.kill(pid, signal.SIGCONT)

        assert await poll(lambda: all(w.synced.is_set() for w in watches.values()), 20), "a watch ended for good"
        for name in seen:
            await in_etcd_of(config, lambda c, name=name: c.put(f"{prefix}{name}/k".encode(), b"v"))
        assert await poll(lambda: all(seen[name] == [f"{prefix}{name}/k".encode()] for name in seen), 15)
    finally:
        await session.close()
