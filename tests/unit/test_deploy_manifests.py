"""Offline checks of deploy/: Kustomize overlays, images, Grafana dashboard and alert rules.

The overlays are rendered by a small pure-Python renderer of the Kustomize features deploy/k8s
uses (resources, namespace, labels/commonLabels, images, configMapGenerator, strategic-merge
patches); where kubectl is installed, its built-in kustomize renders the same trees and both
must agree. Built-in kinds are validated against the Kubernetes JSON schemas shipped inside
kubernetes-validate; custom resources (Prometheus Operator, Strimzi) get their required fields
checked here. PromQL is parsed with promql-parser; every metric a dashboard panel or an alert
uses must be one the services export (names read from their source, rendered by the real
Prometheus exporter). Nothing here touches the network.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
promql_parser = pytest.importorskip("promql_parser")

from services.config import BallastConfig, load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = {
    "local-cpu": K8S / "overlays" / "local-cpu",
    "production-gpu": K8S / "overlays" / "production-gpu",
}
DEPENDENCIES = {
    "kafka": K8S / "dependencies" / "kafka",
    "kafka-local": K8S / "dependencies" / "kafka-local",
}
# The oldest Kubernetes the manifests promise to run on: gRPC probes are GA from 1.27,
# unhealthyPodEvictionPolicy from 1.27 (beta) and 1.31 (GA); 1.30 is a common floor.
KUBERNETES_VERSION = "1.30"
CUSTOM_GROUPS = {"monitoring.coreos.com", "kafka.strimzi.io", "cert-manager.io"}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}

EXISTING_METRICS = {
    "ballast_router_requests_total",
    "ballast_router_ttft_milliseconds_bucket",
    "ballast_router_e2e_milliseconds_bucket",
    "ballast_router_streamed_tokens_total",
    "ballast_router_in_flight",
    "ballast_worker_requests_total",
    "ballast_worker_generated_tokens_total",
    "ballast_worker_in_flight",
    "ballast_worker_queued",
    "ballast_worker_kv_used_ratio",
    "ballast_dependency_up",
}
# Calls that create a metric instrument (OpenTelemetry's, and Telemetry's latency helper).
INSTRUMENT_FACTORIES = {
    "create_counter",
    "create_up_down_counter",
    "create_histogram",
    "create_gauge",
    "create_observable_counter",
    "create_observable_up_down_counter",
    "create_observable_gauge",
    "latency_histogram",
}


def declared_instruments() -> list[tuple[str, str, str]]:
    """(factory, name, unit) of every instrument created anywhere under services/."""
    found, dynamic = [], set()
    for path in sorted((REPO / "services").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in INSTRUMENT_FACTORIES
            ):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            name = node.args[0] if node.args else keywords.get("name")
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                dynamic.add(path.relative_to(REPO).as_posix())
                continue
            unit = keywords.get("unit")
            unit = (
                unit.value
                if isinstance(unit, ast.Constant)
                else ("ms" if node.func.attr == "latency_histogram" else "")
            )
            found.append((node.func.attr, name.value, unit))
    # Only the latency helper itself passes a name through; anything else could not be checked.
    assert dynamic == {"services/common/telemetry.py"}, dynamic
    return found


@functools.cache
def exported_metric_names() -> frozenset[str]:
    """The series names the services' instruments produce, as the real exporter writes them."""
    from opentelemetry.metrics import Observation

    from services.common.config import TelemetryConfig
    from services.common.telemetry import Telemetry

    telemetry = Telemetry("deploy-check", TelemetryConfig(enabled=False))
    try:
        for factory, name, unit in declared_instruments():
            if factory == "latency_histogram":
                telemetry.latency_histogram(name, "").record(1.0)
            elif factory.startswith("create_observable"):
                getattr(telemetry.meter, factory)(name, callbacks=[lambda _options: [Observation(1)]], unit=unit)
            else:
                instrument = getattr(telemetry.meter, factory)(name, unit=unit)
                (getattr(instrument, "add", None) or getattr(instrument, "record", None) or instrument.set)(1)
        return frozenset(_series_names(telemetry.render()))
    finally:
        telemetry.stop()


def _series_names(text: str) -> set[str]:
    return {
        re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


# ---------------------------------------------------------------------------------------------
# A Kustomize renderer for the subset deploy/k8s uses. Anything outside the subset is an error,
# so a manifest change that needs more is noticed here rather than silently mis-rendered.

SUPPORTED_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "labels",
    "commonLabels",
    "images",
    "configMapGenerator",
    "patches",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "IngressClass",
    "RuntimeClass",
}
# Strategic-merge keys of the Kubernetes lists the patches touch; other lists are replaced.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


class KustomizeError(Exception):
    pass


def _load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _configmap_hash(data: dict[str, str]) -> str:
    # Kustomize hashes {"data", "kind", "name"} as Go's json.Marshal writes it (sorted keys,
    # HTML characters escaped); its name lookup yields "" for generated maps.
    encoded = json.dumps(
        {"data": data, "kind": "ConfigMap", "name": ""},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    for char, escaped in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        encoded = encoded.replace(char, escaped)
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _merge(original: Any, patch: Any, field: str = "", builtin: bool = True) -> Any:
    """Strategic merge; custom resources have no schema here, so their lists are replaced."""
    if isinstance(original, dict) and isinstance(patch, dict):
        if "$patch" in patch:
            raise KustomizeError("$patch directives are not supported by this renderer")
        merged = dict(original)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = _merge(merged[key], value, key, builtin)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(original, list) and isinstance(patch, list) and builtin and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        by_key = {item[key]: item for item in original}
        patched_keys = {item[key] for item in patch}
        # Kustomize's order: the patch's items first (merged where they exist), then the rest.
        result = [
            _merge(by_key[item[key]], item, builtin=True) if item[key] in by_key else copy.deepcopy(item)
            for item in patch
        ]
        return result + [item for item in original if item[key] not in patched_keys]
    return copy.deepcopy(patch)


def _pod_specs(obj: dict) -> Iterator[dict]:
    if obj["kind"] in POD_TEMPLATE_KINDS:
        yield obj["spec"]["template"]["spec"]
    elif obj["kind"] == "Pod":
        yield obj["spec"]


def _containers(pod_spec: dict) -> Iterator[dict]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec.get("containers", [])


def _split_image(image: str) -> tuple[str, str, str]:
    name, _, digest = image.partition("@")
    last = name.rsplit("/", 1)[-1]
    tag = ""
    if ":" in last:
        name, tag = name.rsplit(":", 1)
    return name, tag, digest


def _set_labels(obj: dict, pairs: dict, selectors: bool, templates: bool) -> None:
    obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    kind, spec = obj["kind"], obj.get("spec", {})
    if kind in POD_TEMPLATE_KINDS and (selectors or templates):
        spec.setdefault("template", {}).setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
    if not selectors:
        return
    if kind == "Service":
        spec.setdefault("selector", {}).update(pairs)
    elif kind in POD_TEMPLATE_KINDS:
        spec.setdefault("selector", {}).setdefault("matchLabels", {}).update(pairs)
        for constraint in spec["template"]["spec"].get("topologySpreadConstraints", []):
            match = constraint.get("labelSelector", {}).get("matchLabels")
            if match is not None:
                match.update(pairs)
        if spec["template"]["spec"].get("affinity"):
            raise KustomizeError("label selectors in affinity are not supported by this renderer")
    elif kind == "PodDisruptionBudget":
        match = spec.get("selector", {}).get("matchLabels")
        if match is not None:
            match.update(pairs)


def kustomize(root: Path, _stack: tuple[Path, ...] = ()) -> list[dict]:
    """Renders the kustomization in `root` the way `kustomize build` does, for our subset."""
    root = root.resolve()
    for seen in _stack:
        if seen == root or seen.is_relative_to(root):
            raise KustomizeError(f"cycle: {root} contains {seen}")
    spec = yaml.safe_load((root / "kustomization.yaml").read_text())
    unsupported = set(spec) - SUPPORTED_FIELDS
    if unsupported:
        raise KustomizeError(f"{root}: unsupported fields {sorted(unsupported)}")

    objects: list[dict] = []
    for entry in spec.get("resources", []):
        path = (root / entry).resolve()
        if path.is_dir():
            objects += kustomize(path, _stack + (root,))
        elif path.is_relative_to(root):
            objects += _load_docs(path)
        else:
            raise KustomizeError(f"{root}: file {entry} is outside the kustomization root")

    renamed: dict[str, str] = {}
    for generator in spec.get("configMapGenerator", []):
        if set(generator) - {"name", "files", "literals"}:
            raise KustomizeError(f"unsupported configMapGenerator options in {generator}")
        data: dict[str, str] = {}
        for item in generator.get("files", []):
            key, _, source = item.rpartition("=")
            data[key or PurePosixPath(source).name] = (root / source).read_text()
        for item in generator.get("literals", []):
            key, _, value = item.partition("=")
            data[key] = value
        name = f"{generator['name']}-{_configmap_hash(data)}"
        renamed[generator["name"]] = name
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data})

    for patch_entry in spec.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise KustomizeError(f"only path patches are supported, got {patch_entry}")
        for patch in _load_docs(root / patch_entry["path"]):
            matches = [
                i
                for i, obj in enumerate(objects)
                if obj["kind"] == patch["kind"] and obj["metadata"]["name"] == patch["metadata"]["name"]
            ]
            if len(matches) != 1:
                target = f"{patch['kind']}/{patch['metadata']['name']}"
                raise KustomizeError(f"patch {target} matches {len(matches)} objects")
            builtin = patch["apiVersion"].rpartition("/")[0] not in CUSTOM_GROUPS
            objects[matches[0]] = _merge(objects[matches[0]], patch, builtin=builtin)

    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    label_sets = [
        (entry["pairs"], entry.get("includeSelectors", False), entry.get("includeTemplates", False))
        for entry in spec.get("labels", [])
    ]
    if spec.get("commonLabels"):
        label_sets.append((spec["commonLabels"], True, True))
    for pairs, selectors, templates in label_sets:
        for obj in objects:
            _set_labels(obj, pairs, selectors, templates)
    for image in spec.get("images", []):
        for obj in objects:
            for pod in _pod_specs(obj):
                for container in _containers(pod):
                    name, tag, digest = _split_image(container["image"])
                    if name != image["name"]:
                        continue
                    name = image.get("newName", name)
                    tag = image.get("newTag", tag)
                    digest = image.get("digest", digest)
                    # With a digest kustomize drops the tag: the digest alone names the image.
                    container["image"] = f"{name}@{digest}" if digest else (f"{name}:{tag}" if tag else name)
    for obj in objects:
        for pod in _pod_specs(obj):
            refs = [v["configMap"] for v in pod.get("volumes", []) if "configMap" in v]
            for container in _containers(pod):
                refs += [
                    e["valueFrom"]["configMapKeyRef"]
                    for e in container.get("env", [])
                    if "configMapKeyRef" in e.get("valueFrom", {})
                ]
                refs += [s["configMapRef"] for s in container.get("envFrom", []) if "configMapRef" in s]
            for ref in refs:
                ref["name"] = renamed.get(ref["name"], ref["name"])
    return objects


def _key(obj: dict) -> tuple[str, str, str, str]:
    meta = obj["metadata"]
    return obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"]


@functools.cache
def _render_once(root: Path) -> list[dict]:
    return kustomize(root)


def rendered(root: Path) -> list[dict]:
    """The rendered tree; a fresh copy each time, so a test may modify what it gets."""
    return copy.deepcopy(_render_once(root))


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def one_list(items: list[dict]) -> dict:
    assert len(items) == 1, f"expected one item, found {len(items)}"
    return items[0]


def kinds(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def overlay_config(objects: list[dict]) -> BallastConfig:
    configmap = one(objects, "ConfigMap")
    return load_config_text(configmap["data"]["ballast.yaml"])


def load_config_text(text: str, environ: dict[str, str] | None = None) -> BallastConfig:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as handle:
        handle.write(text)
        handle.flush()
        return load_config(handle.name, environ=environ or {})


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def all_roots() -> dict[str, Path]:
    return {**OVERLAYS, **DEPENDENCIES}


# ---------------------------------------------------------------------------------------------
# Rendering


@pytest.mark.parametrize("name", sorted(all_roots()))
def test_renderer_agrees_with_kubectl_kustomize(name):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed; the pure-Python render is checked by the other tests")
    root = all_roots()[name]
    result = subprocess.run([kubectl, "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    expected = {_key(o): o for o in yaml.safe_load_all(result.stdout) if o}
    ours = {_key(o): o for o in rendered(root)}
    assert sorted(ours) == sorted(expected)
    for key, obj in expected.items():
        assert ours[key] == obj, f"{key} differs from kubectl kustomize"


def test_renderer_rejects_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("namePrefix: x-\n")
    with pytest.raises(KustomizeError, match="unsupported"):
        kustomize(tmp_path)
    child = tmp_path / "child"
    child.mkdir()
    (tmp_path / "kustomization.yaml").write_text("resources: [child]\n")
    (child / "kustomization.yaml").write_text("resources: ['..']\n")
    with pytest.raises(KustomizeError, match="cycle"):
        kustomize(tmp_path)


def test_configmap_hash_matches_kustomize():
    # Values kustomize itself prints for these generators (kustomize v5).
    assert _configmap_hash({"a": "b"}) == "4h2mbtbbt6"
    assert _configmap_hash({"one": ""}) == "9g67k2htb6"


# ---------------------------------------------------------------------------------------------
# Schemas


@pytest.mark.parametrize("name", sorted(all_roots()))
def test_builtin_objects_match_kubernetes_schemas(name):
    checked = 0
    for obj in rendered(all_roots()[name]):
        group = obj["apiVersion"].rpartition("/")[0]
        if group in CUSTOM_GROUPS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
        checked += 1
    assert checked > 0


def test_schema_validation_is_strict():
    deployment = one(rendered(OVERLAYS["local-cpu"]), "Deployment", "ballast-router")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _require(obj: dict, *paths: str) -> None:
    for path in paths:
        node: Any = obj
        for part in path.split("."):
            assert isinstance(node, dict) and part in node, f"{obj['kind']}/{obj['metadata']['name']} lacks {path}"
            node = node[part]
        assert node not in (None, "", [], {}), f"{obj['kind']}/{obj['metadata']['name']}: empty {path}"


def test_service_monitor_scrapes_every_ballast_service():
    objects = rendered(OVERLAYS["production-gpu"])
    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    _require(monitor, "spec.selector.matchLabels", "spec.endpoints")
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert all(e.get("path", "/metrics") == "/metrics" for e in monitor["spec"]["endpoints"])
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in kinds(objects, "Service") if selects(selector, s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in scraped} == {
        "ballast-router",
        "ballast-worker",
        "ballast-cache",
        "ballast-backfill",
    }
    for service in scraped:
        assert endpoint_ports <= {p["name"] for p in service["spec"]["ports"]}


def test_prometheus_rule_is_in_the_production_overlay():
    rule = one(rendered(OVERLAYS["production-gpu"]), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "ballast"
    _require(rule, "spec.groups")


# ---------------------------------------------------------------------------------------------
# Workload invariants


def _workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in POD_TEMPLATE_KINDS]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_container_has_grpc_probes_limits_and_runs_as_non_root(overlay):
    for workload in _workloads(rendered(OVERLAYS[overlay])):
        pod = workload["spec"]["template"]["spec"]
        where = workload["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        assert pod.get("automountServiceAccountToken") is False, where
        for container in pod["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                assert "grpc" in container.get(probe, {}), f"{where}/{container['name']}: {probe} is not gRPC"
        for container in _containers(pod):
            name = f"{where}/{container['name']}"
            limits = container.get("resources", {}).get("limits", {})
            requests = container.get("resources", {}).get("requests", {})
            assert {"cpu", "memory"} <= set(limits), f"{name}: limits {limits}"
            assert {"cpu", "memory"} <= set(requests), f"{name}: requests {requests}"
            security = container["securityContext"]
            assert security.get("runAsNonRoot", pod["securityContext"]["runAsNonRoot"]) is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert not security["capabilities"].get("add"), name


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_probe_and_service_ports_match_the_config(overlay):
    objects = rendered(OVERLAYS[overlay])
    config = overlay_config(objects)
    ports = {
        "ballast-router": config.router.port,
        "ballast-worker": config.worker.port,
        "ballast-cache": config.cache.port,
        "ballast-backfill": config.backfill.port,
    }
    assert 0 not in ports.values(), "Kubernetes probes need fixed ports"
    for name, port in ports.items():
        pod = one(objects, "Deployment", name)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container_ports == {"grpc": port, "metrics": config.telemetry.metrics_port}
        # Under TLS the kubelet probes the plaintext health port (its gRPC probes cannot speak TLS).
        probe_port = config.tls.health_port if config.tls.enabled else port
        assert probe_port not in (None, 0), f"{name}: TLS on without a fixed tls.health_port"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == probe_port, f"{name} {probe}"
        service = one(objects, "Service", name)
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == container_ports
        assert all(p["targetPort"] in container_ports for p in service["spec"]["ports"])
    # Inside a pod the servers must listen on every interface, not loopback.
    for host in (
        config.router.host,
        config.worker.host,
        config.cache.host,
        config.backfill.host,
        config.telemetry.metrics_host,
    ):
        assert host in {"0.0.0.0", "::", "[::]"}


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_services_select_exactly_their_pods(overlay):
    objects = rendered(OVERLAYS[overlay])
    workloads = _workloads(objects)
    for service in kinds(objects, "Service"):
        chosen = [
            w["metadata"]["name"]
            for w in workloads
            if selects(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        assert chosen == [service["metadata"]["name"]]
    for workload in workloads:
        assert selects(workload["spec"]["selector"]["matchLabels"], workload["spec"]["template"]["metadata"]["labels"])


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_worker_grace_period_covers_prestop_and_drain(overlay):
    objects = rendered(OVERLAYS[overlay])
    config = overlay_config(objects)
    pod = one(objects, "Deployment", "ballast-worker")["spec"]["template"]["spec"]
    worker = one_list(pod["containers"])
    command = worker["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert pod["terminationGracePeriodSeconds"] >= config.worker.drain_grace_s + 5
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + config.worker.drain_grace_s + 5
    router = one(objects, "Deployment", "ballast-router")["spec"]["template"]["spec"]
    router_pre_stop = float(router["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert router["terminationGracePeriodSeconds"] >= router_pre_stop + config.router.shutdown_grace_s + 5


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_deployment_is_covered_by_one_pdb(overlay):
    objects = rendered(OVERLAYS[overlay])
    budgets = kinds(objects, "PodDisruptionBudget")
    for workload in _workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if selects(b["spec"]["selector"]["matchLabels"], labels)]
        assert len(covering) == 1, f"{workload['metadata']['name']}: {len(covering)} PDBs"
        budget = covering[0]["spec"]
        # A budget that allows no disruption at all would block every node drain.
        replicas = workload["spec"].get("replicas", 1)
        assert budget.get("maxUnavailable", 0) >= 1 or budget.get("minAvailable", 1) < replicas


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_hpa_scales_the_worker_on_desired_replicas(overlay):
    objects = rendered(OVERLAYS[overlay])
    config = overlay_config(objects)
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "ballast-worker"}
    worker = one(objects, "Deployment", "ballast-worker")
    assert worker["spec"]["template"]["metadata"]["labels"]["ballast.dev/pool"] == config.worker.pool
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]
    metric = one_list(spec["metrics"])
    assert metric["type"] in {"External", "Pods"}
    source = metric[metric["type"].lower()]
    assert source["metric"]["name"] == "ballast_desired_replicas"
    assert source["metric"]["selector"]["matchLabels"] == {"pool": config.worker.pool}
    # averageValue 1: the HPA's replica count is the exported number itself.
    assert source["target"] == {"type": "AverageValue", "averageValue": "1"}


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_config_comes_from_the_configmap_and_keys_from_a_secret(overlay):
    objects = rendered(OVERLAYS[overlay])
    configmap = one(objects, "ConfigMap")
    assert configmap["metadata"]["name"].startswith("ballast-config-")
    for workload in _workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            path = PurePosixPath(env["BALLAST_CONFIG"]["value"])
            mount = one_list([m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)])
            assert mount.get("readOnly") is True
            assert volumes[mount["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
            assert path.name in configmap["data"]
    router = one(objects, "Deployment", "ballast-router")["spec"]["template"]["spec"]["containers"][0]
    api_keys = {e["name"]: e for e in router["env"]}["BALLAST__AUTH__API_KEYS"]
    ref = api_keys["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional"), "the router must not start without its API keys"
    assert "api_keys" not in (yaml.safe_load(configmap["data"]["ballast.yaml"]).get("auth") or {})
    secrets = {s["metadata"]["name"]: s for s in kinds(objects, "Secret")}
    if overlay == "local-cpu":
        keys = json.loads(secrets[ref["name"]]["stringData"][ref["key"]])
        config = load_config_text(configmap["data"]["ballast.yaml"], {"BALLAST__AUTH__API_KEYS": json.dumps(keys)})
        assert config.auth.enabled and config.auth.api_keys
    else:
        assert not secrets, "production keys are created out of band, never shipped"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_configmap_holds_a_valid_ballast_config(overlay):
    objects = rendered(OVERLAYS[overlay])
    config = overlay_config(objects)
    assert config.telemetry.enabled and config.telemetry.metrics_port > 0
    assert config.etcd.host.endswith(".svc.cluster.local")
    assert ".svc.cluster.local:" in config.redis.url and ".svc.cluster.local:" in config.kafka.bootstrap
    # The pod's env overrides (worker id, advertised address) still validate.
    worker_env = {"BALLAST__WORKER__ID": "ballast-worker-5f9c7d-x2x7q", "BALLAST__WORKER__ADVERTISE_HOST": "10.12.0.7"}
    worker_config = load_config_text(one(objects, "ConfigMap")["data"]["ballast.yaml"], worker_env)
    assert worker_config.worker.advertise_host == "10.12.0.7"
    pod = one(objects, "Deployment", "ballast-worker")["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    mounts = [PurePosixPath(m["mountPath"]) for m in worker["volumeMounts"]]
    model_dir = PurePosixPath(config.worker.model_dir)
    assert model_dir.is_absolute() and any(model_dir.is_relative_to(m) for m in mounts), "model_dir must be on a volume"


def test_overlay_specifics():
    local = rendered(OVERLAYS["local-cpu"])
    production = rendered(OVERLAYS["production-gpu"])
    local_config, production_config = overlay_config(local), overlay_config(production)
    assert local_config.worker.engine == "torch" and local_config.worker.device == "cpu"
    assert production_config.worker.engine == "vllm"

    local_worker = one(local, "Deployment", "ballast-worker")["spec"]["template"]["spec"]
    assert local_worker["containers"][0]["image"].startswith("ballast/worker-cpu:")
    assert "nvidia.com/gpu" not in json.dumps(local_worker)
    build = one_list(local_worker["initContainers"])
    assert build["command"][:3] == ["ballast", "model", "build-tiny"]
    assert PurePosixPath(build["command"][3]) == PurePosixPath(local_config.worker.model_dir)

    gpu_worker = one(production, "Deployment", "ballast-worker")["spec"]["template"]["spec"]
    container = gpu_worker["containers"][0]
    assert container["image"].rsplit("/", 1)[-1].startswith("worker-gpu:")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in gpu_worker["tolerations"])
    volumes = {v["name"]: v for v in gpu_worker["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
    assert one(production, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadOnlyMany"]

    for objects in (local, production):
        for workload in _workloads(objects):
            for container in _containers(workload["spec"]["template"]["spec"]):
                name, tag, digest = _split_image(container["image"])
                assert tag or digest, f"{container['image']} is not pinned"
                assert tag != "latest"
        namespace = one(objects, "Namespace")
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
        assert namespaces == {namespace["metadata"]["name"]}


# ---------------------------------------------------------------------------------------------
# Dependencies


def test_kafka_cluster_and_topics():
    for name, root in DEPENDENCIES.items():
        objects = rendered(root)
        kafka = one(objects, "Kafka")
        _require(kafka, "spec.kafka.listeners", "spec.entityOperator")
        # KafkaTopic objects only take effect with the Topic Operator running.
        assert "topicOperator" in kafka["spec"]["entityOperator"]
        pools = kinds(objects, "KafkaNodePool")
        assert pools
        brokers = 0
        for pool in pools:
            _require(pool, "spec.replicas", "spec.roles", "spec.storage.type")
            assert pool["metadata"]["labels"]["strimzi.io/cluster"] == kafka["metadata"]["name"]
            if "broker" in pool["spec"]["roles"]:
                brokers += pool["spec"]["replicas"]
        config = kafka["spec"]["kafka"]["config"]
        assert config["default.replication.factor"] <= brokers
        assert config["min.insync.replicas"] <= config["default.replication.factor"]
        topics = kinds(objects, "KafkaTopic")
        assert {t["spec"]["topicName"] for t in topics} == {
            "ballast.degraded.v1",
            "ballast.backfilled.v1",
            "ballast.degraded.dlq.v1",
        }, name
        for topic in topics:
            _require(topic, "spec.partitions", "spec.replicas")
            assert topic["metadata"]["labels"]["strimzi.io/cluster"] == kafka["metadata"]["name"]
            assert topic["spec"]["replicas"] <= brokers
            assert int(topic["spec"]["config"]["min.insync.replicas"]) <= topic["spec"]["replicas"]


def test_overlays_point_at_the_dependencies():
    deps = {name: rendered(root) for name, root in DEPENDENCIES.items()}
    for overlay, kafka_tree in (("local-cpu", "kafka-local"), ("production-gpu", "kafka")):
        config = overlay_config(rendered(OVERLAYS[overlay]))
        kafka = one(deps[kafka_tree], "Kafka")
        listener = next(l for l in kafka["spec"]["kafka"]["listeners"] if not l["tls"])
        expected = (
            f"{kafka['metadata']['name']}-kafka-bootstrap."
            f"{kafka['metadata']['namespace']}.svc.cluster.local:{listener['port']}"
        )
        assert config.kafka.bootstrap == expected
        assert config.etcd.host == f"etcd.{kafka['metadata']['namespace']}.svc.cluster.local"
        assert config.redis.url.startswith(f"redis://redis-cluster.{kafka['metadata']['namespace']}.svc.cluster.local:")
        # The chart runs a Redis Cluster: a plain client would fail every multi-key lookup.
        assert config.redis.cluster
    production = overlay_config(rendered(OVERLAYS["production-gpu"]))
    assert production.redis.wait_replicas >= 1
    # Every etcd member by name, as many as the chart runs.
    members = yaml.safe_load((K8S / "dependencies" / "etcd-values.yaml").read_text())["replicaCount"]
    assert production.etcd.members == [
        f"etcd-{i}.etcd-headless.ballast-deps.svc.cluster.local:2379" for i in range(members)
    ]
    readme = (K8S / "dependencies" / "README.md").read_text()
    for needle in ("bitnamicharts/etcd", "bitnamicharts/redis-cluster", "strimzi-kafka-operator"):
        assert needle in readme
    for values in ("etcd-values.yaml", "redis-cluster-values.yaml"):
        assert isinstance(yaml.safe_load((K8S / "dependencies" / values).read_text()), dict)


# ---------------------------------------------------------------------------------------------
# Container images


def _stages(dockerfile: Path) -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined, comments dropped)."""
    lines: list[str] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    stages: dict[str, list[str]] = {}
    current = None
    for line in lines:
        if line.upper().startswith("FROM "):
            match = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
            assert match, line
            current = match.group(2) or f"stage{len(stages)}"
            stages[current] = [line]
        elif current is not None:
            stages[current].append(line)
    return stages


def _final_user(stages: dict[str, list[str]], stage: str) -> str | None:
    user = None
    for line in stages[stage]:
        if line.upper().startswith("FROM "):
            parent = line.split()[1]
            if parent in stages:
                user = _final_user(stages, parent)
        elif line.upper().startswith("USER "):
            user = line.split()[1]
    return user


def test_images_are_multi_stage_non_root_and_run_the_console_scripts():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    cpu = _stages(DEPLOY / "docker" / "Dockerfile")
    gpu = _stages(DEPLOY / "docker" / "worker-gpu.Dockerfile")
    targets = {
        "router": (cpu, "router"),
        "cache": (cpu, "cache"),
        "backfill": (cpu, "backfill"),
        "worker": (cpu, "worker-cpu"),
        "worker-gpu": (gpu, "worker-gpu"),
    }
    for service, (stages, target) in targets.items():
        assert len(stages) >= 2
        user = _final_user(stages, target)
        assert user is not None and user.split(":")[0] not in {"0", "root"}, f"{target} runs as {user}"
        entrypoints = [l for l in stages[target] if l.upper().startswith("ENTRYPOINT")]
        entry = json.loads(entrypoints[-1].split(None, 1)[1])
        expected = f"ballast-{service.removesuffix('-gpu')}"
        assert entry == [expected] and expected in scripts
    text = (DEPLOY / "docker" / "worker-gpu.Dockerfile").read_text()
    base = re.search(r"ARG VLLM_IMAGE=(\S+)", text).group(1)
    image, _, tag = base.partition(":")
    assert image == "vllm/vllm-openai" and tag and tag != "latest"
    assert "[gpu]" in text
    cpu_text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert "download.pytorch.org/whl/cpu" in cpu_text and ".[torch]" in cpu_text
    # The numeric uid of the images is the one the pods declare.
    for overlay in OVERLAYS:
        for workload in _workloads(rendered(OVERLAYS[overlay])):
            assert workload["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001
    assert "10001:10001" in cpu_text and "10001:10001" in text


# ---------------------------------------------------------------------------------------------
# Dashboard and alerts

GRAFANA_VARIABLES = re.compile(r"\$\{?(__rate_interval|__interval|__range)\}?")


def _metric_names(expr: str) -> set[str]:
    expr = GRAFANA_VARIABLES.sub("5m", expr)
    expr = re.sub(r"\$\{?(\w+)\}?", r"\1", expr)
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_existing_metric_names_are_what_the_services_export():
    from services.common.config import TelemetryConfig
    from services.common.telemetry import Telemetry
    from services.router.metrics import RouterMetrics
    from services.worker.engine import EngineStats
    from services.worker.metrics import WorkerMetrics

    exported: set[str] = set()
    for service in ("router", "worker"):
        telemetry = Telemetry(service, TelemetryConfig(enabled=False))
        try:
            telemetry.dependencies.set("etcd", True)
            if service == "router":
                metrics = RouterMetrics(telemetry)
                metrics.requests.add(1, {"tier": "S", "outcome": "ok"})
                metrics.tokens.add(1)
                metrics.in_flight.add(1)
                metrics.ttft.record(10.0, {"tier": "S"})
                metrics.e2e.record(20.0, {"tier": "S"})
            else:
                metrics = WorkerMetrics(telemetry, lambda: EngineStats(), lambda: 0)
                metrics.requests.add(1, {"outcome": "ok"})
                metrics.tokens.add(1)
            exported |= _series_names(telemetry.render())
        finally:
            telemetry.stop()
    assert EXISTING_METRICS <= exported, EXISTING_METRICS - exported
    # The names read from the source are what live services really export.
    assert exported <= exported_metric_names(), exported - exported_metric_names()


def test_grafana_dashboard_parses_and_uses_known_metrics():
    dashboard = json.loads((DEPLOY / "grafana" / "ballast-dashboard.json").read_text())
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    used: set[str] = set()
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, f"{panel['title']}: no metric in {target['expr']}"
            assert names <= exported_metric_names(), (
                f"{panel['title']}: not exported: {names - exported_metric_names()}"
            )
            used |= names
    # What the dashboard exists to show, business health included.
    assert {
        "ballast_router_requests_total",
        "ballast_router_ttft_milliseconds_bucket",
        "ballast_router_fallback_trigger_count_total",
        "ballast_breaker_state",
        "ballast_worker_temperature_celsius",
        "ballast_worker_kv_lookups_total",
        "ballast_backfill_current_lag_seconds",
        "ballast_desired_replicas",
        "ballast_dependency_up",
        "ballast_agent_turns_total",
        "ballast_agent_turn_success_rate",
        "ballast_context_retention_rate",
    } <= used
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            metric = re.match(r"label_values\((\w+),", query).group(1)
            assert metric in exported_metric_names()


def _duration_s(text: str) -> float:
    return promql_parser.parse_duration(text).total_seconds()


def test_alert_rules_parse_and_cover_the_required_alerts():
    rule = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    alerts = {}
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for item in group["rules"]:
            assert item["alert"] not in alerts
            assert item["labels"]["severity"] in {"critical", "warning", "info"}
            assert item["annotations"]["summary"]
            _duration_s(item.get("for", "0s"))
            names = _metric_names(item["expr"])
            assert names and names <= exported_metric_names(), f"{item['alert']}: {names - exported_metric_names()}"
            alerts[item["alert"]] = item
    exprs = {name: " ".join(a["expr"].split()) for name, a in alerts.items()}

    fallbacks = exprs["BallastFallbacksHigh"]
    assert "ballast_router_fallback_trigger_count_total[1h]" in fallbacks and fallbacks.endswith("> 50")
    ttft = exprs["BallastSTierTTFTOverBudget"]
    assert 'ballast_router_ttft_milliseconds_bucket{tier="S"}' in ttft and "histogram_quantile(0.99" in ttft
    assert re.search(r"\)\s*> 800\b", ttft)
    assert "ballast_dependency_up" in exprs["BallastDependencyDown"] and exprs["BallastDependencyDown"].endswith("== 0")
    assert "ballast_breaker_state" in exprs["BallastBreakerOpen"]
    assert "ballast_router_worker_routable" in exprs["BallastWorkerOutOfRouting"]
    turns = exprs["BallastTurnSuccessLow"]
    assert 'ballast_agent_turns_total{outcome="success"}' in turns and re.search(r"\)\s*< 0\.95\b", turns)


def test_adapter_serves_desired_replicas_as_external_metric():
    values = yaml.safe_load((DEPLOY / "prometheus" / "adapter-values.yaml").read_text())
    rule = one_list(values["rules"]["external"])
    assert rule["name"]["as"] == "ballast_desired_replicas"
    assert _metric_names(rule["seriesQuery"]) == {"ballast_desired_replicas"}


def test_production_runs_mutual_tls_with_a_certificate_per_role():
    from services.common.tls.roles import role_uri

    objects = rendered(OVERLAYS["production-gpu"])
    config = overlay_config(objects)
    assert config.tls.enabled and config.tls.public_tls
    issuer = one(objects, "Issuer", "ballast-ca")
    _require(issuer, "spec.ca.secretName")
    mount = str(PurePosixPath(config.tls.cert_file).parent)
    assert {str(PurePosixPath(f).parent) for f in (config.tls.ca_file, config.tls.key_file)} == {mount}
    for role in ("router", "worker", "cache", "backfill"):
        name = f"ballast-{role}"
        certificate = one(objects, "Certificate", name)
        _require(certificate, "spec.secretName", "spec.issuerRef.name", "spec.duration", "spec.renewBefore")
        spec = certificate["spec"]
        assert spec["issuerRef"] == {"name": "ballast-ca", "kind": "Issuer"}
        # The role the peer check reads, and the name clients verify.
        assert spec["uris"] == [role_uri(role)]
        assert config.tls.target_name_override in spec["dnsNames"]
        assert {"server auth", "client auth"} <= set(spec["usages"])
        pod = one(objects, "Deployment", name)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts[mount]["readOnly"] is True
        assert volumes[mounts[mount]["name"]]["secret"]["secretName"] == spec["secretName"]
    # The local overlay stays plaintext, like `ballast up`.
    assert not overlay_config(rendered(OVERLAYS["local-cpu"])).tls.enabled
