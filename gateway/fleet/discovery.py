"""Workers found through DNS: every address of a name is a worker.

For Kubernetes headless services, whose name resolves to the address of
each ready pod: ``--worker-dns NAME:PORT`` (``triton://NAME:PORT`` for
Triton servers). Each name is resolved at start and every ``refresh_s``
through the event loop's resolver (``getaddrinfo``, all families);
addresses that appear join the cluster, addresses that disappear leave it
(unless another source, static or registration, still names them). A
failed lookup keeps the last answer: a DNS hiccup must not empty the
cluster, and workers that are really gone fail their probes anyway.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from gateway.fleet.membership import Membership, dns_source
from gateway.settings import WorkerSpec
from serverkit.tasks import log_task_death

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_all(host: str, port: int) -> list[str]:
    """Every ``HOST:PORT`` (``[V6]:PORT``) address ``host`` resolves to, sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(found)


@dataclass(frozen=True, slots=True)
class DnsName:
    text: str  # as configured
    host: str
    port: int
    kind: str

    @classmethod
    def parse(cls, text: str) -> DnsName:
        spec = WorkerSpec.parse(text)  # validates HOST:PORT and reads the kind prefix
        host, _, port = spec.address.rpartition(":")
        return cls(text, host.strip("[]"), int(port), spec.kind)


class DnsDiscovery:
    def __init__(self, membership: Membership, names: Sequence[str], *, refresh_s: float = 10.0,
                 resolver: Resolver = resolve_all, timeout_s: float = 5.0) -> None:
        self._membership = membership
        self._names = [DnsName.parse(n) for n in names]
        self._refresh_s = refresh_s
        self._resolver = resolver
        self._timeout_s = timeout_s
        self._found: dict[str, set[str]] = {n.text: set() for n in self._names}
        self._task: asyncio.Task[None] | None = None

    def addresses(self) -> dict[str, list[str]]:
        return {name: sorted(found) for name, found in self._found.items()}

    async def start(self) -> None:
        """Resolve every name once (workers found join before this returns), then keep resolving."""
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="dns-discovery")
        self._task.add_done_callback(log_task_death)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        await asyncio.gather(*(self._refresh_one(name) for name in self._names))

    async def _refresh_one(self, name: DnsName) -> None:
        try:
            addresses = set(await asyncio.wait_for(self._resolver(name.host, name.port), self._timeout_s))
        except (OSError, asyncio.TimeoutError) as e:  # socket.gaierror is an OSError
            log.warning("DNS lookup of %s failed (%s); keeping its %d known address(es)",
                        name.text, e or "timed out", len(self._found[name.text]))
            return
        known = self._found[name.text]
        added, gone = sorted(addresses - known), sorted(known - addresses)
        if not added and not gone:
            return
        self._found[name.text] = addresses
        source = dns_source(name.text)
        if added:
            log.info("DNS %s: %d new worker address(es): %s", name.text, len(added), ", ".join(added))
        await asyncio.gather(*(self._membership.join(WorkerSpec(a, kind=name.kind), source) for a in added))
        for address in gone:
            log.info("DNS %s no longer lists %s", name.text, address)
            await self._membership.leave(address, source)
