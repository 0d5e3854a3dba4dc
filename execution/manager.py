"""The worker's model lifecycle: which models are loaded, loading (also with
override), reloading, unloading, lookups for requests, the repository index
and statistics.

Rules, as in Triton:
- An ensemble (``platform: "ensemble"``) is run by the gateway, not here: its
  versions hold the config and no instance, so the index, ModelConfig and
  ModelMetadata report it and ModelInfer refuses it (UNIMPLEMENTED).
- A new version runs its ``model_warmup`` samples (``execution.warmup``) on
  every instance before it is installed: READY means warmed up.
- A reload builds the new versions first and swaps them in at once; the old
  versions finish their in-flight requests and are then closed. A failed
  reload leaves the old versions serving.
- Unload removes the versions from lookups at once, waits for their
  in-flight requests (up to ``drain_timeout_s``), then releases them.
- Lookup errors: a model this worker never knew is NOT_FOUND; a known model
  with nothing loaded is UNAVAILABLE (so a router tries another replica).

Concurrency: the table of models is read and changed only on the event loop
thread. Loads and unloads of one model are serialised by that model's lock.
Each load or unload runs as a task owned by the manager and shielded from
its caller, so a client that hangs up mid-load cannot leave a half-loaded
model or a leaked staging directory; :meth:`close` waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import shutil
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from protos.errors import InferGateError, InvalidArgument, ModelNotFound, Unavailable
from protos.execution_slots import set_execution_slots
from protos.generation_usage import add_usage, instances_usage
from execution.backends.base import Backend, ConfigBackends, ModelInstance, Placement
from execution.backends.hf_encoder import is_encoder_export
from execution.backends.hf_export import is_decoder_export
from execution.model import LoadedModel
from execution.sequences import SequenceSettings
from execution.warmup import WarmupSample, run_warmup, warmup_samples
from execution.repository import (
    ModelRepository,
    available_versions,
    check_model_name,
    missing_versions,
    parse_config_json,
    read_config,
    resolve_instance_groups,
    select_versions,
    stage_override,
)

logger = logging.getLogger(__name__)

ENSEMBLE_PLATFORM = "ensemble"


class ModelState(enum.Enum):
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"
    UNLOADING = "UNLOADING"


@dataclass(slots=True)
class _Entry:
    name: str
    state: ModelState = ModelState.UNAVAILABLE
    reason: str = ""
    versions: dict[int, LoadedModel] = field(default_factory=dict)
    latest: LoadedModel | None = None
    # Private directory of a load-with-override; owned by the current versions.
    staged_dir: Path | None = None
    # The `config` of a load that overrode only the config: a later load without
    # one keeps it while the model stays loaded, as Triton does.
    override_config: str | None = None
    # Versions the version policy names that have no directory: version -> reason.
    missing: dict[int, str] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def install(self, versions: dict[int, LoadedModel], staged_dir: Path | None) -> None:
        self.versions = versions
        self.latest = versions[max(versions)] if versions else None
        self.staged_dir = staged_dir


@dataclass(frozen=True, slots=True)
class _Built:
    config: mc.ModelConfig
    placements: list[Placement]
    instances: dict[int, list[ModelInstance]]
    missing: dict[int, str]
    warmup: list[WarmupSample]
    sequences: SequenceSettings | None = None  # read with the model directory (initial-state files)
    backend_name: str = ""  # which backend made the instances

    def close(self) -> None:
        for instances in self.instances.values():
            for instance in instances:
                instance.close()


class ModelManager:
    def __init__(
        self,
        repository: ModelRepository,
        backend: Backend,
        *,
        staging_root: Path,
        max_queue_size: int = 1024,
        drain_timeout_s: float = 30.0,
        config_backends: ConfigBackends | None = None,
    ) -> None:
        self.repository = repository
        self.backend = backend
        # Backends a config names itself (backend: "python"), whatever `backend` is.
        self._config_backends = config_backends
        self._staging_root = staging_root
        self._max_queue_size = max_queue_size
        self._drain_timeout_s = drain_timeout_s
        self._entries: dict[str, _Entry] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # --- lookups (hot path) -----------------------------------------------------

    def get(self, name: str, version: str = "") -> LoadedModel:
        """The version a request runs on ("" = the latest loaded). Raises NOT_FOUND / UNAVAILABLE."""
        entry = self._entries.get(name)
        if entry is None:
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        if not version:
            if entry.latest is None:
                raise Unavailable(f"Request for unknown model: '{name}' has no available versions")
            return entry.latest
        number = int(version) if version.isdigit() else -1
        loaded = entry.versions.get(number)
        if loaded is None:
            raise ModelNotFound(f"Request for unknown model: '{name}' version {version} is not found")
        return loaded

    def is_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except InferGateError:
            return False
        return True

    def loaded(self) -> list[LoadedModel]:
        return [m for entry in self._entries.values() for m in entry.versions.values()]

    def source_dir(self, name: str) -> Path | None:
        """Where ``name``'s loaded versions were read from: its override's staging directory, else the repository's."""
        entry = self._entries.get(name)
        if entry is not None and entry.staged_dir is not None:
            return entry.staged_dir
        return self.repository.model_dir(name)

    # --- lifecycle --------------------------------------------------------------

    async def load(self, name: str, *, config_json: str | None = None, files: Mapping[str, bytes] | None = None) -> None:
        """Load (or reload) ``name`` from the repository, or from override files and config."""
        check_model_name(name)
        await self._owned(self._load(name, config_json, dict(files or {})))

    async def unload(self, name: str) -> None:
        check_model_name(name)
        await self._owned(self._unload(name))

    async def load_all(self, names: Iterable[str]) -> None:
        """Startup: load each model; a failure is logged and leaves that model UNAVAILABLE."""

        async def one(name: str) -> None:
            try:
                await self.load(name)
            except InferGateError:
                pass  # already logged by the load; the index shows the reason

        await asyncio.gather(*(one(name) for name in names))

    async def close(self) -> None:
        """Shutdown: finish pending loads/unloads, then release every model."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for entry in list(self._entries.values()):
            old, staged = list(entry.versions.values()), entry.staged_dir
            entry.install({}, None)
            entry.state, entry.reason = ModelState.UNAVAILABLE, "server shut down"
            await self._retire(old, staged)

    async def _owned(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        # The caller may be cancelled (client gone); the task still finishes, owned by us.
        await asyncio.shield(task)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Retrieved here as well: a caller that went away never will. The load logged it.
            logger.debug("model task ended with %r", task.exception())

    @contextlib.asynccontextmanager
    async def _locked(self, name: str, create: bool) -> AsyncIterator[_Entry | None]:
        """Hold the lock of ``name``'s entry (created if ``create``; None if absent).

        An unload may drop an entry while others wait on its lock; a waiter
        that finds its entry gone retries with the current one, so nothing is
        ever installed into an entry the table no longer holds.
        """
        while True:
            entry = self._entries.get(name)
            if entry is None:
                if not create:
                    yield None
                    return
                entry = self._entries[name] = _Entry(name)
            async with entry.lock:
                if self._entries.get(name) is entry:
                    yield entry
                    return

    def _forget(self, entry: _Entry) -> None:
        """Drop an entry with nothing loaded; the caller holds its lock."""
        if self._entries.get(entry.name) is entry and not entry.versions:
            del self._entries[entry.name]

    async def _load(self, name: str, config_json: str | None, files: dict[str, bytes]) -> None:
        if not files and self.repository.model_dir(name) is None and name not in self._entries:
            raise ModelNotFound(f"failed to load '{name}', failed to poll from model repository")
        if files and config_json is None:
            # Triton's words: the override files form the whole model directory, config included.
            # Refused before any state is made for the model, as Triton does.
            raise InvalidArgument("Load parameter 'config' must be specified for model file override")
        async with self._locked(name, create=True) as entry:
            assert entry is not None
            staged: Path | None = None
            # Until the model directory and the override config are in place (Triton's poll), a
            # failure is the request's (a config that does not parse, files that cannot be
            # written): as in Triton, it leaves no state behind.
            polled = False
            if config_json is None and not files and entry.versions and entry.override_config is not None:
                config_json = entry.override_config  # a reload keeps the config it was loaded with
            try:
                if files:
                    staged = await asyncio.to_thread(stage_override, self._staging_root, name, files)
                    model_dir = staged
                else:
                    found = self.repository.model_dir(name)
                    if found is None:
                        raise ModelNotFound(f"failed to load '{name}', failed to poll from model repository")
                    model_dir = found
                override = parse_config_json(config_json, name) if config_json else None
                polled = True
                if not entry.versions:
                    entry.state, entry.reason = ModelState.LOADING, ""
                built = await asyncio.to_thread(self._build, name, model_dir, override)
                try:
                    # Triton's model_warmup: the version is installed (and READY) only after it.
                    await run_warmup(built.config, built.warmup, built.instances)
                except BaseException:
                    built.close()
                    raise
            except BaseException as exc:
                if staged is not None:
                    await asyncio.to_thread(shutil.rmtree, staged, True)
                if not entry.versions:
                    entry.state = ModelState.UNAVAILABLE
                    entry.reason = exc.message if isinstance(exc, InferGateError) else "load failed"
                    if isinstance(exc, ModelNotFound) or not polled:
                        self._forget(entry)
                if isinstance(exc, InferGateError) and not isinstance(exc, ModelNotFound):
                    if not polled:
                        logger.error("poll failed for model %s: %s", name, exc.message)
                        # Triton's words for a load refused while polling (its clients look for
                        # "failed to load"), then the cause, which Triton writes only to its log.
                        raise InvalidArgument(
                            f"failed to load '{name}', failed to poll from model repository: {exc.message}"
                        ) from None
                    logger.error("load failed for model %s: %s", name, exc.message)
                    # Triton's words first, then the cause.
                    raise InvalidArgument(f"failed to load '{name}': {exc.message}") from None
                raise
            versions = {
                number: LoadedModel(built.config, number, instances, max_queue_size=self._max_queue_size,
                                    sequences=built.sequences)
                for number, instances in built.instances.items()
            }
            old, old_staged = list(entry.versions.values()), entry.staged_dir
            entry.install(versions, staged)
            entry.override_config = config_json if not files else None
            entry.missing = built.missing
            entry.state, entry.reason = ModelState.READY, ""
            logger.info("loaded model %s versions %s, %s", name, sorted(versions), self._instances_text(built))
            await self._retire(old, old_staged)

    def _instances_text(self, built: _Built) -> str:
        """What runs each version here: how many instances on which devices, by which backend."""
        if built.config.platform == ENSEMBLE_PLATFORM:
            return "no instances here: an ensemble's steps run as their own models, called by the gateway"
        devices = ", ".join(sorted({str(p) for p in built.placements}))
        return f"{len(built.placements)} instance(s) each on {devices} ({built.backend_name})"

    def _build(self, name: str, model_dir: Path, override: mc.ModelConfig | None) -> _Built:
        """Blocking: read (unless overridden) and complete the config, then create every instance of every version."""
        config = override if override is not None else read_config(model_dir, name)
        if config.max_batch_size < 0:
            raise InvalidArgument(f"model '{name}': max_batch_size must be >= 0")
        available = available_versions(model_dir)
        numbers = select_versions(config, available)
        missing = missing_versions(config, available)
        for number, reason in missing.items():
            logger.warning("model %s: %s", name, reason)
        if config.platform == ENSEMBLE_PLATFORM:
            # The gateway runs ensembles (each step a routed call): the worker only
            # keeps the config, so that the gateway reads it like any model's.
            if not config.input or not config.output:
                raise InvalidArgument(f"ensemble '{name}' must declare its inputs and outputs")
            return _Built(config, [], {number: [] for number in numbers}, missing, [])
        if not config.backend and not config.platform:
            latest = model_dir / str(numbers[-1])
            if is_decoder_export(latest):
                config.backend = "generate"  # a Hugging Face decoder as exported: the generation backend serves it
            elif is_encoder_export(latest):
                config.backend = "embed"  # an encoder as exported: the embedding backend serves it
        backend = self._backend_for(config)
        config = backend.complete_config(config, model_dir / str(numbers[-1]))
        placements = resolve_instance_groups(config, backend.gpu_count(), backend.cpu_instances)
        # Tell the gateway how many batches of this model run at once here: one per
        # instance, but never more than the backend's shared pool runs across models.
        bound = backend.execution_threads
        set_execution_slots(config, min(len(placements), bound) if bound > 0 else len(placements))
        samples = warmup_samples(config, model_dir)  # before any instance: a bad sample costs no session
        sequences = SequenceSettings.from_config(config, model_dir)  # so is a bad initial state
        created: dict[int, list[ModelInstance]] = {}
        try:
            for number in numbers:
                created[number] = []
                for placement in placements:
                    created[number].append(backend.load(model_dir, model_dir / str(number), config, placement))
        except BaseException:
            for instances in created.values():
                for instance in instances:
                    instance.close()
            raise
        return _Built(config, placements, created, missing, samples, sequences, backend.name)

    def _backend_for(self, config: mc.ModelConfig) -> Backend:
        chosen = self._config_backends.for_config(config) if self._config_backends is not None else None
        return chosen if chosen is not None else self.backend

    async def _unload(self, name: str) -> None:
        async with self._locked(name, create=False) as entry:
            if entry is None:
                if self.repository.model_dir(name) is None:
                    raise ModelNotFound(f"failed to unload '{name}', no model of that name")
                return  # in the repository but never loaded: nothing to do, as in Triton
            old, staged = list(entry.versions.values()), entry.staged_dir
            entry.install({}, None)
            entry.override_config, entry.missing = None, {}
            if old:
                entry.state = ModelState.UNLOADING
                await self._retire(old, staged)
                logger.info("unloaded model %s", name)
            entry.state, entry.reason = ModelState.UNAVAILABLE, "unloaded"
            if self.repository.model_dir(name) is None:
                self._forget(entry)  # only ever loaded with override: no directory to list it by

    async def _retire(self, versions: list[LoadedModel], staged_dir: Path | None) -> None:
        """Drain then release versions that lookups can no longer reach."""
        for model in versions:
            await model.drain(self._drain_timeout_s)
            model.close()
        if staged_dir is not None:
            await asyncio.to_thread(shutil.rmtree, staged_dir, True)

    # --- reporting --------------------------------------------------------------

    async def index(self, ready_only: bool = False) -> list[service_pb2.RepositoryIndexResponse.ModelIndex]:
        """Every model of the repository plus models loaded with override, with their state."""
        on_disk = await asyncio.to_thread(self.repository.names)
        rows: list[service_pb2.RepositoryIndexResponse.ModelIndex] = []
        Row = service_pb2.RepositoryIndexResponse.ModelIndex
        for name in sorted(set(on_disk) | set(self._entries)):
            entry = self._entries.get(name)
            if entry is not None and entry.versions:
                rows.extend(Row(name=name, version=str(v), state=ModelState.READY.value) for v in sorted(entry.versions))
                if not ready_only:  # versions the policy names that could not be loaded
                    rows.extend(Row(name=name, version=str(v), state=ModelState.UNAVAILABLE.value, reason=why)
                                for v, why in sorted(entry.missing.items()))
            elif not ready_only:
                if entry is None:
                    rows.append(Row(name=name))  # never loaded: no state, as Triton reports it
                else:
                    rows.append(Row(name=name, state=entry.state.value, reason=entry.reason))
        return rows

    def statistics(self, name: str = "", version: str = "") -> list[service_pb2.ModelStatistics]:
        if not name:
            models = sorted(self.loaded(), key=lambda m: (m.name, m.version))
        else:
            entry = self._entries.get(name)
            if entry is None or not entry.versions:
                raise ModelNotFound(f"requested model '{name}' is not available")
            models = [self.get(name, version)] if version else [entry.versions[v] for v in sorted(entry.versions)]
        answers = []
        for m in models:
            stats = m.stats.to_proto(m.name, m.version_str)
            usage = instances_usage(m.instances)  # a generation model's sequences and KV cache
            if usage is not None:
                add_usage(stats, usage)
            answers.append(stats)
        return answers
