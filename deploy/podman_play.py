"""What ``podman kube play`` can play of the rendered manifests, and the probes it cannot run.

Owns the pure half of ``make deploy-check`` (deploy/deploy_check.py runs it):
podman plays Pods, Deployments and ConfigMaps, not StatefulSets, Services,
PodDisruptionBudgets or HorizontalPodAutoscalers, and it runs no ``grpc:``
probe (an ``httpGet:`` one becomes a ``curl`` inside the container, which
the images do not ship). So each workload becomes the Pods its controller
would make (``NAME-0``, ``NAME-1``, ... for a StatefulSet), with the probes
lifted off and kept for the driver to run from outside, exactly as declared, and container ports
dropped (podman would publish each on the host, where two replicas clash);
a Service becomes a network alias (what its DNS name resolves to) and a port
table (Service port -> the pods' container port).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Literal

Doc = dict[str, Any]

WORKLOADS = ("Deployment", "StatefulSet")
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


@dataclass(frozen=True, slots=True)
class Probe:
    """One probe as the kubelet would run it against a pod's IP."""

    container: str
    kind: Literal["startupProbe", "livenessProbe", "readinessProbe"]
    action: Literal["httpGet", "grpc", "tcpSocket"]
    port: int
    path: str = ""
    service: str = ""
    period_s: float = 10.0
    timeout_s: float = 1.0
    failure_threshold: int = 3


@dataclass(frozen=True, slots=True)
class PlayPod:
    """A Pod to play, the workload it stands for and the probes taken off it."""

    name: str
    workload: str
    labels: dict[str, str]
    doc: Doc
    probes: tuple[Probe, ...]
    ports: dict[str, int]  # named container ports, as declared (the played doc has none)


@dataclass(frozen=True, slots=True)
class ServiceRoute:
    """A Service's port and the container port it reaches on the selected pods."""

    service: str
    port_name: str
    port: int
    target_port: int


def _container_port(container: Doc, port: int | str) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for entry in container.get("ports", []):
        if entry.get("name") == port:
            return int(entry["containerPort"])
    raise ValueError(f"container {container['name']} names no port {port!r}")


def probe_of(container: Doc, kind: str) -> Probe | None:
    """The container's probe of this kind, its named port resolved; None where none is declared."""
    spec = container.get(kind)
    if not spec:
        return None
    timing = {"period_s": float(spec.get("periodSeconds", 10)), "timeout_s": float(spec.get("timeoutSeconds", 1)),
              "failure_threshold": int(spec.get("failureThreshold", 3))}
    if "httpGet" in spec:
        get = spec["httpGet"]
        return Probe(container["name"], kind, "httpGet", _container_port(container, get["port"]),  # type: ignore[arg-type]
                     path=get.get("path", "/"), **timing)
    if "grpc" in spec:
        rpc = spec["grpc"]
        return Probe(container["name"], kind, "grpc", int(rpc["port"]),  # type: ignore[arg-type]
                     service=rpc.get("service", ""), **timing)
    if "tcpSocket" in spec:
        return Probe(container["name"], kind, "tcpSocket",  # type: ignore[arg-type]
                     _container_port(container, spec["tcpSocket"]["port"]), **timing)
    raise ValueError(f"container {container['name']}: {kind} has no action podman's driver can run")


def _pod_names(doc: Doc) -> list[str]:
    name = doc["metadata"]["name"]
    replicas = int(doc["spec"].get("replicas", 1))
    # StatefulSets name pods NAME-ORDINAL; a Deployment's hashed names are stood in for by ordinals too.
    return [f"{name}-{i}" for i in range(replicas)]


def _own_empty_dirs(pod: str, spec: Doc) -> None:
    """podman 4 keeps an emptyDir as a named volume of the volume's name, shared by every pod
    that names one alike and kept after them: give each pod its own, named ``POD-VOLUME``."""
    renamed = {}
    for volume in spec.get("volumes", []):
        if "emptyDir" in volume:
            renamed[volume["name"]] = volume["name"] = f"{pod}-{volume['name']}"
    for container in spec.get("initContainers", []) + spec.get("containers", []):
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])


def empty_dirs(pod: PlayPod) -> list[str]:
    """The volumes podman makes for a played pod's emptyDirs, to remove with it."""
    return [v["name"] for v in pod.doc["spec"].get("volumes", []) if "emptyDir" in v]


def pods_to_play(docs: list[Doc]) -> list[PlayPod]:
    """Every workload's pods as plain Pod documents, probes and lifecycle hooks lifted off."""
    pods = []
    for doc in docs:
        if doc.get("kind") not in WORKLOADS:
            continue
        template = doc["spec"]["template"]
        for name in _pod_names(doc):
            spec = copy.deepcopy(template["spec"])
            probes = []
            ports = {p["name"]: int(p["containerPort"]) for c in spec.get("containers", [])
                     for p in c.get("ports", []) if "name" in p}
            for container in spec.get("containers", []):
                for kind in PROBES:
                    probe = probe_of(container, kind)
                    if probe:
                        probes.append(probe)
                    container.pop(kind, None)
                # podman runs no preStop hook; the driver's stop sends SIGTERM as the kubelet does after it.
                container.pop("lifecycle", None)
                # podman 4 publishes every containerPort on the host; pods reach each other by address.
                container.pop("ports", None)
            _own_empty_dirs(name, spec)
            labels = dict(template.get("metadata", {}).get("labels", {}))
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": name, "labels": labels,
                                "annotations": dict(template.get("metadata", {}).get("annotations", {}))},
                   "spec": spec}
            pods.append(PlayPod(name, doc["metadata"]["name"], labels, pod, tuple(probes), ports))
    return pods


def config_maps(docs: list[Doc]) -> list[Doc]:
    """The ConfigMaps, which podman plays beside the pods that mount them."""
    return [doc for doc in docs if doc.get("kind") == "ConfigMap"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def service_members(service: Doc, pods: list[PlayPod]) -> list[PlayPod]:
    """The pods a Service selects (its endpoints, readiness aside)."""
    selector = service["spec"].get("selector", {})
    return [pod for pod in pods if _selects(selector, pod.labels)]


def service_routes(service: Doc, pods: list[PlayPod]) -> list[ServiceRoute]:
    """Each Service port and the container port its targetPort names on the selected pods."""
    members = service_members(service, pods)
    if not members:
        raise ValueError(f"Service {service['metadata']['name']} selects no pod")
    routes = []
    for entry in service["spec"]["ports"]:
        target = entry.get("targetPort", entry["port"])
        if isinstance(target, int) or str(target).isdigit():
            port = int(target)
        elif all(target in pod.ports for pod in members) and len({pod.ports[target] for pod in members}) == 1:
            port = members[0].ports[target]
        else:
            raise ValueError(f"Service {service['metadata']['name']} port {entry['port']}: "
                             f"targetPort {target!r} is not one container port on every selected pod")
        routes.append(ServiceRoute(service["metadata"]["name"], entry.get("name", ""), int(entry["port"]), port))
    return routes


def network_aliases(docs: list[Doc], pods: list[PlayPod]) -> dict[str, list[str]]:
    """Pod name -> the Service names that resolve to it (headless or not: DNS is all podman offers)."""
    aliases: dict[str, list[str]] = {pod.name: [] for pod in pods}
    for service in (d for d in docs if d.get("kind") == "Service"):
        for pod in service_members(service, pods):
            aliases[pod.name].append(service["metadata"]["name"])
    return aliases


_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')


def metric_total(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus family's samples whose labels include ``labels`` (0 where none)."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match["name"] != name:
            continue
        found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match["value"])
    return total
