"""The fallback that runs an image by chroot where no container starts (deploy/chroot_smoke.py)."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
_spec = importlib.util.spec_from_file_location("chroot_smoke", DEPLOY / "chroot_smoke.py")
assert _spec and _spec.loader
chroot_smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chroot_smoke)

CONFIG = {"User": "10001:10001", "Env": ["PATH=/opt/infergate/bin:/usr/bin", "PYTHONUNBUFFERED=1"],
          "Entrypoint": ["infergate"], "Cmd": ["worker", "--model-repository", "/models", "--port", "8001"]}


def test_the_entrypoint_runs_as_the_image_user_with_the_image_env_only() -> None:
    text = chroot_smoke.script("/mnt/root dir", CONFIG, ["python", "-c", "print(1)"])
    start = shlex.join(["chroot", "--userspec=10001:10001", "/mnt/root dir", "env", "-i", *CONFIG["Env"],
                        "infergate", "worker", "--model-repository", "/models", "--port", "8001"]) + " &"
    assert start in text.splitlines()
    check = shlex.join(["chroot", "--userspec=10001:10001", "/mnt/root dir", "env", "-i", *CONFIG["Env"],
                        "python", "-c", "print(1)"])
    assert check in text


def test_the_run_needs_health_and_a_clean_exit_on_sigterm() -> None:
    lines = chroot_smoke.script("/r", CONFIG, ["true"], timeout_s=7).splitlines()
    assert "for i in $(seq 7); do" in lines
    assert "kill -TERM $pid 2>/dev/null" in lines
    assert lines[-1] == '[ -n "$ok" ] && [ "$code" = 0 ]'
    # A private /tmp and the kernel's filesystems, mounted inside the mount namespace only.
    assert "mount --make-rprivate /" in lines
    assert "mount -t tmpfs tmpfs /r/tmp && chmod 1777 /r/tmp" in lines


def test_an_image_without_user_runs_as_root() -> None:
    text = chroot_smoke.script("/r", {**CONFIG, "User": ""}, ["true"])
    assert "--userspec=0:0" in text
