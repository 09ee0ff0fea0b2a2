"""The quarantine through a real etcd: one router's entry reaches another router's store (and
a backfill's) under a lease, `etcdctl del` lifts it everywhere, and a router without etcd
still quarantines and refuses from its own copy."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from services.common.config import EtcdConfig
from services.common.errors import Quarantined
from services.common.generation import Sampling
from services.common.membership import make_client
from services.common.quarantine import QuarantineStore, quarantine_key, request_fingerprint
from services.common.quarantine_etcd import QuarantineWatch
from services.common.processes import free_ports
from services.router.requests import InferenceRequest, Message
from services.router.resilience.quarantine import QuarantineConfig, RouterQuarantine

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def etcd_config(etcd_server):
    return EtcdConfig(host=etcd_server.host, port=etcd_server.port, prefix=f"/quarantine-{uuid.uuid4().hex[:8]}/")


def poison(request_id: str) -> InferenceRequest:
    return InferenceRequest(
        request_id=request_id,
        session_id="",
        tenant="acme",
        model="tiny",
        sampling=Sampling(max_tokens=4),
        tier="A",
        messages=(Message("user", "boom"),),
    )


async def until(predicate, timeout: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_an_entry_reaches_the_other_routers_under_a_lease_and_a_delete_lifts_it(etcd_config):
    config = QuarantineConfig(ttl_s=30)
    first, second = RouterQuarantine(config, etcd_config), RouterQuarantine(config, etcd_config)
    backfill = QuarantineWatch(etcd_config, QuarantineStore())
    for part in (first, second, backfill):
        await part.start()
    try:
        await asyncio.wait_for(second.watch.synced.wait(), 10)
        first.worker_lost(poison("a"), "worker_lost", "w1")
        with pytest.raises(Quarantined):
            first.worker_lost(poison("a"), "worker_lost", "w2")
        fp = request_fingerprint(poison("a"))
        assert await until(lambda: second.store.get(fp) is not None and backfill.store.get(fp) is not None)
        with pytest.raises(Quarantined):
            second.check(poison("b"))  # the other router refuses it without ever having run it

        client = make_client(etcd_config)
        await client.connect()
        try:
            value = await client.get(quarantine_key(etcd_config.prefix, fp).encode())
            assert value is not None and b"boom" not in value.value and value.lease
            await client.delete(quarantine_key(etcd_config.prefix, fp).encode())
        finally:
            await client.close()
        assert await until(lambda: second.store.get(fp) is None and backfill.store.get(fp) is None)
        second.check(poison("c"))
    finally:
        for part in (first, second):
            await part.stop()
        await backfill.stop()


async def test_without_etcd_the_router_quarantines_from_its_own_copy():
    (port,) = free_ports(1)
    away = EtcdConfig(host="127.0.0.1", port=port, prefix="/nowhere/", timeout_s=0.5, reconnect_backoff_s=0.2)
    quarantine = RouterQuarantine(QuarantineConfig(max_workers_lost=1), away)
    await quarantine.start()
    try:
        with pytest.raises(Quarantined):
            quarantine.worker_lost(poison("a"), "stalled", "w1")
        with pytest.raises(Quarantined):
            quarantine.check(poison("b"))
        assert quarantine.publisher.published == 0  # waits for etcd, bounded, without blocking anyone
    finally:
        await asyncio.wait_for(quarantine.stop(), 5)
