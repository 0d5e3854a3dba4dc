"""A local replica: the models of a repository run inside the gateway process,
behind the replica interface the cluster and the router use for a remote
worker (``gateway.replicas.replica.Replica``), as vLLM's in-process engine
client stands beside its socket one.

It owns an ``execution`` model manager (repository, ONNX Runtime and the
other backends, warmup, sequences, statistics) and answers each client call
from it in-process: ``infer`` hands the batch's ``ModelInferRequest`` to the
loaded model, whose ONNX Runtime runs release the GIL on the backend's
thread pool, so the event loop keeps serving while a model computes. The
cluster probes it like any worker (ready, index, configs), placement loads
and unloads through it, statistics come from its manager: it is one more
replica in each model's rotation, under the address :data:`LOCAL_ADDRESS`
and the kind ``local``.

Errors: what the execution package raises is already a ``protos.errors``
class (a request's fault stays a 4xx); anything else becomes an INTERNAL
naming it. A model that crashes the process takes the gateway down with it:
the documented price of running in-process.

A decoupled model streams in-process too (``stream``:
``gateway.replicas.in_process``). Not served locally: collective groups
(split models run on workers).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tritonclient.grpc import model_config_pb2, service_pb2

from execution.answers import as_error, load_arguments, model_metadata
from execution.backends.base import BackendOptions, ConfigBackends, create_backend
from execution.manager import ModelManager
from execution.repository import ModelRepository
from gateway.replicas.in_process import in_process_stream
from gateway.replicas.replica import StreamItem
from gateway.settings import LocalSettings, WorkerSpec
from protos import wire
from protos.errors import DeadlineExceeded, InferGateError, Unavailable

log = logging.getLogger(__name__)

LOCAL_ADDRESS = "local"
LOCAL_KIND = "local"
SERVER_NAME = "infergate-local"
LOCAL_SPEC = WorkerSpec(address=LOCAL_ADDRESS, kind=LOCAL_KIND)
_WHERE = "the gateway's local replica"
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class LocalOptions:
    """What the local replica is built from: the repository and the execution settings."""

    repository: Path
    backend: str = "onnx"
    device: str = "auto"
    intra_op_threads: int = 0
    execution_threads: int = 0
    cpu_sessions: str = ""  # "" = the ONNX Runtime backend's default
    max_queue_size: int = 1024
    drain_timeout_s: float = 30.0

    @classmethod
    def from_settings(cls, repository: str, settings: LocalSettings, drain_timeout_s: float) -> "LocalOptions":
        return cls(Path(repository), device=settings.device, intra_op_threads=settings.intra_op_threads,
                   execution_threads=settings.execution_threads, cpu_sessions=settings.cpu_sessions,
                   max_queue_size=settings.max_queue_size, drain_timeout_s=drain_timeout_s)


class LocalReplica:
    """The models of one repository, in this process: a replica of each."""

    address = LOCAL_ADDRESS
    kind = LOCAL_KIND

    def __init__(self, options: LocalOptions) -> None:
        extra = {"cpu_sessions": options.cpu_sessions} if options.cpu_sessions else {}
        backend_options = BackendOptions(device=options.device, intra_op_threads=options.intra_op_threads,  # type: ignore[arg-type]
                                         execution_threads=options.execution_threads, extra=extra)
        self._options = options
        self._backend = create_backend(options.backend, backend_options)
        self._config_backends = ConfigBackends(backend_options)
        self._staging = Path(tempfile.mkdtemp(prefix="infergate-local-"))
        self.manager = ModelManager(ModelRepository(options.repository), self._backend, staging_root=self._staging,
                                    max_queue_size=options.max_queue_size, drain_timeout_s=options.drain_timeout_s,
                                    config_backends=self._config_backends)
        self._closed = False
        self._started = False

    def __repr__(self) -> str:
        return f"LocalReplica({str(self._options.repository)!r})"

    def describe(self) -> str:
        describe = getattr(self._backend, "describe", None)
        return describe() if callable(describe) else self._backend.name

    async def start(self) -> None:
        """Load every model of the repository; one that fails is logged and left UNAVAILABLE."""
        if self._started:
            return
        self._started = True
        names = self.manager.repository.names()
        log.info("local execution: %s; loading %d model(s) from %s", self.describe(), len(names), self._options.repository)
        await self.manager.load_all(names)

    # ---- the replica interface ------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    async def data_lane_ready(self, timeout_s: float) -> None:
        self._check_open()

    async def infer(
        self, request: service_pb2.ModelInferRequest | wire.RawInferRequest, timeout_s: float | None = None
    ) -> service_pb2.ModelInferResponse:
        self._check_open()
        message = request.to_message() if isinstance(request, wire.RawInferRequest) else request
        try:
            # No await between the lookup and infer() counting itself in flight (execution.model).
            run = self.manager.get(message.model_name, message.model_version).infer(message)
            if timeout_s is None:
                return await run
            async with asyncio.timeout(timeout_s):
                return await run
        except TimeoutError:
            raise DeadlineExceeded(f"model '{message.model_name}': no answer within {timeout_s:.3f}s") from None
        except Exception as exc:
            raise as_error(exc, "ModelInfer", _WHERE) from None

    def stream(self, request: service_pb2.ModelInferRequest, timeout_s: float | None) -> AsyncIterator[StreamItem]:
        """One streamed request of a decoupled model, run in-process (``Replica.stream``)."""
        self._check_open()
        return in_process_stream(self.manager, request, timeout_s, _WHERE)

    async def server_live(self, timeout_s: float | None = None) -> bool:
        return not self._closed

    async def server_ready(self, timeout_s: float | None = None) -> bool:
        return self._started and not self._closed

    async def server_metadata(self, timeout_s: float | None = None) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, extensions=["model_repository", "statistics"])

    async def model_ready(self, name: str, version: str = "", timeout_s: float | None = None) -> bool:
        return self.manager.is_ready(name, version)

    async def model_config(self, name: str, version: str = "", timeout_s: float | None = None
                           ) -> model_config_pb2.ModelConfig:  # fmt: skip
        return self._answer(lambda: self.manager.get(name, version).config)

    async def model_metadata(self, name: str, version: str = "", timeout_s: float | None = None
                             ) -> service_pb2.ModelMetadataResponse:  # fmt: skip
        return self._answer(lambda: model_metadata(self.manager, name, version))

    async def model_statistics(self, name: str = "", version: str = "", timeout_s: float | None = None
                               ) -> service_pb2.ModelStatisticsResponse:  # fmt: skip
        return self._answer(lambda: service_pb2.ModelStatisticsResponse(
            model_stats=self.manager.statistics(name, version)))

    async def repository_index(self, ready: bool = False, timeout_s: float | None = None
                               ) -> list[service_pb2.RepositoryIndexResponse.ModelIndex]:  # fmt: skip
        self._check_open()
        return await self.manager.index(ready)

    def serves(self, name: str) -> bool:
        """Whether a version of ``name`` is loaded here now."""
        return any(m.name == name for m in self.manager.loaded())

    async def load(self, name: str, parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
                   timeout_s: float | None = None) -> None:  # fmt: skip
        self._check_open()
        try:
            config_json, files = load_arguments(parameters or {})
            await self.manager.load(name, config_json=config_json, files=files)
        except Exception as exc:
            raise as_error(exc, "RepositoryModelLoad", _WHERE) from None

    async def unload(self, name: str, parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
                     timeout_s: float | None = None) -> None:  # fmt: skip
        self._check_open()
        try:
            await self.manager.unload(name)
        except Exception as exc:
            raise as_error(exc, "RepositoryModelUnload", _WHERE) from None

    async def close(self, grace_s: float | None = None) -> None:
        """Release every model (in-flight requests get the manager's drain time), then the backends."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.manager.close()
        finally:
            await asyncio.to_thread(self._close_backends)

    def _close_backends(self) -> None:
        self._backend.close()
        self._config_backends.close()
        shutil.rmtree(self._staging, ignore_errors=True)

    # ---- helpers -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable(f"{_WHERE} is closed")

    def _answer(self, read: Callable[[], _T]) -> _T:
        self._check_open()
        try:
            return read()
        except InferGateError:
            raise
        except Exception as exc:
            raise as_error(exc, "a model query", _WHERE) from None

