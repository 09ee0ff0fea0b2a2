"""What `ballast up --clusters --routers N` asks of the local mesh: the services pointed at
every etcd member and at a Redis Cluster, the extra routers' ports, and the combinations it
refuses."""

from __future__ import annotations

import pytest

from services.cli.mesh import Mesh, MeshSpec
from services.common.config import EtcdConfig, RedisConfig


def spec(tmp_path, **changes) -> MeshSpec:
    return MeshSpec(state_dir=tmp_path, model_dir=tmp_path / "model", **changes)


def test_on_clusters_the_services_get_every_etcd_member_and_a_cluster_client(tmp_path):
    mesh = Mesh(spec(tmp_path, etcd_cluster=True, redis_cluster=True))
    config = mesh.config_dict()
    etcd = EtcdConfig(**config["etcd"])
    assert etcd.members == mesh.etcd.endpoints and len(etcd.members) == 3
    redis = RedisConfig(**config["redis"])
    assert redis.cluster and redis.wait_replicas == 1
    # Every process of both clusters is recorded (so `ballast down` stops them).
    assert len([part for infra in mesh.infra for part in infra.parts()]) == 3 + 6 + 1


def test_on_single_servers_nothing_changes(tmp_path):
    config = Mesh(spec(tmp_path)).config_dict()
    assert "endpoints" not in config["etcd"]
    assert not RedisConfig(**config["redis"]).cluster


def test_extra_routers_take_the_ports_after_the_first(tmp_path):
    assert Mesh(spec(tmp_path, routers=3, router_port=50051))._extra_router_ports() == [50052, 50053]
    assert Mesh(spec(tmp_path, routers=2))._extra_router_ports() == [None]  # free ones, picked at start
    assert Mesh(spec(tmp_path))._extra_router_ports() == []


@pytest.mark.parametrize(
    "changes", [dict(secure=True, redis_cluster=True), dict(secure=True, etcd_cluster=True), dict(routers=0)]
)
def test_combinations_the_local_mesh_cannot_run_are_refused(tmp_path, changes):
    with pytest.raises(ValueError):
        Mesh(spec(tmp_path, **changes))
