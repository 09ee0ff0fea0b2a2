"""etcd as a cluster: endpoints validated, and each new client starting at the next member."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.common.config import EtcdConfig
from services.common.etcd_client import EtcdClient, make_client, member_order


def test_endpoints_replace_host_and_port():
    assert EtcdConfig(host="etcd", port=2379).members == ["etcd:2379"]
    config = EtcdConfig(endpoints=["10.0.0.1:2379", "etcd-1.etcd:2379", "[::1]:2379"])
    assert config.members == ["10.0.0.1:2379", "etcd-1.etcd:2379", "[::1]:2379"]
    assert config.display == "10.0.0.1:2379,etcd-1.etcd:2379,[::1]:2379"


@pytest.mark.parametrize("bad", ["etcd", "etcd:", ":2379", "etcd:http", "etcd:0", "etcd:70000"])
def test_an_endpoint_without_host_and_port_is_refused(bad):
    with pytest.raises(ValidationError, match="host:port"):
        EtcdConfig(endpoints=["etcd:2379", bad])


def test_each_new_client_starts_at_the_next_member():
    members = ["a:1", "b:2", "c:3"]
    orders = [member_order(members) for _ in range(4)]
    assert orders == [["a:1", "b:2", "c:3"], ["b:2", "c:3", "a:1"], ["c:3", "a:1", "b:2"], ["a:1", "b:2", "c:3"]]


def test_make_client_knows_every_member():
    client = make_client(EtcdConfig(endpoints=["a:1", "b:2"], timeout_s=0.2))
    assert isinstance(client, EtcdClient)
    assert client._members == ["a:1", "b:2"] and client._timeout == 1
