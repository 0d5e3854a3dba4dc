"""The manifests as ``make deploy-check`` plays them: pods, lifted probes, Service routes (deploy/podman_play.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DEPLOY / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


play = load("podman_play")
k8s_check = load("k8s_check")


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    try:
        renderer = k8s_check.find_renderer()
    except k8s_check.RenderError as exc:
        pytest.skip(str(exc))
    return k8s_check.render(k8s_check.ROOT / "overlays" / "local-check", renderer)


def test_local_overlay_changes_only_images_and_resources(docs: list[dict[str, Any]]) -> None:
    base = k8s_check.render(k8s_check.ROOT / "base", k8s_check.find_renderer())

    def strip(doc: dict[str, Any]) -> dict[str, Any]:
        doc = {**doc, "metadata": {k: v for k, v in doc["metadata"].items() if k != "namespace"}}
        if doc["kind"] in play.WORKLOADS:
            spec = doc["spec"]["template"]["spec"]
            containers = [{k: v for k, v in c.items() if k not in ("image", "resources")} for c in spec["containers"]]
            doc = {**doc, "spec": {**doc["spec"], "template": {**doc["spec"]["template"],
                                                               "spec": {**spec, "containers": containers}}}}
        return doc

    assert [strip(d) for d in docs] == [strip(d) for d in base]
    images = {c["image"] for d in docs if d["kind"] in play.WORKLOADS for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"localhost/infergate/gateway:check", "localhost/infergate/worker:check"}


def test_workloads_become_their_replicas_as_pods(docs: list[dict[str, Any]]) -> None:
    pods = play.pods_to_play(docs)
    assert sorted(p.name for p in pods) == ["infergate-gateway-0", "infergate-gateway-1",
                                            "infergate-worker-0", "infergate-worker-1"]
    for pod in pods:
        assert pod.doc["kind"] == "Pod"
        assert pod.doc["metadata"]["labels"] == pod.labels
        for container in pod.doc["spec"]["containers"]:
            assert not set(play.PROBES) & set(container), "probes are run by the driver, not podman"
            assert "ports" not in container and "lifecycle" not in container
        # What the pod runs as and mounts is left as declared.
        assert pod.doc["spec"]["securityContext"]["runAsUser"] == 10001


def test_probes_are_lifted_with_named_ports_resolved(docs: list[dict[str, Any]]) -> None:
    pods = {p.name: p for p in play.pods_to_play(docs)}
    gateway = {p.kind: p for p in pods["infergate-gateway-0"].probes}
    assert gateway["readinessProbe"].action == "httpGet"
    assert (gateway["readinessProbe"].port, gateway["readinessProbe"].path) == (8000, "/v2/health/ready")
    assert gateway["startupProbe"].failure_threshold == 30
    worker = {p.kind: p for p in pods["infergate-worker-1"].probes}
    assert (worker["readinessProbe"].action, worker["readinessProbe"].port) == ("grpc", 8001)
    assert worker["readinessProbe"].service == "inference.GRPCInferenceService"
    assert worker["livenessProbe"].service == ""


def test_probe_of_a_port_nobody_declares_is_an_error() -> None:
    container = {"name": "c", "ports": [{"name": "http", "containerPort": 80}],
                 "readinessProbe": {"httpGet": {"path": "/", "port": "metrics"}}}
    with pytest.raises(ValueError, match="names no port 'metrics'"):
        play.probe_of(container, "readinessProbe")
    assert play.probe_of(container, "livenessProbe") is None
    container["readinessProbe"] = {"tcpSocket": {"port": "http"}}
    assert play.probe_of(container, "readinessProbe").port == 80


def test_services_become_aliases_and_port_routes(docs: list[dict[str, Any]]) -> None:
    pods = play.pods_to_play(docs)
    aliases = play.network_aliases(docs, pods)
    assert aliases["infergate-worker-0"] == ["infergate-worker"]
    assert aliases["infergate-gateway-1"] == ["infergate-gateway"]
    [gateway_service] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "infergate-gateway"]
    routes = {r.port_name: (r.port, r.target_port) for r in play.service_routes(gateway_service, pods)}
    assert routes == {"http": (8000, 8000), "grpc": (8001, 8001)}
    assert {p.workload for p in play.service_members(gateway_service, pods)} == {"infergate-gateway"}


def test_a_service_naming_a_missing_port_is_an_error(docs: list[dict[str, Any]]) -> None:
    pods = play.pods_to_play(docs)
    service = {"metadata": {"name": "s"}, "spec": {"selector": {"app.kubernetes.io/component": "worker"},
                                                   "ports": [{"port": 80, "targetPort": "http"}]}}
    with pytest.raises(ValueError, match="targetPort 'http'"):
        play.service_routes(service, pods)
    service["spec"]["selector"] = {"app": "nobody"}
    with pytest.raises(ValueError, match="selects no pod"):
        play.service_routes(service, pods)


def test_config_maps_travel_with_the_pods(docs: list[dict[str, Any]]) -> None:
    [config] = play.config_maps(docs)
    mounted = {v["configMap"]["name"] for p in play.pods_to_play(docs)
               for v in p.doc["spec"].get("volumes", []) if "configMap" in v}
    assert mounted == {config["metadata"]["name"]}


def test_metric_total_sums_matching_samples() -> None:
    text = "\n".join([
        "# HELP nv_inference_request_success Number of successful inference requests",
        "# TYPE nv_inference_request_success counter",
        'nv_inference_request_success{model="simple",version="1"} 7.0',
        'nv_inference_request_success{model="simple",version="2"} 3.0',
        'nv_inference_request_success{model="simple_sequence",version="1"} 100.0',
        'nv_inference_request_failure{model="simple",version="1"} 5.0',
    ])
    assert play.metric_total(text, "nv_inference_request_success", model="simple") == 10.0
    assert play.metric_total(text, "nv_inference_request_success") == 110.0
    assert play.metric_total(text, "nv_inference_exec_count", model="simple") == 0.0


def test_each_pod_gets_its_own_empty_dirs(docs: list[dict[str, Any]]) -> None:
    pods = {p.name: p for p in play.pods_to_play(docs)}
    assert play.empty_dirs(pods["infergate-worker-0"]) == ["infergate-worker-0-tmp"]
    assert play.empty_dirs(pods["infergate-gateway-1"]) == ["infergate-gateway-1-tmp"]
    mounts = {m["mountPath"]: m["name"] for m in pods["infergate-worker-1"].doc["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/tmp"] == "infergate-worker-1-tmp"
    # The config volume is the ConfigMap's, shared as in a cluster.
    gateway_mounts = {m["mountPath"]: m["name"] for m in pods["infergate-gateway-0"].doc["spec"]["containers"][0]["volumeMounts"]}
    assert gateway_mounts["/etc/infergate"] == "config"
