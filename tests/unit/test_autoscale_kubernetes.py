"""The Kubernetes executor against a recorded API: the kubernetes client's own request and
response handling runs; only urllib3's pool manager is replaced by a replay of JSON exchanges
(tests/fixtures/kubernetes), which checks each request's method, path, content type and body."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import urllib3

from kubernetes import client as k8s  # the `kubernetes` extra, part of `dev`

from services.common.config import ConfigError, EtcdConfig
from services.common.membership import WorkerRecord
from services.router.autoscale.decision import Action, PoolSignals, Replicas, ScaleDecision
from services.router.autoscale.kubernetes_executor import KubernetesExecutor
from services.router.autoscale.settings import AutoscalerKubernetesConfig

FIXTURES = json.loads((Path(__file__).parents[1] / "fixtures" / "kubernetes" / "deployment_scale.json").read_text())
HOST = "https://kubernetes.test"


class ReplayPoolManager:
    """Answers the client's HTTP calls from recorded exchanges, in order, checking each request."""

    def __init__(self, exchanges: list[dict]) -> None:
        self.exchanges = list(exchanges)
        self.seen: list[dict] = []

    def request(self, method, url, body=None, headers=None, **_kwargs):
        assert self.exchanges, f"unexpected request {method} {url}"
        recorded = self.exchanges.pop(0)
        want = recorded["request"]
        sent = {"method": method, "path": url.removeprefix(HOST)}
        if "content_type" in want:
            sent["content_type"] = (headers or {}).get("Content-Type")
        if "body" in want:
            sent["body"] = json.loads(body)
        self.seen.append(sent)
        assert sent == want
        answer = recorded["response"]
        return urllib3.HTTPResponse(
            body=io.BytesIO(json.dumps(answer["body"]).encode()),
            status=answer["status"],
            reason="OK" if answer["status"] == 200 else "Forbidden",
            headers={"Content-Type": "application/json"},
            preload_content=False,
        )


def apps_api(exchanges: list[dict]) -> tuple[k8s.AppsV1Api, ReplayPoolManager]:
    api_client = k8s.ApiClient(k8s.Configuration(host=HOST))
    replay = ReplayPoolManager(exchanges)
    api_client.rest_client.pool_manager = replay
    return k8s.AppsV1Api(api_client), replay


SETTINGS = AutoscalerKubernetesConfig(namespace="ballast", deployments={"primary": "ballast-worker"})
SIGNALS = PoolSignals(None, None, 0, None, None, 0.0, None)


def worker(worker_id: str, started_at: float) -> WorkerRecord:
    return WorkerRecord(id=worker_id, address="10.0.0.1:50071", model="tiny", model_version="v1", started_at=started_at)


def decision(serving: int, current: Replicas, action: Action) -> ScaleDecision:
    return ScaleDecision("primary", 0.0, action, serving, 0, 0, current, "test", SIGNALS)


async def test_scale_out_then_in_patches_the_scale_subresource_with_the_exact_body():
    api, replay = apps_api(FIXTURES["scale_out_then_in"])
    executor = KubernetesExecutor(EtcdConfig(), SETTINGS, ["primary"], api=api)
    workers = {w.id: w for w in (worker("w1", 1.0), worker("w2", 2.0))}

    members = await executor.members("primary", workers)
    assert members.replicas() == Replicas(2)
    await executor.apply(decision(3, members.replicas(), Action.SCALE_OUT), members)
    assert executor.spec_replicas["primary"] == 3

    # The third pod has not registered yet: it counts as starting, and nothing is patched again.
    members = await executor.members("primary", workers)
    assert members.starting_serving == 1 and members.replicas() == Replicas(3)
    await executor.apply(decision(3, members.replicas(), Action.HOLD), members)

    workers["w3"] = worker("w3", 3.0)
    members = await executor.members("primary", workers)
    assert members.starting_serving == 0 and members.replicas() == Replicas(3)
    await executor.apply(decision(2, members.replicas(), Action.SCALE_IN), members)
    assert executor.spec_replicas["primary"] == 2
    assert replay.exchanges == [], "not every recorded exchange was made"
    assert [s["method"] for s in replay.seen] == ["GET", "PATCH", "GET", "GET", "PATCH"]


async def test_a_forbidden_scale_read_surfaces_as_the_api_error():
    api, _replay = apps_api(FIXTURES["forbidden"])
    executor = KubernetesExecutor(EtcdConfig(), SETTINGS, ["primary"], api=api)
    with pytest.raises(k8s.ApiException) as raised:
        await executor.members("primary", {})
    assert raised.value.status == 403
    assert "deployments/scale" in raised.value.body


def test_a_pool_without_a_deployment_fails_at_start_naming_the_field():
    api, _ = apps_api([])
    with pytest.raises(ConfigError, match=r"autoscaler\.kubernetes\.deployments\.light"):
        KubernetesExecutor(EtcdConfig(), SETTINGS, ["primary", "light"], api=api)
