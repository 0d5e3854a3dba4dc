"""Which model and version a request or a metadata call means (``ModelCatalog``).

A model is resolved from the cluster's view (or the split models' registry),
its newest version when none is asked for; a model without a replica is
placed first when it may be placed on request. An ensemble is ready when
every step's model is servable (``gateway.ensembles.readiness``).
"""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import model_config_pb2

from gateway.ensembles.plan import is_ensemble
from gateway.ensembles.runner import Ensembles
from gateway.ensembles.readiness import missing_step
from gateway.fleet.cluster import Cluster
from gateway.fleet.placement import PlacementController
from gateway.parallel.serving import ParallelModels
from gateway.requests.versions import model_version
from protos.errors import ModelNotFound, Unavailable


def version_key(v: str) -> tuple[int, str]:
    """Versions in Triton's order: numbers by value, after any that are not numbers."""
    return (int(v), v) if v.isdigit() else (-1, v)


class ModelCatalog:
    """Model resolution over the cluster's view, split models, placement and ensemble plans."""

    def __init__(self, cluster: Cluster, parallel: ParallelModels, placement: PlacementController,
                 ensembles: Ensembles, *, default_timeout_s: float, cluster_join_wait_s: float) -> None:
        self._cluster = cluster
        self._parallel = parallel
        self._placement = placement
        self._ensembles = ensembles
        self._default_timeout_s = default_timeout_s
        self._cluster_join_wait_s = cluster_join_wait_s  # a joining worker's first probe, at most

    def model(self, name: str, version: str = "") -> tuple[Any, str]:
        """The model's info and the version meant; ``ModelNotFound`` or (no healthy replica) ``Unavailable``."""
        info = self._parallel.model(name) or self._cluster.model(name)
        if info is None:
            if name in self._cluster.known_models():
                # Known but every replica is down (e.g. a worker restarting): retryable.
                raise Unavailable(f"model '{name}' has no healthy replica right now")
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        versions = info.versions
        if version:
            if version not in versions:
                version = model_version(version)  # Triton's reading of it (or its refusal), then the lookup
            if version not in versions:
                raise ModelNotFound(f"Request for unknown model: '{name}' version {version} is not found")
            return info, version
        # Per request: the newest version without sorting them all.
        return info, (max(versions, key=version_key) if versions else "")

    async def resolve(self, name: str, version: str, timeout_us: int) -> tuple[Any, str]:
        """``model``, placing the model first when it has no replica and may be
        placed on request (declared with replicas, or ``load_on_demand``)."""
        try:
            return self.model(name, version)
        except ModelNotFound:
            # A worker joining now (registered with another process, say) may bring it: wait for its probe.
            if await self._cluster.joined(min(self._default_timeout_s, self._cluster_join_wait_s)):
                try:
                    return self.model(name, version)
                except (ModelNotFound, Unavailable):
                    pass
            if not self._placement.can_load(name):
                raise
        except Unavailable:
            if not self._placement.can_load(name):
                raise
        await self._placement.ensure(name, timeout_us / 1e6 if timeout_us else self._default_timeout_s)
        return self.model(name, version)

    def latest(self, name: str) -> str:
        """The version a request without one would get, "" when the model is not servable now."""
        try:
            return self.model(name)[1]
        except (ModelNotFound, Unavailable):
            return ""

    def ready(self, name: str, version: str = "") -> bool:
        try:
            info, _ = self.model(name, version)
        except ModelNotFound:
            return False
        return not is_ensemble(info.config) or self.missing_step(info.config) is None

    def missing_step(self, config: model_config_pb2.ModelConfig) -> str | None:
        """Why an ensemble cannot run now (``gateway.ensembles.readiness``), or None."""
        return missing_step(config, self._ensembles.plan, self._servable_config)

    def _servable_config(self, name: str, version: str) -> model_config_pb2.ModelConfig | None:
        try:
            return self.model(name, version)[0].config
        except (ModelNotFound, Unavailable):
            return None
