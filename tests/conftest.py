"""Shared fixtures: the tiny model, and real etcd/Redis/Redis Cluster/Kafka broker processes.

Servers are started once per test session on free loopback ports, with state in a
temporary folder, and their process groups are killed at teardown.
"""

from __future__ import annotations

import pytest
import pytest_asyncio

from ballast.v1 import inference_pb2_grpc
from services.cli.client import open_channel
from services.cli.localservers import EtcdServer, KafkaBroker, RedisServer
from tests.model_fixtures import bench_model_dir, tiny_model_dir  # noqa: F401  (re-exported fixtures)

pytest_plugins = ["tests.hang_report"]


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture
def restartable_etcd(tmp_path):
    """An etcd of the test's own, to stop and start again (the session's `etcd_server` serves
    every other test)."""
    server = EtcdServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A Redis Cluster of three masters (no replicas: tests of failover start their own)."""
    from services.cli.redis_cluster import LocalRedisCluster

    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"), masters=3, replicas_per_master=0).start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    server = KafkaBroker(tmp_path_factory.mktemp("kafka")).start()
    yield server
    server.stop()


@pytest_asyncio.fixture(loop_scope="session")
async def router(mesh):
    """A public-API stub on the router of the module's `mesh` (a local mesh of processes)."""
    async with open_channel(mesh.router_address) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)
