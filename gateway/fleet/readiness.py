"""Strict readiness, Triton's ``--strict-readiness``: what the gateway is asked
to serve and cannot serve now.

Triton is ready when it is up and every model it was asked to serve is
servable; a server asked to serve nothing (explicit model control, nothing
loaded) is ready. The gateway is asked to serve:

- the models of its workers: each model a worker's repository index shows it
  was asked to serve (loaded, or whose load failed or still runs -- a model
  never loaded, or unloaded, is not asked for), servable while some READY
  worker has a READY version of it -- a model that fails on one worker and
  serves on another is servable, and one served only by a worker that is
  down is not;
- the models its config declares with ``replicas`` (placed at start), while
  they are active (an idle model unloaded after its TTL is not asked for);
- its logical (split) models, unless unloaded;

and it needs at least one reachable worker: with none it can serve nothing.
The core adds what this view cannot see: an ensemble it is asked to serve
whose steps are not all servable (``gateway.ensembles.readiness``).
"""

from __future__ import annotations

from collections.abc import Iterable

from tritonclient.grpc import service_pb2

from gateway.fleet.cluster import Cluster
from gateway.fleet.demand import DemandBook


def unservable(
    cluster: Cluster, book: DemandBook, logical: Iterable[service_pb2.RepositoryIndexResponse.ModelIndex]
) -> dict[str, str]:
    """What keeps the gateway from being ready under strict readiness: model -> why ("" for the fleet)."""
    problems: dict[str, str] = {}
    workers = cluster.workers()
    if not any(w.is_up for w in workers):
        problems[""] = "no worker is reachable" if workers else "no worker is configured or registered"
    served = cluster.models()
    for name in cluster.known_models():
        if name not in served:
            problems[name] = f"model '{name}' has no ready replica"
    for worker in workers:
        if worker.is_up:
            for name, why in worker.failed.items():
                if name not in served:
                    problems.setdefault(name, f"model '{name}' on worker {worker.address}: {why}")
    for demand in book:
        if demand.declared and demand.active and demand.name not in served:
            problems.setdefault(demand.name, f"model '{demand.name}' is declared with replicas and has none ready")
    for entry in logical:
        if entry.state != "READY" and entry.reason != "unloaded":
            problems[entry.name] = f"logical model '{entry.name}' is {entry.state}"
    return problems
