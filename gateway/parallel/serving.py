"""Serving split models: the gateway's registry of logical models.

For each logical model of the config (see ``logical``) the registry, on
start and on a repository load request:

1. reads the source ONNX model and splits it (``layout_split``) into
   ``tensor_parallel`` x ``pipeline_parallel`` shards grouped into slots;
2. places ``replicas`` x slots on workers (``placement``: rendezvous
   hashing, one slot per worker where there are enough);
3. pushes every shard of a slot to its worker with the repository
   extension's load-with-override (``config`` JSON + ``file:1/model.onnx``),
   so Triton servers can host shards too; a shard already there with the
   same content digest is left alone, which makes a restart cheap;
4. sets each copy up as a peer group on its workers (``groups``), so a batch
   is one call per rank (tensor parallel) or one call to the first stage
   (pipeline), the workers exchanging partial results between themselves;
5. serves batches: on a ready peer group (``peer_run``), else through the
   star -- ``PlanExecutor`` with each shard call routed by the router among
   the workers holding a copy of that shard (``collectives: gateway`` always
   does this).

Shards are ordinary models on the workers (``<logical>.tp2.r0.s1``); the
cluster lists them like any other.

Failures: a batch that fails on a peer group by a server's fault reruns on
another ready group, and the failed group is rebuilt. On the star, the
router retries a shard call on another copy (another replica group). When a call finds no copy at all, the registry re-places the missing
slots on live workers and reruns the whole batch, within its deadline: shard
calls are stateless, so a rerun is safe. In the background the registry
keeps placements whole: a slot whose worker went down is re-placed at once
when nothing else holds its shards, else after ``REPLACE_AFTER_S`` (a
restarting worker usually returns first, and gets its shards back).

Concurrency: everything runs on the gateway's event loop. Placement changes
of one model are serialised by its lock; requests never wait on that lock,
they read the cluster's model map, which only ever shows loaded shards.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.batching.assembly import Sender
from gateway.fleet.cluster import Cluster, ModelInfo
from gateway.parallel.decoder_source import decoder_hints, is_generation_source
from gateway.parallel.logical import (
    VERSION,
    LogicalSpec,
    ParallelConfigError,
    read_source,
    signature,
)
from gateway.parallel.groups import GroupKeeper, peer_kind, steps_by_slot
from gateway.parallel.peer_run import run_on_group
from gateway.parallel.placement import SlotKey
from gateway.parallel.remote import (
    RemoteShards,
    arrays_from_request,
    arrays_from_response,
    needed_outputs,
    response_from_arrays,
)
from gateway.parallel.served import ParallelStats, ServedModel
from gateway.parallel.shard_placement import ShardPlacer
from protos import codec
from protos.errors import DeadlineExceeded, Internal, InvalidArgument, ModelNotFound, Unavailable
from serverkit.tasks import log_task_death
from splitter.execute import PlanExecutor
from splitter.layout_split import LayoutSplit, split_layout
from splitter.sizes import config_shapes

log = logging.getLogger(__name__)

MAINTAIN_INTERVAL_S = 2.0
MAX_ATTEMPTS = 3


class LogicalCapacity:
    """Batcher capacity of a logical model: batches in flight below its limit
    (replica groups x in-flight per replica x pipeline stages, so consecutive
    batches overlap across stages), or no worker up at all (fail fast)."""

    def __init__(self, registry: ParallelModels, name: str) -> None:
        self._registry = registry
        self._name = name

    def has_capacity(self) -> bool:
        served = self._registry._served[self._name]
        return served.inflight < served.limit or not self._registry._placer.any_host_up(served)

    async def wait(self) -> None:
        if self.has_capacity():
            return
        served = self._registry._served[self._name]
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        served.waiters.add(future)
        try:
            await future
        finally:
            served.waiters.discard(future)


class ParallelModels:
    """The registry of logical models; also the ``Sender`` their batches go through."""

    def __init__(self, logical: Mapping[str, Mapping[str, Any]], cluster: Cluster, router: Sender, *,
                 model_repository: str = "", max_inflight_per_replica: int = 0) -> None:
        """``logical``: the config's logical model entries (``from``/``path`` ...), by name; ``model_repository``:
        where their sources are read; ``max_inflight_per_replica``: batches in flight per shard group (0: derived)."""
        self._model_repository = model_repository
        self._max_inflight_per_replica = max_inflight_per_replica
        self._cluster = cluster
        self._router = router
        self._specs = [LogicalSpec.from_settings(n, s) for n, s in logical.items()]
        self._served: dict[str, ServedModel] = {}
        self._placer = ShardPlacer(cluster)
        self._groups = GroupKeeper(cluster)
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Split every logical model and place its shards (after the cluster's first probe).

        A source that cannot be read or split raises ``ParallelConfigError``;
        placement failures are logged and retried in the background.
        """
        for spec in self._specs:
            self._served[spec.name] = await self._prepare(spec, None)
        for served in self._served.values():
            await self._reconcile(served, urgent=True)
        if self._specs:
            self._unsubscribe = self._cluster.on_change(self._on_cluster_change)
            self._task = asyncio.create_task(self._maintain(), name="parallel-maintain")
            self._task.add_done_callback(log_task_death)

    async def stop(self) -> None:
        """Stop maintaining placements. Shards stay loaded: another gateway may serve them."""
        if self._unsubscribe is not None:
            self._unsubscribe()
        tasks = [t for t in [self._task, *(s.repair for s in self._served.values())] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for served in self._served.values():
            served.wake()

    # ---- views -------------------------------------------------------------

    def serves(self, name: str) -> bool:
        return name in self._served

    def model(self, name: str) -> ModelInfo | None:
        """The logical model as clients see it; None when not declared or unloaded."""
        served = self._served.get(name)
        return served.info if served is not None and served.loaded else None

    def capacity(self, name: str) -> LogicalCapacity:
        return LogicalCapacity(self, name)

    def layout(self, name: str) -> LayoutSplit:
        return self._served[name].layout

    def placement(self, name: str) -> dict[SlotKey, str]:
        return dict(self._served[name].placement)

    def stats(self) -> dict[str, ParallelStats]:
        return {name: served.stats() for name, served in self._served.items()}

    def index_entries(self) -> list[service_pb2.RepositoryIndexResponse.ModelIndex]:
        rows = []
        for name, served in sorted(self._served.items()):
            state = "READY" if served.loaded and self._placer.whole(served) else "UNAVAILABLE"
            reason = served.spec.summary() if served.loaded else "unloaded"
            rows.append(service_pb2.RepositoryIndexResponse.ModelIndex(name=name, version=VERSION, state=state, reason=reason))
        return rows

    # ---- inference ---------------------------------------------------------

    async def infer(
        self, model: str, version: str, request: service_pb2.ModelInferRequest, deadline: float | None
    ) -> service_pb2.ModelInferResponse:
        served = self._served[model]
        # Counted before the first await: the batcher asks has_capacity() again
        # as soon as this batch task suspends.
        served.inflight += 1
        try:
            return await self._run(served, version, request, deadline)
        except BaseException:
            served.count("failures")
            raise
        finally:
            served.inflight -= 1
            served.wake()

    async def run_arrays(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str],
                         deadline: float | None) -> list[np.ndarray]:
        """One run of ``model``'s plan on arrays (a split decoder's step): ``outputs`` in that order."""
        request = service_pb2.ModelInferRequest(model_name=model, id=f"{model}-step")
        for name, array in inputs.items():
            datatype, shape, raw = codec.encode(array)
            request.inputs.add(name=name, datatype=datatype, shape=shape)
            request.raw_input_contents.append(raw)
        for name in outputs:
            request.outputs.add(name=name)
        answer = arrays_from_response(await self.infer(model, "", request, deadline))
        return [answer[name] for name in outputs]

    async def _run(
        self, served: ServedModel, version: str, request: service_pb2.ModelInferRequest, deadline: float | None
    ) -> service_pb2.ModelInferResponse:
        if not served.loaded:
            raise ModelNotFound(f"Request for unknown model: '{served.spec.name}' is not found")
        if self._groups.enabled(served):
            answer = await self._run_peers(served, version, request, deadline)
            if answer is not None:
                return answer
        layout, needed = served.layout, served.needed
        inputs = arrays_from_request(request)
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            runner = RemoteShards(self._router, needed, deadline)
            try:
                outputs = await PlanExecutor(layout.plan, runner).run(inputs)
                break
            except (Unavailable, ModelNotFound) as e:
                attempt += 1
                remaining = None if deadline is None else deadline - loop.time()
                if attempt >= MAX_ATTEMPTS or (remaining is not None and remaining <= 0):
                    log.warning("model %s: giving up after %d attempts: %s", served.spec.name, attempt, e)
                    if remaining is not None and remaining <= 0:
                        raise DeadlineExceeded(f"deadline exceeded for model '{served.spec.name}'") from None
                    raise Unavailable(f"model '{served.spec.name}' has shards without a worker right now") from None
                served.count("retries")
                log.info("model %s: a shard had no copy left (%s); re-placing and rerunning", served.spec.name, e)
                await self._repair(served, remaining)
        elapsed = time.perf_counter() - runner.timing.started
        remote = runner.timing.remote_s()
        for key, value in (("batches", 1), ("plan_s", elapsed), ("remote_s", remote),
                           ("collective_s", max(0.0, elapsed - remote)), ("shard_calls", runner.timing.calls),
                           ("bytes_sent", runner.timing.bytes_sent), ("bytes_received", runner.timing.bytes_received)):
            served.count(key, value)
        return response_from_arrays(request, version or VERSION, outputs, [t.name for t in layout.plan.outputs])

    async def _run_peers(
        self, served: ServedModel, version: str, request: service_pb2.ModelInferRequest, deadline: float | None
    ) -> service_pb2.ModelInferResponse | None:
        """Run the batch on a peer group, rerunning it on another copy after a
        server's fault; None when no group can be had (the star serves the batch)."""
        if len(request.raw_input_contents) != len(request.inputs):
            raise Internal(f"batch request for '{request.model_name}' lacks raw contents for some inputs")
        kind = peer_kind(served.layout.plan)
        assert kind is not None
        names = [out.name for out in request.outputs] or [t.name for t in served.layout.plan.outputs]
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        last: Exception | None = None
        for _ in range(MAX_ATTEMPTS):
            group = self._groups.pick(served)
            if group is None:
                await self._repair(served, None if deadline is None else deadline - loop.time(), urgent=True)
                group = self._groups.pick(served)
                if group is None:
                    return None
            try:
                result = await run_on_group(self._cluster, group, kind, request, version or VERSION, names, deadline)
            except (Unavailable, ModelNotFound, DeadlineExceeded) as e:
                if deadline is not None and deadline - loop.time() <= 0:
                    raise DeadlineExceeded(f"deadline exceeded for model '{served.spec.name}'") from None
                served.count("retries")
                last = e
                log.info("model %s: group %s failed a batch (%s); rerunning it on another copy", served.spec.name,
                         group.id, e)
                self._groups.broken(served, group)
                self._repair_task(served, urgent=False)
                continue
            elapsed = time.perf_counter() - started
            for key, value in (("batches", 1), ("plan_s", elapsed), ("remote_s", result.remote_s),
                               ("collective_s", max(0.0, elapsed - result.remote_s)), ("shard_calls", result.calls),
                               ("bytes_sent", result.bytes_sent), ("bytes_received", result.bytes_received),
                               ("peer_bytes", result.peer_bytes)):
                served.count(key, value)
            return result.response
        cause = f"; the last failed with: {last}" if last is not None else ""
        raise Unavailable(f"model '{served.spec.name}': no copy could run the batch after {MAX_ATTEMPTS} attempts{cause}")

    def _repair_task(self, served: ServedModel, *, urgent: bool) -> asyncio.Task[None]:
        """One repair at a time per model, shared by every request that needs it."""
        task = served.repair
        if task is None or task.done():
            task = served.repair = asyncio.create_task(self._reconcile(served, urgent=urgent), name=f"repair:{served.spec.name}")
            task.add_done_callback(log_task_death)
        return task

    async def _repair(self, served: ServedModel, timeout_s: float | None, *, urgent: bool = True) -> None:
        """Re-place now, waiting at most ``timeout_s``."""
        task = self._repair_task(served, urgent=urgent)
        # Not cancelled on timeout: the placement is worth finishing for later requests.
        await asyncio.wait({task}, timeout=timeout_s)

    # ---- repository ----------------------------------------------------------

    async def load(self, name: str) -> None:
        """Re-read and re-split the source, then (re)place and push what changed."""
        served = self._served[name]
        try:
            fresh = await self._prepare(served.spec, served)
        except ParallelConfigError as e:
            raise InvalidArgument(f"failed to load '{name}': {e}") from None
        async with served.lock:
            for attr in ("layout", "needed", "files", "digests", "info", "limit", "slot_steps"):
                setattr(served, attr, getattr(fresh, attr))
            served.loaded = True
            served.excluded.clear()
        await self._groups.teardown_all(served)  # the shards may have changed: groups are rebuilt on them
        await self._reconcile(served, urgent=True)

    async def unload(self, name: str) -> None:
        """Stop serving ``name``, tear its groups down and unload its shards from every worker that lists them."""
        await self._groups.teardown_all(self._served[name])
        await self._placer.unload(self._served[name])

    # ---- preparation ---------------------------------------------------------

    async def _prepare(self, spec: LogicalSpec, current: ServedModel | None) -> ServedModel:
        source_bytes, repo_config = await asyncio.to_thread(read_source, spec, self._model_repository)
        try:
            layout = await asyncio.to_thread(self._split, spec, source_bytes, repo_config)
        except ParallelConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever stops the split is this model's configuration problem
            raise ParallelConfigError(f"models.{spec.name}: cannot split {spec.source or spec.path}: {e}") from None
        files = {name: layout.result.model_bytes(name) for name in layout.result.models}
        digests = {name: hashlib.sha256(data).hexdigest()[:32] for name, data in files.items()}
        config, metadata = signature(spec, layout.plan, self._cluster.model(spec.source) if spec.source else None, repo_config)
        info = ModelInfo(spec.name, (VERSION,), config, metadata, ())
        # Derived per replica (0): one batch executing and one waiting per shard group.
        per_replica = self._max_inflight_per_replica or 2
        limit = spec.max_inflight or spec.replicas * per_replica * spec.pipeline_parallel
        steps = steps_by_slot(layout.plan) if spec.collectives == "peer" else ()
        if spec.collectives == "peer" and not steps:
            log.info("logical model %s: tensor x pipeline layouts run their collectives through the gateway", spec.name)
        served = ServedModel(spec, layout, needed_outputs(layout.plan), files, digests, info, limit, steps)
        if current is not None:
            served.placement = dict(current.placement)
        log.info("logical model %s: %s, %d shards in %d slots x %d replica group(s), max %d batches in flight",
                 spec.name, spec.summary(), len(files), len(layout.slots), spec.replicas, limit)
        return served

    @staticmethod
    def _split(spec: LogicalSpec, source: bytes, repo_config: model_config_pb2.ModelConfig | None) -> LayoutSplit:
        model = onnx.load_from_string(source)
        declared = config_shapes(repo_config) if repo_config is not None else None
        hints = spec.hints()
        if not hints and is_generation_source(repo_config):
            hints = decoder_hints(model)
        return split_layout(model, spec.tensor_parallel, spec.pipeline_parallel, name=spec.name,
                            hints=hints, declared=declared)

    # ---- placement -------------------------------------------------------------

    def _on_cluster_change(self) -> None:
        self._changed.set()
        for served in self._served.values():
            served.wake()

    async def _maintain(self) -> None:
        while True:
            # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a
            # cancel that lands as the event is set, and stop() would hang.
            waiter = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({waiter}, timeout=MAINTAIN_INTERVAL_S)
            finally:
                waiter.cancel()
            self._changed.clear()
            for served in list(self._served.values()):
                try:
                    await self._reconcile(served, urgent=False)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the upkeep loop must outlive one model's failure
                    log.exception("logical model %s: keeping its placement failed", served.spec.name)

    async def _reconcile(self, served: ServedModel, *, urgent: bool) -> None:
        if await self._placer.reconcile(served, list(self._served.values()), urgent=urgent):
            self._changed.set()  # a worker refused shards: place them elsewhere on the next round
        if served.loaded:
            await self._groups.sync(served)
