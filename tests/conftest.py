"""Shared fixtures: the tiny model, and real etcd/Redis/Kafka broker processes.

Servers are started once per test session on free loopback ports, with state in a
temporary folder, and their process groups are killed at teardown.
"""

from __future__ import annotations

import pytest

from services.common.localservers import EtcdServer, KafkaBroker, RedisServer
from tests.model_fixtures import bench_model_dir, tiny_model_dir  # noqa: F401  (re-exported fixtures)

pytest_plugins = ["tests.hang_report"]


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    server = EtcdServer(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    server = KafkaBroker(tmp_path_factory.mktemp("kafka")).start()
    yield server
    server.stop()
