"""The gateway's client for one OpenAI-protocol LLM server (vLLM, SGLang,
llama.cpp, ``transformers serve``): a ``gateway.replicas.replica.Replica``
over HTTP (aiohttp), ``--worker openai://HOST:PORT``.

What the cluster reads of it: readiness from ``GET /health`` (``GET
/v1/models`` where there is none), its models from ``GET /v1/models`` (every
id it lists, LoRA adapters included) or from the names its config entry
gives, each presented as a generative model (``openai_contract.model_config``:
the same contract as an infergate worker's Hugging Face export, so both
serve one name in one pool), and, on each readiness probe, its load from
``GET /metrics`` where it exposes vLLM's or SGLang's figures
(:meth:`OpenAIServer.server_load`; a server that answers no metrics is not
asked again).

A stream (``stream``) is one streamed OpenAI call (``openai_contract.openai_call``);
each SSE event becomes its responses as it arrives, the call's end one final
response with the server's usage. An embeddings request is one
``/v1/embeddings`` call: its answer is one response, then the final one. Closing the stream early closes its
connection, which stops the generation on the server.

Failures, as the router reads them: a refused, reset or timed-out
connection, or one cut mid-stream, is ``WorkerUnreachable`` (the server is
marked down); 502, 503 and 504 are ``Unavailable`` (retried elsewhere,
counted by the outlier detector); 500 is ``Internal`` (a suspect: one
confirming try elsewhere tells the server's fault from the request's); 429
is ``WorkerBusy`` (load, not a fault). Any other 4xx is the request's fault,
raised as the ``protos.errors`` class of its status with the server's own
words, charged to no one.

Unary inference, loads and unloads are not served: such a server generates
text and loads what it was started with (``ModelControlDisabled``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import orjson
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.replicas.errors import ModelControlDisabled, WorkerBusy, WorkerUnreachable
from gateway.replicas.openai_contract import (EMBEDDINGS_PATH, ChunkReader, embedding_response, final_response,
                                              model_config, model_metadata, openai_call)
from gateway.replicas.replica import ServerLoad, StreamItem
from gateway.replicas.server_metrics import server_load
from gateway.settings import WorkerSpec
from protos.errors import (DeadlineExceeded, InferGateError, Internal, InvalidArgument, ModelNotFound, NotFound,
                           PayloadTooLarge, PermissionDenied, Unauthenticated, Unavailable, Unsupported)

log = logging.getLogger(__name__)

DEFAULT_MAX_STREAMS = 64
VERSION = "1"  # the one version a model of such a server has
CONNECT_TIMEOUT_S = 5.0
_CLIENT_ERRORS = {400: InvalidArgument, 401: Unauthenticated, 403: PermissionDenied, 404: NotFound,
                  413: PayloadTooLarge, 422: InvalidArgument}


def _message(body: bytes) -> str:
    """The server's words in an error answer: OpenAI's ``error.message``, FastAPI's ``detail``, or the text."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace").strip()[:1000]
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("detail", "message", "error"):
            if doc.get(key):
                return str(doc[key]) if not isinstance(doc[key], (list, dict)) else orjson.dumps(doc[key]).decode()
    return body.decode("utf-8", "replace").strip()[:1000]


class OpenAIServer:
    """Async client for the OpenAI-protocol server at ``address`` (``HOST:PORT``).

    ``headers`` go with every call; ``api_key`` as ``Authorization: Bearer``;
    ``models``: the names it serves, in place of its model list;
    ``max_streams``: the streams the gateway opens on it at once.
    """

    kind = "openai"

    @classmethod
    def for_spec(cls, spec: WorkerSpec) -> "OpenAIServer":
        """The client of a ``workers`` entry of kind ``openai``."""
        return cls(spec.address, headers=dict(spec.headers), api_key=spec.api_key, models=spec.models,
                   max_streams=spec.max_streams)

    def __init__(self, address: str, *, headers: Mapping[str, str] | None = None, api_key: str = "",
                 models: tuple[str, ...] = (), max_streams: int = 0, scheme: str = "http") -> None:
        self.address = address
        self._base = f"{scheme}://{address}"
        self._headers = dict(headers or {})
        if api_key:
            self._headers.setdefault("authorization", f"Bearer {api_key}")
        self._models = tuple(models)
        self._max_streams = max_streams or DEFAULT_MAX_STREAMS
        self._listed: tuple[str, ...] = self._models
        self._load: ServerLoad | None = None
        self._metrics = True  # until the server answers that it has none
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"OpenAIServer({self.address!r})"

    @property
    def closed(self) -> bool:
        return self._closed

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            raise WorkerUnreachable(f"server {self.address}: client closed")
        if self._session is None:
            # Made on first use, on the loop that uses it; no limit on connections: the router bounds the streams.
            self._session = aiohttp.ClientSession(headers=self._headers, connector=aiohttp.TCPConnector(limit=0),
                                                  auto_decompress=True)
        return self._session

    def _timeout(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        connect = CONNECT_TIMEOUT_S if timeout_s is None else min(CONNECT_TIMEOUT_S, timeout_s)
        return aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect)

    def error(self, status: int, message: str, retry_after: str | None = None, what: str = "") -> InferGateError:
        """What an answer of ``status`` from the server means (the one place that decides); a
        request's fault keeps the server's words as they are (``what``: the call, for a 404)."""
        words = f"server {self.address} answered {status}: {message}"
        if status == 429:
            try:
                hint = max(0.001, float(retry_after)) if retry_after else 1.0
            except ValueError:
                hint = 1.0
            return WorkerBusy(words, retry_after_s=hint)
        if status == 500:
            return Internal(words)
        if status >= 500:
            return Unavailable(words)
        if status == 404 and "model" in message.lower():
            return ModelNotFound(message)
        if status == 404 and what:
            return NotFound(f"{what}: {message}")  # a route the server lacks (no /v1/completions)
        return _CLIENT_ERRORS.get(status, InvalidArgument)(message)

    def _lost(self, exc: BaseException, what: str) -> InferGateError:
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return WorkerUnreachable(f"server {self.address}: no connection within {CONNECT_TIMEOUT_S:g}s ({what})")
        if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
            return DeadlineExceeded(f"server {self.address}: {what} timed out")
        return WorkerUnreachable(f"server {self.address} unreachable ({what}): {type(exc).__name__}: {exc}")

    async def _get(self, path: str, timeout_s: float | None) -> tuple[int, bytes]:
        try:
            async with self._client().get(self._base + path, timeout=self._timeout(timeout_s)) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._lost(exc, f"GET {path}") from None

    # ---- health and models ------------------------------------------------------

    async def server_live(self, timeout_s: float | None = None) -> bool:
        return await self.server_ready(timeout_s)

    async def server_ready(self, timeout_s: float | None = None) -> bool:
        status, _ = await self._get("/health", timeout_s)
        if status in (404, 405):  # no health route: a model list answered is readiness
            status, body = await self._get("/v1/models", timeout_s)
            if status == 200:
                self._read_list(body)
        if status != 200:
            return False
        if self._metrics:
            await self._read_metrics(timeout_s)
        return True

    async def _read_metrics(self, timeout_s: float | None) -> None:
        status, body = await self._get("/metrics", timeout_s)
        if status == 404:
            self._metrics = False  # it has none; the chooser does with the gateway's own counts
            self._load = None
            return
        self._load = server_load(body.decode("utf-8", "replace")) if status == 200 else None

    def server_load(self) -> ServerLoad | None:
        """Queue and cache figures from the server's metrics at the last probe (None: it exposes none)."""
        return self._load

    def _read_list(self, body: bytes) -> None:
        if self._models:
            return
        try:
            doc = orjson.loads(body)
            self._listed = tuple(str(m["id"]) for m in doc["data"] if isinstance(m, dict) and m.get("id"))
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise Unavailable(f"server {self.address}: GET /v1/models answered no model list ({exc})") from None

    async def _names(self, timeout_s: float | None) -> tuple[str, ...]:
        if self._models:
            return self._models
        status, body = await self._get("/v1/models", timeout_s)
        if status != 200:
            raise self.error(status, _message(body))
        self._read_list(body)
        return self._listed

    async def server_metadata(self, timeout_s: float | None = None) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name="openai", version="", extensions=[])

    async def repository_index(self, ready: bool = False, timeout_s: float | None = None
                               ) -> list[service_pb2.RepositoryIndexResponse.ModelIndex]:  # fmt: skip
        return [service_pb2.RepositoryIndexResponse.ModelIndex(name=name, version=VERSION, state="READY")
                for name in await self._names(timeout_s)]

    async def model_ready(self, name: str, version: str = "", timeout_s: float | None = None) -> bool:
        return name in await self._names(timeout_s) and version in ("", VERSION)

    def _served(self, name: str) -> None:
        if name not in self._listed:
            raise ModelNotFound(f"server {self.address} does not serve model '{name}'")

    async def model_config(self, name: str, version: str = "", timeout_s: float | None = None
                           ) -> model_config_pb2.ModelConfig:  # fmt: skip
        self._served(name)
        return model_config(name, self._max_streams)

    async def model_metadata(self, name: str, version: str = "", timeout_s: float | None = None
                             ) -> service_pb2.ModelMetadataResponse:  # fmt: skip
        self._served(name)
        return model_metadata(model_config(name, self._max_streams), [VERSION])

    async def model_statistics(self, name: str = "", version: str = "", timeout_s: float | None = None
                               ) -> service_pb2.ModelStatisticsResponse:  # fmt: skip
        return service_pb2.ModelStatisticsResponse()  # the server keeps its own; the gateway's are its stats page

    async def load(self, name: str, parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
                   timeout_s: float | None = None) -> None:  # fmt: skip
        raise ModelControlDisabled(f"server {self.address} (OpenAI protocol) serves the models it was started "
                                   "with: load / unload is not allowed")

    async def unload(self, name: str, parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
                     timeout_s: float | None = None) -> None:  # fmt: skip
        await self.load(name, parameters, timeout_s)

    async def data_lane_ready(self, timeout_s: float) -> None:
        return None  # one connection pool serves probes and streams

    # ---- inference ----------------------------------------------------------------

    async def infer(self, request: Any, timeout_s: float | None = None) -> service_pb2.ModelInferResponse:
        raise Unsupported(f"server {self.address} (OpenAI protocol) serves streamed generation only")

    async def stream(self, request: service_pb2.ModelInferRequest,
                     timeout_s: float | None) -> AsyncIterator[StreamItem]:  # fmt: skip
        """Each response of ``request`` as the server's chunks come, the last one final (``Replica.stream``)."""
        path, body = openai_call(request, request.model_name)
        reader = ChunkReader(request, self.error)
        what = f"POST {path} of request '{request.id}'"
        try:
            async with self._client().post(self._base + path, data=orjson.dumps(body),
                                           headers={"content-type": "application/json"},
                                           timeout=self._timeout(timeout_s)) as response:
                if response.status != 200:
                    raise self.error(response.status, _message(await response.read()),
                                     response.headers.get("retry-after"), f"server {self.address}, POST {path}")
                if path == EMBEDDINGS_PATH:  # one answer, not streamed
                    answer, prompt_tokens = embedding_response(request, await response.read(), self.error)
                    yield answer, time.monotonic()
                    yield final_response(request, None, prompt_tokens, None), time.monotonic()
                    return
                ended = False
                try:
                    if response.content_type != "text/event-stream":  # a whole answer, streamed or not
                        doc = orjson.loads(await response.read())
                        for item in reader.chunk(doc if isinstance(doc, dict) else {}):
                            yield item, time.monotonic()
                    else:
                        async for data in _events(response.content):
                            for item in reader.event(data):
                                yield item, time.monotonic()
                            if reader.done:
                                break
                    ended = True
                finally:
                    if not ended:
                        # Closed early (the caller left, a stop string) or failed: dropping the
                        # connection is what stops the generation on the server.
                        response.close()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise self._lost(exc, what) from None
        except orjson.JSONDecodeError as exc:
            raise self.error(502, f"the answer to {what} is not JSON: {exc}") from None
        yield reader.final(), time.monotonic()

    # ---- lifecycle ------------------------------------------------------------------

    async def close(self, grace_s: float | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The data of each Server-Sent Event as it completes (its ``data:`` lines joined)."""
    data: list[bytes] = []
    async for line in content:
        line = line.rstrip(b"\r\n")
        if not line:
            if data:
                yield b"\n".join(data)
                data = []
        elif line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
        # other fields (event:, id:, retry:) and comments (":") carry nothing a response needs
    if data:
        yield b"\n".join(data)
