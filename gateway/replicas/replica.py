"""What the gateway needs of a replica: the one interface every server a model
runs on is reached through.

The cluster probes a replica (liveness, readiness, its models' configs and
metadata), placement loads and unloads models on it, the statistics
extension reads it, and the router sends it requests: a batch (``infer``,
one answer) or a streamed request of a decoupled model (``stream``, any
number of answers, the last one final). Implementations:
``gateway.replicas.worker_client.WorkerClient`` (an infergate worker or a
Triton server over gRPC), ``gateway.replicas.openai_server.OpenAIServer``
(an OpenAI-protocol LLM server over HTTP) and
``gateway.replicas.local.LocalReplica`` (the models of a repository in this
process); a test may write its own in a few lines. A replica that forwards a
call's bytes unread (the relay lane) also offers :class:`Relays`. A replica that reads its
server's own queue and cache figures also offers them (:class:`ReportsLoad`):
the cluster keeps the latest with the worker, the replica choice weighs them.

Errors are ``protos.errors`` classes, with ``gateway.replicas.errors`` for
what the router must tell apart (a replica lost, busy, or dropping a model).
A stream's failure before its first response is retried elsewhere by the
router; after it, the stream ends with the error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from tritonclient.grpc import model_config_pb2, service_pb2

from protos import collective_pb2, wire
from protos.errors import Unavailable

# One response of a streamed request and when it arrived (``time.monotonic``).
StreamItem = tuple[service_pb2.ModelInferResponse, float]
InferRequest = service_pb2.ModelInferRequest | wire.RawInferRequest


class StreamSource(Protocol):
    """Something that serves streamed requests of decoupled models."""

    def stream(self, request: service_pb2.ModelInferRequest, timeout_s: float | None) -> AsyncIterator[StreamItem]:
        """Each response of ``request`` as it comes, the last one final (``protos.triton_words.is_final``).

        The caller closes the iterator when done (``contextlib.aclosing``);
        closing it before the final response cancels the request where it runs.
        Past ``timeout_s`` it raises ``DeadlineExceeded``.
        """
        ...


class Replica(StreamSource, Protocol):
    """One server of models, as the cluster, placement and the router use it."""

    address: str  # unique in the cluster: HOST:PORT, or "local"
    kind: str  # "infergate", "triton", "openai", "local"

    @property
    def closed(self) -> bool: ...

    async def infer(self, request: InferRequest, timeout_s: float | None = None) -> service_pb2.ModelInferResponse:
        """One batch's answer (``timeout_s``: the call's deadline)."""
        ...

    async def data_lane_ready(self, timeout_s: float) -> None:
        """Return once requests can be sent (a replica back from DOWN gets traffic only then)."""
        ...

    async def server_live(self, timeout_s: float | None = None) -> bool: ...

    async def server_ready(self, timeout_s: float | None = None) -> bool: ...

    async def server_metadata(self, timeout_s: float | None = None) -> service_pb2.ServerMetadataResponse: ...

    async def model_ready(self, name: str, version: str = "", timeout_s: float | None = None) -> bool: ...

    async def model_config(self, name: str, version: str = "", timeout_s: float | None = None
                           ) -> model_config_pb2.ModelConfig: ...  # fmt: skip

    async def model_metadata(self, name: str, version: str = "", timeout_s: float | None = None
                             ) -> service_pb2.ModelMetadataResponse: ...  # fmt: skip

    async def model_statistics(self, name: str = "", version: str = "", timeout_s: float | None = None
                               ) -> service_pb2.ModelStatisticsResponse: ...  # fmt: skip

    async def repository_index(self, ready: bool = False, timeout_s: float | None = None
                               ) -> list[service_pb2.RepositoryIndexResponse.ModelIndex]: ...  # fmt: skip

    async def load(self, name: str, parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
                   timeout_s: float | None = None) -> None: ...  # fmt: skip

    async def unload(self, name: str, parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
                     timeout_s: float | None = None) -> None: ...  # fmt: skip

    async def close(self, grace_s: float | None = None) -> None:
        """Release the replica; with ``grace_s``, calls in flight get that long to finish."""
        ...


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """A server's own figures of its load, as its metrics state them when last read."""

    waiting: float = 0.0  # requests queued on the server, not running yet (every client's)
    running: float = 0.0  # requests running there
    cache_usage: float = 0.0  # share of its KV cache in use, 0 to 1


@runtime_checkable
class ReportsLoad(Protocol):
    """A replica that reads its server's load (``ServerLoad``) when probed."""

    def server_load(self) -> ServerLoad | None:
        """The figures of the last probe; None when the server exposes none."""
        ...


@runtime_checkable
class Relays(Protocol):
    """A replica that takes a ``ModelInfer`` call's bytes as they came and answers with its server's bytes
    (the relay lane, ``gateway.core.relay``): a gRPC server of the KServe protocol. The local replica and
    an OpenAI-protocol server have no such method, so their models never take the lane."""

    async def relay(self, data: bytes, timeout_s: float | None = None) -> bytes:
        """The server's ``ModelInferResponse`` bytes for the ``ModelInferRequest`` bytes ``data``, unread.

        A failure is the ``protos.errors`` class of the server's status, with its words, as ``infer``'s.
        """
        ...


@runtime_checkable
class GroupMember(Protocol):
    """A replica that can hold a rank of a split model (an infergate worker): the collective calls."""

    async def setup_group(self, request: collective_pb2.SetupGroupRequest, timeout_s: float | None = None) -> None: ...

    async def teardown_group(self, request: collective_pb2.TeardownGroupRequest,
                             timeout_s: float | None = None) -> bool: ...  # fmt: skip

    async def run_group(self, request: collective_pb2.RunRequest,
                        timeout_s: float | None = None) -> collective_pb2.RunResponse: ...  # fmt: skip


def group_member(replica: Replica) -> GroupMember:
    """``replica`` as a rank of a split model; ``Unavailable`` for a replica that cannot hold one."""
    if not isinstance(replica, GroupMember):
        raise Unavailable(f"replica {replica.address} ({replica.kind}) cannot hold a rank of a split model")
    return replica
