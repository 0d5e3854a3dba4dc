"""The container images' entry commands and health checks, run as plain processes.

No container engine is needed: the worker and gateway commands of the
Dockerfiles run with local paths and free ports in place of the image's,
the gateway with the Kubernetes ConfigMap's config file; then each image's
HEALTHCHECK command runs against them, and the manifests' probe and metrics
paths are fetched. Each health check must fail once its server is gone.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from tests.harness import ROOT, start, worker_url
from tests.unit.deploy.test_deploy import image_command, image_healthcheck

BASE = ROOT / "deploy" / "k8s" / "base"


def with_values(command: list[str], values: dict[str, str]) -> list[str]:
    """``command`` without its leading ``infergate``, with the given flags' values replaced."""
    assert command[0] == "infergate"
    args = list(command[1:])
    for flag, value in values.items():
        args[args.index(flag) + 1] = value
    return args


# The addresses the images' HEALTHCHECK commands dial inside their containers.
# Nothing here connects to them: run_healthcheck rewrites each to the
# ephemeral address of the process the test started.
def image_address(dockerfile: str, port_flag: str) -> str:
    command = image_command(dockerfile)
    return f"127.0.0.1:{command[command.index(port_flag) + 1]}"


def run_healthcheck(command: list[str], old: str, new: str) -> int:
    assert command[0] == "python"
    script = command[-1]
    assert old in script
    argv = [sys.executable, *command[1:-1], script.replace(old, new)]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=30).returncode


def probe_paths() -> list[str]:
    deployment = yaml.safe_load((BASE / "gateway-deployment.yaml").read_text())
    [gateway] = deployment["spec"]["template"]["spec"]["containers"]
    return [gateway[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]


def test_image_commands_serve_and_pass_their_health_checks(model_repo: Path) -> None:
    worker_cmd = with_values(image_command("worker.Dockerfile"),
                             {"--model-repository": str(model_repo), "--host": "127.0.0.1", "--port": "0",
                              "--metrics-port": "0"})
    worker = start(worker_cmd)
    gateway = None
    try:
        worker_check = image_healthcheck("worker.Dockerfile")
        assert run_healthcheck(worker_check, image_address("worker.Dockerfile", "--port"), worker_url(worker)) == 0

        gateway_cmd = with_values(image_command("gateway.Dockerfile"), {
            "--host": "127.0.0.1", "--http-port": "0", "--grpc-port": "0", "--config": str(BASE / "gateway.yaml")})
        gateway = start([*gateway_cmd, "--worker", worker_url(worker)])
        http = f"127.0.0.1:{gateway.ready['http_port']}"
        gateway_check = image_healthcheck("gateway.Dockerfile")
        assert run_healthcheck(gateway_check, image_address("gateway.Dockerfile", "--http-port"), http) == 0
        for path in probe_paths():
            with urllib.request.urlopen(f"http://{http}{path}", timeout=10) as response:
                assert response.status == 200, path
        # What the prometheus.io annotations and ServiceMonitors scrape.
        for address in (http, f"127.0.0.1:{worker.ready['metrics_port']}"):
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
                assert response.status == 200 and b"# TYPE" in response.read(), address
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
    assert run_healthcheck(worker_check, image_address("worker.Dockerfile", "--port"), worker_url(worker)) != 0
    if gateway is not None:
        assert run_healthcheck(gateway_check, image_address("gateway.Dockerfile", "--http-port"), http) != 0
