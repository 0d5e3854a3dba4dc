"""One gateway child's view of its group, and its client of the others.

Every child serves the internal routes under ``PEER_PREFIX``
(``gateway.multiproc.routes``) on its own loopback peer port, nothing else,
and they answer only calls that carry the group's secret. A failed peer call
raises one of ``protos.errors``' classes: the peer's own error when it sent
one, else ``Unavailable`` naming the process that did not answer, so a
whole-gateway answer is never silently partial.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from gateway.multiproc.spec import PEER_HOST, ProcessSpec
from protos import errors
from protos.errors import InferGateError, Unavailable

PEER_PREFIX = "/internal/peer"
OUTSIDE = -1  # the index of the supervisor's client of its children: every child is another
SECRET_HEADER = "X-Infergate-Peer-Secret"
PEER_TIMEOUT_S = 30.0


def error_from_peer(status: int, body: bytes) -> InferGateError:
    """The error a peer answered with, as the same class here."""
    try:
        doc = orjson.loads(body)
        cls = getattr(errors, str(doc.get("class", "")), None)
        message = str(doc.get("error", ""))
    except (orjson.JSONDecodeError, AttributeError):
        cls, message = None, body.decode(errors="replace")[:200]
    if isinstance(cls, type) and issubclass(cls, InferGateError):
        return cls(message)
    return Unavailable(f"gateway process answered {status}: {message}")


def error_body(error: InferGateError) -> bytes:
    return orjson.dumps({"error": error.message, "class": type(error).__name__})


class ProcessGroup:
    """This child's index among N and the way to call the others."""

    def __init__(self, spec: ProcessSpec) -> None:
        self.index = spec.index
        self.size = spec.size
        self.peer_ports = spec.peer_ports
        self.peer_port = spec.peer_ports[spec.index] if spec.index != OUTSIDE else 0
        self._secret = spec.secret
        self._session: aiohttp.ClientSession | None = None

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    def others(self) -> list[int]:
        return [i for i in range(self.size) if i != self.index]

    def authorized(self, headers: Mapping[str, str]) -> bool:
        return hmac.compare_digest(headers.get(SECRET_HEADER, ""), self._secret)

    async def call(self, index: int, method: str, path: str, *, params: Mapping[str, str] | None = None,
                   body: bytes = b"", timeout_s: float = PEER_TIMEOUT_S) -> bytes:
        """``method PEER_PREFIX/path`` on child ``index``; its body, or its error raised."""
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        url = f"http://{PEER_HOST}:{self.peer_ports[index]}{PEER_PREFIX}/{path}"
        try:
            async with self._session.request(method, url, params=dict(params or {}), data=body,
                                             headers={SECRET_HEADER: self._secret},
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                payload = await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Unavailable(f"gateway process {index} did not answer: {e or type(e).__name__}") from None
        if response.status != 200:
            raise error_from_peer(response.status, payload)
        return payload

    async def gather(self, method: str, path: str, **kwargs: Any) -> list[bytes]:
        """The same call on every other child, in index order."""
        return list(await asyncio.gather(*(self.call(i, method, path, **kwargs) for i in self.others())))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
