"""The bench's two protocol clients, built for sending many requests cheaply.

Each client fetches the model's signature (ModelMetadata + ModelConfig) and
statistics, encodes payloads once into its wire form (:meth:`prepare`), and
sends a prepared request (:meth:`infer`) returning ``None`` on success or an
error kind (``UNAVAILABLE``, ``HTTP 503``, ``timeout``, ``connection``...).
Errors are values, not exceptions, so one failed request never stops a level.

- gRPC: a ``grpc.aio`` channel; ModelInfer goes through a raw multicallable
  with no serializers, so the request proto is serialized once, up front, and
  the response is not parsed (a status other than OK is the error).
- HTTP: one ``aiohttp`` session; bodies (JSON, or the binary tensor
  extension with ``--http-binary``) are encoded once and posted as bytes.

:class:`ServerStats` reads the statistics extension in both forms (proto and
JSON) into one record whose difference between two snapshots gives the
server-side view of a level.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from typing import Protocol as TypingProtocol

import aiohttp
import grpc
import orjson
from tritonclient.grpc import service_pb2, service_pb2_grpc

from loadtest.config import BenchConfig, BenchError, Protocol
from loadtest.inputs import ModelSignature, Payload, make_signature
from protos import codec, json_codec

log = logging.getLogger(__name__)

_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
_GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True, slots=True)
class ServerStats:
    """Cumulative statistics of one model (all its versions, or the one asked for)."""

    inference_count: int = 0  # rows
    execution_count: int = 0  # batches run
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_count: int = 0
    queue_ns: int = 0
    compute_input_count: int = 0
    compute_input_ns: int = 0
    compute_infer_count: int = 0
    compute_infer_ns: int = 0
    compute_output_count: int = 0
    compute_output_ns: int = 0

    def __sub__(self, other: ServerStats) -> ServerStats:
        return ServerStats(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    @classmethod
    def from_entries(cls, entries: Sequence[Any], version: str = "") -> ServerStats:
        """Sum ``model_stats`` entries (protos or JSON dicts), keeping ``version`` if given."""
        totals = {f.name: 0 for f in dataclasses.fields(cls)}
        for entry in entries:
            get = entry.get if isinstance(entry, Mapping) else lambda key, e=entry: getattr(e, key, None)
            if version and str(get("version") or "") != version:
                continue
            totals["inference_count"] += int(get("inference_count") or 0)
            totals["execution_count"] += int(get("execution_count") or 0)
            stats = get("inference_stats") or {}
            for name in _DURATIONS:
                duration = stats.get(name) if isinstance(stats, Mapping) else getattr(stats, name, None)
                if duration is None:
                    continue
                dget = duration.get if isinstance(duration, Mapping) else lambda key, d=duration: getattr(d, key)
                totals[f"{name}_count"] += int(dget("count") or 0)
                totals[f"{name}_ns"] += int(dget("ns") or 0)
        return cls(**totals)


class BenchClient(TypingProtocol):
    async def signature(self) -> ModelSignature: ...
    async def stats(self) -> ServerStats | None: ...
    def prepare(self, payload: Payload) -> Any: ...
    async def infer(self, prepared: Any) -> str | None: ...
    async def close(self) -> None: ...


def grpc_request_bytes(model: str, version: str, payload: Payload) -> bytes:
    """A serialized ModelInferRequest carrying the payload as raw contents."""
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    for tensor in payload:
        request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    return request.SerializeToString()


def http_body(payload: Payload, binary: bool) -> tuple[bytes, dict[str, str]]:
    """(body, extra headers) of a REST infer request: JSON tensors or the binary extension."""
    if not binary:
        try:
            inputs = [
                {"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                 "data": json_codec.raw_to_json(t.datatype, t.shape, t.raw, name=t.name)}
                for t in payload
            ]  # fmt: skip
        except codec.CodecError as exc:
            raise BenchError(f"{exc}; send it with --http-binary") from None
        return orjson.dumps({"inputs": inputs}), {"Content-Type": "application/json"}
    inputs = [
        {"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
         "parameters": {"binary_data_size": len(t.raw)}}
        for t in payload
    ]  # fmt: skip
    header = orjson.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}})
    body = header + b"".join(t.raw for t in payload)
    return body, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}


def grpc_error_kind(code: grpc.StatusCode) -> str:
    # The client's own deadline surfaces as DEADLINE_EXCEEDED: call it what it is for the user.
    return "timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED else code.name


class GrpcBenchClient:
    def __init__(self, config: BenchConfig) -> None:
        self._model = config.model
        self._version = config.model_version
        self._timeout_s = config.timeout_s
        # gRPC metadata keys must be lower case.
        self._metadata = tuple((k.lower(), v) for k, v in config.headers) or None
        self._channel = grpc.aio.insecure_channel(config.url, options=_GRPC_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._infer = self._channel.unary_unary(_INFER_METHOD)  # bytes in, bytes out
        self._seen: set[str] = set()  # error kinds already logged once

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self._timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise BenchError(f"{exc.code().name}: {exc.details()}") from None

    async def signature(self) -> ModelSignature:
        metadata = await self._call(self._stub.ModelMetadata,
                                    service_pb2.ModelMetadataRequest(name=self._model, version=self._version))
        try:
            config = await self._call(self._stub.ModelConfig,
                                      service_pb2.ModelConfigRequest(name=self._model, version=self._version))
            max_batch: int | None = config.config.max_batch_size
        except BenchError:
            max_batch = None
        return make_signature(metadata, max_batch)

    async def stats(self) -> ServerStats | None:
        try:
            response = await self._call(self._stub.ModelStatistics,
                                        service_pb2.ModelStatisticsRequest(name=self._model, version=self._version))
        except BenchError:
            return None
        return ServerStats.from_entries(response.model_stats, self._version)

    def prepare(self, payload: Payload) -> bytes:
        return grpc_request_bytes(self._model, self._version, payload)

    async def infer(self, prepared: bytes) -> str | None:
        try:
            await self._infer(prepared, timeout=self._timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            kind = grpc_error_kind(exc.code())
            if kind not in self._seen:
                self._seen.add(kind)
                log.warning("first %s error from ModelInfer: %s", kind, exc.details())
            return kind
        return None

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel, for the streaming client's calls to share."""
        return self._channel

    async def close(self) -> None:
        await self._channel.close()


class HttpBenchClient:
    def __init__(self, config: BenchConfig, binary: bool) -> None:
        self._binary = binary
        self._version = config.model_version
        base = f"http://{config.url}/v2/models/{config.model}"
        self._model_url = base + (f"/versions/{config.model_version}" if config.model_version else "")
        self._infer_url = self._model_url + "/infer"
        self._headers = dict(config.headers)
        self._seen: set[str] = set()  # error kinds already logged once
        # No connection cap: the load generator itself bounds requests in flight.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                              timeout=aiohttp.ClientTimeout(total=config.timeout_s))

    async def _get_json(self, url: str) -> Any:
        try:
            async with self._session.get(url) as resp:
                body = await resp.read()
                if resp.status != 200:
                    detail = body.decode(errors="replace")[:300]
                    raise BenchError(f"GET {url}: HTTP {resp.status} {detail}")
                return orjson.loads(body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise BenchError(f"GET {url}: {exc.__class__.__name__} {exc}") from None

    async def signature(self) -> ModelSignature:
        metadata = await self._get_json(self._model_url)
        try:
            config = await self._get_json(self._model_url + "/config")
            max_batch: int | None = int(config.get("max_batch_size", 0) or 0)
        except BenchError:
            max_batch = None
        return make_signature(metadata, max_batch)

    async def stats(self) -> ServerStats | None:
        try:
            doc = await self._get_json(self._model_url + "/stats")
        except BenchError:
            return None
        return ServerStats.from_entries(doc.get("model_stats") or [], self._version)

    def prepare(self, payload: Payload) -> tuple[bytes, dict[str, str]]:
        return http_body(payload, self._binary)

    async def infer(self, prepared: tuple[bytes, dict[str, str]]) -> str | None:
        body, headers = prepared
        try:
            async with self._session.post(self._infer_url, data=body, headers=headers) as resp:
                answer = await resp.read()
                if resp.status == 200:
                    return None
                kind, detail = f"HTTP {resp.status}", answer[:300].decode(errors="replace")
        except asyncio.TimeoutError:
            return "timeout"
        except aiohttp.ClientError as exc:
            kind, detail = "connection", f"{exc.__class__.__name__}: {exc}"
        if kind not in self._seen:
            self._seen.add(kind)
            log.warning("first %s error from infer: %s", kind, detail)
        return kind

    @property
    def session(self) -> aiohttp.ClientSession:
        """The session, for the streaming client's requests to share."""
        return self._session

    async def close(self) -> None:
        await self._session.close()


ClientFactory = Callable[[BenchConfig], BenchClient]


def make_client(config: BenchConfig) -> BenchClient:
    """The client for the configured protocol; create it inside the event loop that will use it."""
    if config.protocol is Protocol.GRPC:
        return GrpcBenchClient(config)
    return HttpBenchClient(config, binary=config.http_binary)
