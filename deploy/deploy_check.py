"""``make images`` and ``make deploy-check``: the Dockerfiles built and the manifests played with podman.

``images`` builds deploy/docker/{gateway,worker}.Dockerfile unchanged, on a
base image made locally (deploy/local/base-image.sh) through their build
arguments. ``check`` then plays the overlay k8s/overlays/local-check (the
base manifests with these images) with ``podman kube play``, runs the
probes the manifests declare until every pod is ready, sends KServe v2
requests over HTTP and gRPC to the gateway Service's ports, checks the
answers against ONNX Runtime and that both workers served, kills one worker
and keeps sending, stops the rest with SIGTERM as the kubelet would, and
removes every pod, network and image it made. Where podman cannot start a
container it prints why and exits 0: it is a check for hosts that can.
What podman cannot play is translated in deploy/podman_play.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

import chroot_smoke
import podman_play
from podman_play import PlayPod, Probe

log = logging.getLogger(__name__)

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
OVERLAY = DEPLOY / "k8s" / "overlays" / "local-check"
BASE_IMAGE = "localhost/infergate-base:bookworm"
IMAGES = {"gateway": ("localhost/infergate/gateway:check", "PYTHON_IMAGE"),
          "worker": ("localhost/infergate/worker:check", "CUDA_IMAGE")}
NETWORK = "infergate-check"
MODEL = "simple"
READY_TIMEOUT_S = 300.0


class Skip(Exception):
    """podman cannot run containers here; the reason is printed and the check passes."""


def podman(*args: str, env: dict[str, str] | None = None, check: bool = True,
           timeout: float = 900) -> subprocess.CompletedProcess[str]:
    log.debug("podman %s", " ".join(args))
    done = subprocess.run(["podman", *args], env=env, text=True, capture_output=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


def choose_runtime() -> dict[str, str]:
    """The environment podman starts containers with: its own settings, else deploy/local/containers.conf."""
    if not shutil.which("podman"):
        raise Skip("podman is not installed")
    probe_image = podman("image", "exists", BASE_IMAGE, check=False).returncode == 0
    if not probe_image:
        missing = [tool for tool in ("debootstrap",) if not shutil.which(tool)]
        if os.geteuid() != 0 or missing:
            raise Skip(f"the local base image needs root and debootstrap (missing: {missing or 'root'})")
    errors = []
    for extra in ({}, {"CONTAINERS_CONF": str(DEPLOY / "local" / "containers.conf")}):
        env = {**os.environ, **extra}
        if not probe_image:
            return env  # judged after the base image exists (see main)
        run = podman("run", "--rm", "--network", "none", "--entrypoint", "true", BASE_IMAGE, env=env, check=False)
        if run.returncode == 0:
            log.info("containers start with %s", extra or "podman's own settings")
            return env
        errors.append(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit {run.returncode}")
    raise Skip("no OCI runtime can start a container here: " + " | ".join(errors))


def _ca_mounts(tmp: Path) -> list[str]:
    """Build-time only: pip trusts the CA bundle the host's pip is told to (a TLS-inspecting proxy)."""
    bundle = next((os.environ[v] for v in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")
                   if os.environ.get(v) and Path(os.environ[v]).is_file()), None)
    if not bundle:
        return []
    conf = tmp / "pip.conf"
    conf.write_text("[global]\ncert = /run/build-ca.crt\n")
    return ["--volume", f"{bundle}:/run/build-ca.crt:ro", "--volume", f"{conf}:/etc/pip.conf:ro"]


def build_images(env: dict[str, str]) -> dict[str, dict[str, float]]:
    """Build the base image, then both images from the Dockerfiles users build; sizes and build times."""
    subprocess.run([str(DEPLOY / "local" / "base-image.sh"), BASE_IMAGE], env=env, check=True)
    isolation = os.environ.get("BUILDAH_ISOLATION", "chroot")
    report: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        mounts = _ca_mounts(Path(tmp))
        for name, (tag, base_arg) in IMAGES.items():
            dockerfile = DEPLOY / "docker" / f"{name}.Dockerfile"
            started = time.monotonic()
            subprocess.run(["podman", "build", "--format", "docker", "--isolation", isolation, *mounts,
                            "--ignorefile", f"{dockerfile}.dockerignore", "--build-arg", f"{base_arg}={BASE_IMAGE}",
                            "-f", str(dockerfile), "-t", tag, str(ROOT)], env=env, check=True)
            size = int(podman("image", "inspect", "--format", "{{.Size}}", tag, env=env).stdout.strip())
            report[name] = {"size_mb": round(size / 1e6, 1), "build_s": round(time.monotonic() - started, 1)}
            log.info("image %s: %s", tag, report[name])
    return report


def render() -> list[dict[str, Any]]:
    kubectl = Path(sys.executable).parent / "kubectl"
    command = [str(kubectl) if kubectl.exists() else "kubectl", "kustomize", str(OVERLAY)]
    out = subprocess.run(command, check=True, text=True, capture_output=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


class Cluster:
    """The played pods on one podman network, and how to reach and remove them."""

    def __init__(self, docs: list[dict[str, Any]], env: dict[str, str]) -> None:
        self.docs, self.env = docs, env
        self.pods = podman_play.pods_to_play(docs)
        self.aliases = podman_play.network_aliases(docs, self.pods)
        self.played: list[str] = []
        self.network_made = False
        self.started_at: dict[str, float] = {}
        self.volumes: list[str] = []

    def play(self, tmp: Path) -> None:
        # What an interrupted earlier run left (same names: ours) goes first.
        for pod in self.pods:
            podman("pod", "rm", "--force", "--time", "0", pod.name, env=self.env, check=False)
        podman("network", "rm", "--force", NETWORK, env=self.env, check=False)
        podman("network", "create", NETWORK, env=self.env)
        self.network_made = True
        config_maps = podman_play.config_maps(self.docs)
        # podman keeps each played ConfigMap as a volume of its name: ours to remove afterwards.
        self.volumes = [c["metadata"]["name"] for c in config_maps
                        if podman("volume", "exists", c["metadata"]["name"], env=self.env, check=False).returncode != 0]
        # Workers first, as a gateway is not ready until one is reachable.
        for pod in sorted(self.pods, key=lambda p: p.workload != "infergate-worker"):
            path = tmp / f"{pod.name}.yaml"
            path.write_text(yaml.safe_dump_all([*config_maps, pod.doc]))
            aliases = ",".join(f"alias={a}" for a in self.aliases[pod.name])
            network = f"{NETWORK}:{aliases}" if aliases else NETWORK
            self.started_at[pod.name] = time.monotonic()
            podman("kube", "play", "--network", network, str(path), env=self.env)
            self.played.append(pod.name)

    def container(self, pod: PlayPod, name: str) -> str:
        return f"{pod.name}-{name}"

    def ip(self, pod: PlayPod) -> str:
        name = self.container(pod, pod.doc["spec"]["containers"][0]["name"])
        fmt = "{{(index .NetworkSettings.Networks \"%s\").IPAddress}}" % NETWORK
        return podman("inspect", "--format", fmt, name, env=self.env).stdout.strip()

    def down(self) -> None:
        for name in reversed(self.played):
            podman("pod", "rm", "--force", "--time", "5", name, env=self.env, check=False)
        for volume in self.volumes + [v for pod in self.pods if pod.name in self.played
                                      for v in podman_play.empty_dirs(pod)]:
            podman("volume", "rm", "--force", volume, env=self.env, check=False)
        if self.network_made:
            podman("network", "rm", "--force", NETWORK, env=self.env, check=False)


def run_probe(probe: Probe, ip: str) -> bool:
    """One probe attempt, as the kubelet makes it (HTTP 200..399, gRPC SERVING, TCP connect)."""
    import socket
    import urllib.error
    import urllib.request
    try:
        if probe.action == "httpGet":
            with urllib.request.urlopen(f"http://{ip}:{probe.port}{probe.path}", timeout=probe.timeout_s) as reply:
                return 200 <= reply.status < 400
        if probe.action == "grpc":
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            with grpc.insecure_channel(f"{ip}:{probe.port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe.service), timeout=probe.timeout_s)
                return reply.status == health_pb2.HealthCheckResponse.SERVING
        with socket.create_connection((ip, probe.port), timeout=probe.timeout_s):
            return True
    except Exception:  # a failed probe is a probe that said no
        return False


def wait_ready(cluster: Cluster) -> dict[str, float]:
    """Each pod's startup probes, then readiness probes, until they pass; seconds from play to ready."""
    ready: dict[str, float] = {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while len(ready) < len(cluster.pods):
        for pod in cluster.pods:
            if pod.name in ready:
                continue
            ip = cluster.ip(pod)
            startup = [p for p in pod.probes if p.kind == "startupProbe"]
            readiness = [p for p in pod.probes if p.kind == "readinessProbe"]
            if ip and all(run_probe(p, ip) for p in startup) and all(run_probe(p, ip) for p in readiness):
                ready[pod.name] = round(time.monotonic() - cluster.started_at[pod.name], 1)
                log.info("pod %s ready after %.1f s (%s)", pod.name, ready[pod.name],
                         ", ".join(f"{p.kind} {p.action}:{p.port}{p.path}{p.service}" for p in startup + readiness))
        if time.monotonic() > deadline:
            missing = [p.name for p in cluster.pods if p.name not in ready]
            raise RuntimeError(f"pods not ready after {READY_TIMEOUT_S:.0f} s: {missing}")
        time.sleep(1)
    return ready


class Traffic:
    """KServe v2 requests to ``simple`` through the gateway Service, over HTTP and gRPC, checked against ORT."""

    def __init__(self, cluster: Cluster) -> None:
        import onnxruntime
        service = next(d for d in cluster.docs if d["kind"] == "Service" and d["metadata"]["name"] == "infergate-gateway")
        routes = {r.port_name: r for r in podman_play.service_routes(service, cluster.pods)}
        members = podman_play.service_members(service, cluster.pods)
        # The Service's ClusterIP stands in as round-robin over the selected pods' addresses.
        self.endpoints = [(cluster.ip(pod), routes["http"].target_port, routes["grpc"].target_port) for pod in members]
        model = ROOT / "models" / MODEL / "1" / "model.onnx"
        if not model.exists():
            raise RuntimeError(f"{model} is missing: run `make models` first")
        self.session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        self.sent = 0

    def expected(self, a: Any, b: Any) -> dict[str, Any]:
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, {"INPUT0": a, "INPUT1": b})))

    def one(self, protocol: str) -> None:
        import json
        import urllib.request

        import numpy as np
        import tritonclient.grpc as grpcclient
        rng = np.random.default_rng(self.sent)
        a, b = (rng.integers(-1000, 1000, size=(1, 16), dtype=np.int32) for _ in range(2))
        host, http_port, grpc_port = self.endpoints[self.sent % len(self.endpoints)]
        self.sent += 1
        want = self.expected(a, b)
        if protocol == "http":
            body = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": v.ravel().tolist()}
                               for n, v in (("INPUT0", a), ("INPUT1", b))]}
            request = urllib.request.Request(f"http://{host}:{http_port}/v2/models/{MODEL}/infer",
                                             data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as reply:
                outputs = {o["name"]: np.array(o["data"], dtype=np.int32).reshape(o["shape"])
                           for o in json.load(reply)["outputs"]}
        else:
            client = grpcclient.InferenceServerClient(f"{host}:{grpc_port}")
            inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer(MODEL, inputs, client_timeout=10)
            outputs = {n: result.as_numpy(n) for n in want}
            client.close()
        for name, value in want.items():
            if not np.array_equal(outputs[name], value):
                raise AssertionError(f"{protocol}: {name} is {outputs[name].tolist()}, ONNX Runtime says {value.tolist()}")

    def burst(self, count: int) -> None:
        for i in range(count):
            self.one("http" if i % 2 == 0 else "grpc")


def served(cluster: Cluster, pod: PlayPod) -> float:
    """Successful ``simple`` requests a worker counted (its own /metrics)."""
    import urllib.request
    with urllib.request.urlopen(f"http://{cluster.ip(pod)}:8002/metrics", timeout=5) as reply:
        return podman_play.metric_total(reply.read().decode(), "nv_inference_request_success", model=MODEL)


def stop(cluster: Cluster, pod: PlayPod, grace_s: int) -> dict[str, float]:
    """SIGTERM (the image's stop signal) as the kubelet sends it; exit code and seconds to exit."""
    name = cluster.container(pod, pod.doc["spec"]["containers"][0]["name"])
    started = time.monotonic()
    podman("stop", "--time", str(grace_s), name, env=cluster.env)
    code = int(podman("inspect", "--format", "{{.State.ExitCode}}", name, env=cluster.env).stdout.strip())
    return {"exit_code": code, "stop_s": round(time.monotonic() - started, 1)}


def check(env: dict[str, str], report: dict[str, Any]) -> None:
    cluster = Cluster(render(), env)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cluster.play(Path(tmp))
        report["ready_s"] = wait_ready(cluster)
        traffic = Traffic(cluster)
        traffic.burst(40)
        workers = [p for p in cluster.pods if p.workload == "infergate-worker"]
        counts = {p.name: served(cluster, p) for p in workers}
        log.info("requests each worker served: %s", counts)
        report["served"] = counts
        if not all(counts.values()):
            raise AssertionError(f"not every worker served requests: {counts}")
        victim = workers[-1]
        podman("kill", "--signal", "KILL", cluster.container(victim, "worker"), env=env)
        log.info("killed %s; sending on", victim.name)
        traffic.burst(40)
        restarts = podman("inspect", "--format", "{{.RestartCount}}", cluster.container(victim, "worker"), env=env)
        report["after_kill"] = f"40 of 40 answered (podman restarted the worker {restarts.stdout.strip()} times)"
        report["stopped"] = {p.name: stop(cluster, p, int(p.doc["spec"].get("terminationGracePeriodSeconds", 30)))
                             for p in cluster.pods if p is not victim}
        bad = {n: s for n, s in report["stopped"].items() if s["exit_code"] not in (0, 143)}
        if bad:
            raise AssertionError(f"containers did not exit cleanly on SIGTERM: {bad}")
    finally:
        cluster.down()


def run_by_chroot(report: dict[str, Any], reason: str) -> None:
    """No container runs here: each image's filesystem, user and entrypoint, by chroot in namespaces."""
    log.info("containers cannot start (%s): running each image by chroot instead", reason)
    report["containers"] = f"not started: {reason}"
    report["chroot"] = {role: chroot_smoke.smoke(tag, role) for role, (tag, _) in IMAGES.items()}
    failed = [role for role, result in report["chroot"].items() if not result["passed"]]
    if failed:
        raise AssertionError(f"images that did not run by chroot: {failed}: {report['chroot']}")


def image_ids(env: dict[str, str]) -> set[str]:
    return set(podman("images", "--all", "--quiet", "--no-trunc", env=env).stdout.split())


def remove_images(env: dict[str, str], before: set[str]) -> None:
    """Our tags, then every image (stages, base) that was not there before the build."""
    for tag in [tag for tag, _ in IMAGES.values()] + [BASE_IMAGE]:
        podman("rmi", "--force", tag, env=env, check=False)
    for image in image_ids(env) - before:
        podman("rmi", "--force", image, env=env, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["images", "check"])
    parser.add_argument("--keep-images", action="store_true", help="check: leave the built images in place")
    parser.add_argument("--chroot", action="store_true",
                        help="check: run the images by chroot, as where no OCI runtime starts a container")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="deploy-check: %(message)s")
    report: dict[str, Any] = {}
    try:
        env = choose_runtime()
        before = image_ids(env)
        report["images"] = build_images(env)
        if args.command == "check":
            try:
                try:
                    if args.chroot:
                        raise Skip("--chroot asked for")
                    env = choose_runtime()  # now judged on the base image
                except Skip as exc:
                    run_by_chroot(report, str(exc))
                else:
                    check(env, report)
            finally:
                if not args.keep_images:
                    remove_images(env, before)
    except Skip as exc:
        if args.command == "images":
            print(f"images: {exc}", file=sys.stderr)
            return 1
        print(f"deploy-check: skipped: {exc}")
        return 0
    print("deploy-check: " + yaml.safe_dump(report, sort_keys=False).replace("\n", "\n  ").rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
