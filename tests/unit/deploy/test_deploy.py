"""Deployment files: rendered Kubernetes manifests and the container images' commands.

The manifests are rendered with kustomize (``deploy/k8s_check.py`` finds
kubectl) and compared with what the code really serves and accepts: probe
paths against the gateway's HTTP routes, container arguments against the
real command-line parsers, the ConfigMap against the config loader. The
Dockerfiles cannot be built here; their commands, user and pins are checked.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway.config import load_config
from gateway.frontends.http_api import create_http_app
from infergate.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
# Flags the manifests pass that other work adds to the gateway; parsed for real once they exist.
PENDING_GATEWAY_FLAGS = {"--worker-dns", "--api-key-file"}


def load_k8s_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("k8s_check", DEPLOY / "k8s_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


k8s_check = load_k8s_check()


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    try:
        renderer = k8s_check.find_renderer()
    except k8s_check.RenderError as exc:
        pytest.skip(str(exc))
    return {str(p.relative_to(k8s_check.ROOT)): k8s_check.render(p, renderer) for p in k8s_check.targets()}


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name} appears {len(matches)} times"
    return matches[0]


def container(doc: dict[str, Any], name: str) -> dict[str, Any]:
    [c] = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def parse_args(command: list[str]) -> argparse.Namespace:
    """Parse ``infergate ARGS`` with the real CLI; pending gateway flags are set aside."""
    assert command[0] == "infergate", command
    argv = list(command[1:])
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    leftover = [a for a in unknown if a not in PENDING_GATEWAY_FLAGS]
    pending_values = [unknown[i + 1] for i, a in enumerate(unknown) if a in PENDING_GATEWAY_FLAGS]
    assert sorted(leftover) == sorted(pending_values), f"unknown arguments {unknown}"
    return args


def flag_value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} in {args}"
    return args[args.index(flag) + 1]


def test_targets_are_the_overlays_and_examples() -> None:
    names = [str(p.relative_to(k8s_check.ROOT)) for p in k8s_check.targets()]
    assert {"overlays/cpu-demo", "overlays/gpu", "examples/production"} <= set(names)


@pytest.mark.parametrize("target", ["overlays/cpu-demo", "overlays/gpu", "examples/production"])
def test_rendered_manifests_are_valid(rendered: dict[str, list[dict[str, Any]]], target: str) -> None:
    docs = rendered[target]
    assert k8s_check.validate_schemas(docs) == []
    assert k8s_check.check_references(docs) == []


def test_strict_schemas_catch_a_misspelt_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = json.loads(json.dumps(find(rendered["overlays/gpu"], "Deployment", "infergate-gateway")))
    container(deployment, "gateway")["readinessProbe"]["httpGett"] = {"path": "/"}
    assert any("httpGett" in e for e in k8s_check.validate_schemas([deployment]))


def test_reference_checks_catch_a_dangling_selector(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = json.loads(json.dumps(rendered["overlays/gpu"]))
    find(docs, "Service", "infergate-worker")["spec"]["selector"]["app.kubernetes.io/component"] = "wrker"
    assert any("matches no pod template" in e for e in k8s_check.check_references(docs))


def served_get_paths() -> set[str]:
    app = create_http_app(object())  # type: ignore[arg-type]  # routes only; no request is served
    return {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource is not None}


@pytest.mark.parametrize("target", ["overlays/cpu-demo", "overlays/gpu", "examples/production"])
def test_gateway_probes_hit_routes_the_gateway_serves(rendered: dict[str, list[dict[str, Any]]], target: str) -> None:
    served = served_get_paths()
    deployment = find(rendered[target], "Deployment", "infergate-gateway")
    gateway = container(deployment, "gateway")
    http_port = int(flag_value(gateway["args"], "--http-port"))
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports["http"] == http_port
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = gateway[probe]["httpGet"]
        assert get["path"] in served, f"{probe} path {get['path']} is not a GET route of the gateway"
        assert ports[get["port"]] == http_port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(http_port) and annotations["prometheus.io/path"] == "/metrics"


def test_gateway_is_highly_available(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for target, docs in rendered.items():
        deployment = find(docs, "Deployment", "infergate-gateway")
        assert deployment["spec"]["replicas"] >= 2, target
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        pdb = find(docs, "PodDisruptionBudget", "infergate-gateway")
        assert k8s_check.matches(pdb["spec"]["selector"]["matchLabels"], labels)
        assert pdb["spec"]["minAvailable"] >= 1
        hpa = find(docs, "HorizontalPodAutoscaler", "infergate-gateway")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": "infergate-gateway"}
        assert hpa["spec"]["minReplicas"] >= 2


def gpu_limit(c: dict[str, Any]) -> int:
    return int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def test_gpu_overlay_workers_request_gpus(rendered: dict[str, list[dict[str, Any]]]) -> None:
    worker = container(find(rendered["overlays/gpu"], "StatefulSet", "infergate-worker"), "worker")
    assert gpu_limit(worker) >= 1
    assert int(worker["resources"]["requests"]["nvidia.com/gpu"]) == gpu_limit(worker)
    assert flag_value(worker["args"], "--device") == "cuda"
    demo = container(find(rendered["overlays/cpu-demo"], "StatefulSet", "infergate-worker"), "worker")
    assert gpu_limit(demo) == 0 and flag_value(demo["args"], "--device") == "cpu"


@pytest.mark.parametrize("target", ["overlays/cpu-demo", "overlays/gpu"])
def test_gateway_discovers_workers_through_the_headless_service(rendered: dict[str, list[dict[str, Any]]],
                                                                 target: str) -> None:
    docs = rendered[target]
    gateway = container(find(docs, "Deployment", "infergate-gateway"), "gateway")
    dns_name, _, dns_port = flag_value(gateway["args"], "--worker-dns").rpartition(":")
    service = find(docs, "Service", dns_name)
    assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses")
    assert int(dns_port) in [p["port"] for p in service["spec"]["ports"]]
    workers = find(docs, "StatefulSet", "infergate-worker")
    assert workers["spec"]["serviceName"] == dns_name
    assert k8s_check.matches(service["spec"]["selector"], workers["spec"]["template"]["metadata"]["labels"])
    worker = container(workers, "worker")
    args = parse_args(worker["command"] + worker["args"])
    assert args.port == int(dns_port) and args.host == "0.0.0.0" and str(args.model_repository) == "/models"
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    annotations = workers["spec"]["template"]["metadata"]["annotations"]
    assert ports["metrics"] == args.metrics_port == int(annotations["prometheus.io/port"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert worker[probe]["grpc"]["port"] == args.port, probe
    assert worker["readinessProbe"]["grpc"]["service"] == "inference.GRPCInferenceService"


def test_gateway_arguments_parse_with_the_real_cli(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for target, docs in rendered.items():
        gateway = container(find(docs, "Deployment", "infergate-gateway"), "gateway")
        args = parse_args(gateway["command"] + gateway["args"])
        assert (args.host, args.http_port, args.grpc_port) == ("0.0.0.0", 8000, 8001), target
        assert args.config == "/etc/infergate/gateway.yaml"
        mounts = {m["mountPath"]: m["name"] for m in gateway["volumeMounts"]}
        assert mounts["/etc/infergate"] == "config"


def test_gateway_config_maps_load(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    for target, docs in rendered.items():
        [config_map] = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(
            "infergate-gateway-config")]
        path = tmp_path / f"{target.replace('/', '-')}.yaml"
        path.write_text(config_map["data"]["gateway.yaml"])
        config = load_config(path)
        assert (config.host, config.http_port, config.grpc_port) == ("0.0.0.0", 8000, 8001)
        assert config.shutdown_grace_s + 5 < find(docs, "Deployment", "infergate-gateway")["spec"]["template"][
            "spec"]["terminationGracePeriodSeconds"], "the drain must end before the pod is killed"
        if target == "examples/production":
            assert [w.kind for w in config.workers] == ["triton", "triton"]


def secret_files(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    return find(docs, "Secret", name)["stringData"]


def test_example_secrets_load_with_the_real_key_store(rendered: dict[str, list[dict[str, Any]]],
                                                      tmp_path: Path) -> None:
    from gateway.security.api_keys import load_key_store

    docs = rendered["examples/production"]
    gateway = container(find(docs, "Deployment", "infergate-gateway"), "gateway")
    files = secret_files(docs, "infergate-api-keys")
    mount = next(m["mountPath"] for m in gateway["volumeMounts"] if m["name"] == "api-keys")
    for flag, key in (("--api-key-file", "api-keys"), ("--admin-key-file", "admin-keys")):
        assert flag_value(gateway["args"], flag) == f"{mount}/{key}"
        (tmp_path / key).write_text(files[key])
    config = load_config(None, security={"api_key_file": str(tmp_path / "api-keys"),
                                         "admin_key_file": str(tmp_path / "admin-keys")})
    store = load_key_store(config.security)
    assert store is not None and len(store) == 3
    admin_keys = [line.split()[0] for line in files["admin-keys"].splitlines() if line.strip()]
    assert secret_files(docs, "infergate-metrics-token")["token"] in admin_keys


def test_worker_token_reaches_both_sides(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["examples/production"]
    gateway = container(find(docs, "Deployment", "infergate-gateway"), "gateway")
    worker = container(find(docs, "StatefulSet", "infergate-worker"), "worker")
    gateway_args = parse_args(gateway["command"] + gateway["args"])
    worker_args = parse_args(worker["command"] + worker["args"])
    assert gateway_args.worker_token_file == str(worker_args.auth_token_file) == "/run/secrets/infergate-worker/token"
    assert len(secret_files(docs, "infergate-worker-token")["token"]) >= 16


def test_pods_run_unprivileged(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for docs in rendered.values():
        for doc in docs:
            spec = k8s_check.pod_spec(doc)
            if spec is None:
                continue
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["automountServiceAccountToken"] is False
            for c in k8s_check.containers(spec):
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


# --- container images ----------------------------------------------------------


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (DEPLOY / "docker" / name).read_text()
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    out = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def instruction(steps: list[tuple[str, str]], keyword: str) -> list[str]:
    return [rest for kw, rest in steps if kw == keyword]


def exec_form(text: str) -> list[str]:
    value = json.loads(text)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), text
    return value


def image_command(name: str) -> list[str]:
    steps = dockerfile(name)
    [entrypoint], [cmd] = instruction(steps, "ENTRYPOINT")[-1:], instruction(steps, "CMD")[-1:]
    return exec_form(entrypoint) + exec_form(cmd)


def image_healthcheck(name: str) -> list[str]:
    [health] = instruction(dockerfile(name), "HEALTHCHECK")
    options, _, command = health.partition("CMD ")
    assert "--interval" in options and "--timeout" in options
    return exec_form(command)


@pytest.mark.parametrize("name", ["gateway.Dockerfile", "worker.Dockerfile"])
def test_images_are_pinned_and_unprivileged(name: str) -> None:
    steps = dockerfile(name)
    args = dict(a.split("=", 1) for a in instruction(steps, "ARG") if "=" in a)
    for base in instruction(steps, "FROM"):
        image = base.split()[0]
        image = args.get(image.strip("${}"), image) if image.startswith("$") else image
        if image in {"base", "build"}:
            continue  # an earlier stage
        assert re.search(r":\d[\w.\-]*$", image) or "@sha256:" in image, f"{image} is not pinned"
    user = instruction(steps, "USER")[-1]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0
    assert instruction(steps, "HEALTHCHECK"), "no health check"
    for copy in instruction(steps, "COPY"):
        if copy.startswith("--from"):
            continue
        for source in shlex.split(copy)[:-1]:
            assert (ROOT / source).exists(), f"COPY source {source} is missing"
    ignore = (DEPLOY / "docker" / f"{name}.dockerignore").read_text()
    assert ignore.splitlines()[1:2] == ["**"], "the build context starts from nothing"
    # Every package the project installs is copied into the image and let through the context filter.
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {shlex.split(c)[0] for c in instruction(steps, "COPY") if not c.startswith("--from")}
    for package in (p.rstrip("*") for p in packages):
        assert package in copied, f"{name} does not copy package {package}"
        assert f"!{package}/" in ignore.splitlines(), f"{name}.dockerignore filters out package {package}"


def test_image_commands_match_the_manifests(rendered: dict[str, list[dict[str, Any]]]) -> None:
    base_worker = container(find(rendered["overlays/gpu"], "StatefulSet", "infergate-worker"), "worker")
    gateway = container(find(rendered["overlays/gpu"], "Deployment", "infergate-gateway"), "gateway")
    gateway_cmd = gateway["command"] + [a for a in gateway["args"]]
    dns = gateway_cmd.index("--worker-dns")
    del gateway_cmd[dns:dns + 2]  # the image's default runs without discovery
    assert image_command("gateway.Dockerfile") == gateway_cmd
    worker_cmd = image_command("worker.Dockerfile")
    parse_args(worker_cmd)
    assert worker_cmd[:-1] == base_worker["command"] + base_worker["args"][:-1]
    assert worker_cmd[-2:] == ["--device", "auto"]
    parse_args(image_command("gateway.Dockerfile"))


def test_healthchecks_target_the_served_ports() -> None:
    # The ports each image's own command serves on (its flags, else the defaults).
    gateway_args = parse_args(image_command("gateway.Dockerfile"))
    http_port = gateway_args.http_port if gateway_args.http_port is not None else load_config().http_port
    gateway = " ".join(image_healthcheck("gateway.Dockerfile"))
    assert f"http://127.0.0.1:{http_port}/v2/health/ready" in gateway
    assert "/v2/health/ready" in served_get_paths()
    worker_port = parse_args(image_command("worker.Dockerfile")).port
    worker = " ".join(image_healthcheck("worker.Dockerfile"))
    assert f"'127.0.0.1:{worker_port}'" in worker and "HealthStub" in worker


def requirement_names(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            assert "==" in line, f"{line!r} is not pinned"
            name, version = line.split("==")
            pins[re.sub(r"\[.*\]", "", name).lower()] = version
    return pins


def dependency_names() -> Iterator[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        yield re.split(r"[\s\[<>=!~;]", dep, maxsplit=1)[0].lower()


@pytest.mark.parametrize(("name", "runtime"), [("requirements-gateway.txt", "onnxruntime"),
                                               ("requirements-worker.txt", "onnxruntime-gpu")])
def test_image_requirements_pin_every_dependency(name: str, runtime: str) -> None:
    pins = requirement_names((DEPLOY / "docker" / name).read_text())
    for dep in dependency_names():
        if dep.startswith("onnxruntime"):
            continue  # one of the two builds, by image
        assert dep in pins, f"{name} does not pin {dep}"
    assert runtime in pins and not ({"onnxruntime", "onnxruntime-gpu"} - {runtime}) & set(pins)


def test_image_default_config_loads() -> None:
    config = load_config(DEPLOY / "docker" / "gateway.yaml")
    assert (config.host, config.http_port, config.grpc_port) == ("0.0.0.0", 8000, 8001)
    assert config.workers == ()
