"""Each built image's own filesystem, user and entrypoint run without a container runtime.

Owns ``make deploy-check``'s fallback where no OCI runtime can start a
process (deploy/deploy_check.py): the image's root filesystem (a buildah
working container, mounted) is entered with ``chroot --userspec`` from the
image's ``USER``, inside fresh network, mount and PID namespaces, and the
image's ``ENTRYPOINT`` + ``CMD`` runs with its ``ENV``. The worker image must
pass its own ``HEALTHCHECK``; the gateway image (no worker to reach, so never
ready) must answer ``/v2/health/live``. Then SIGTERM must end the process
with exit code 0.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
from typing import Any

log = logging.getLogger(__name__)

LIVE = ["python", "-c", "import sys, urllib.request; "
        "sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/live', timeout=2).status != 200)"]


def image_config(image: str) -> dict[str, Any]:
    out = subprocess.run(["podman", "image", "inspect", image], check=True, text=True, capture_output=True).stdout
    [info] = json.loads(out)
    config = dict(info.get("Config") or {})
    config["Healthcheck"] = info.get("Healthcheck") or info.get("HealthCheck") or config.get("Healthcheck")
    return config


def script(root: str, config: dict[str, Any], check: list[str], timeout_s: int = 120) -> str:
    """The shell run inside the namespaces: start the entrypoint, poll the check, SIGTERM, report the exit."""
    user = config.get("User") or "0:0"
    env = ["env", "-i", *config.get("Env", [])]
    command = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
    enter = ["chroot", f"--userspec={user}", root, *env]
    q = shlex.join
    return f"""set -u
ip link set lo up
mount --make-rprivate /
mount -t proc proc {q([root + '/proc'])}
mount --rbind /dev {q([root + '/dev'])}
mount -t tmpfs tmpfs {q([root + '/tmp'])} && chmod 1777 {q([root + '/tmp'])}
{q(enter + command)} &
pid=$!
ok=
for i in $(seq {timeout_s}); do
  if {q(enter + check)} 2>/dev/null; then ok=1; echo "healthy after $i s"; break; fi
  kill -0 $pid 2>/dev/null || break
  sleep 1
done
kill -TERM $pid 2>/dev/null
wait $pid; code=$?
echo "exit code $code"
[ -n "$ok" ] && [ "$code" = 0 ]
"""


def smoke(image: str, role: str) -> dict[str, Any]:
    """Run one image as above; the lines it printed and whether it passed."""
    config = image_config(image)
    health = (config.get("Healthcheck") or {}).get("Test") or []
    check = health[1:] if role == "worker" and health[:1] == ["CMD"] else LIVE
    container = subprocess.run(["buildah", "from", image], check=True, text=True, capture_output=True).stdout.strip()
    try:
        root = subprocess.run(["buildah", "mount", container], check=True, text=True,
                              capture_output=True).stdout.strip()
        run = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "sh", "-c", script(root, config, check)],
                             text=True, capture_output=True, timeout=300)
        lines = [line for line in run.stdout.splitlines() if line.startswith(("healthy", "exit code"))]
        log.info("%s image run by chroot: %s", role, "; ".join(lines) or run.stderr[-500:])
        return {"passed": run.returncode == 0, "result": "; ".join(lines)}
    finally:
        subprocess.run(["buildah", "umount", container], capture_output=True)
        subprocess.run(["buildah", "rm", container], capture_output=True)
