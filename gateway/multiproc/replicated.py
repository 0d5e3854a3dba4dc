"""State every process of the group holds alike: Triton's extension settings.

Three things a client changes through one process and then uses through any
other (its HTTP pool's next connection, another gRPC channel): the system
shared-memory regions (each process maps a registered region itself), the
log settings and the trace settings (global and per model). Each is the
single-process class with its ``apply*`` entry points, which both frontends
await, extended here to change every process; reads stay local, since every
process holds the same.

One order for every change: the leader's. A follower forwards the change to
the leader (``PEER_PREFIX/change``); the leader, holding one lock, applies
it to itself first, which checks it, so a refused change (``already in
manager``, ``Unable to open``, a bad value) is answered once, by the
leader, and nothing else changed; then it applies the same change on every
follower (``PEER_PREFIX/change_local``) before answering. Two clients
changing the same thing through two processes at once thus leave every
process with the same result. A follower that fails a region registration
has it rolled back everywhere (the registration is refused with that
follower's error); a settings change that a follower did not take is
reported (``Unavailable`` naming the process), and the next one applies
again everywhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import orjson

from gateway.frontends.log_settings import LogSettings
from gateway.multiproc.peers import ProcessGroup
from gateway.observability.trace_settings import TraceSettings
from gateway.requests.shared_memory import SharedMemoryRegistry
from protos.errors import InvalidArgument
from serverkit.tracing import TraceConfig

log = logging.getLogger(__name__)

Change = dict[str, Any]


class Replica(Protocol):
    def apply_local(self, change: Change, *, checked: bool) -> None:
        """Make ``change`` here; ``checked``: the leader already took it (skip checks against this process's view)."""

    def undo(self, change: Change) -> Change | None:
        """The change that takes ``change`` back, or None when it needs none."""


class Replicator:
    """Makes a change on every process of the group, in the leader's order."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self._replicas: dict[str, Replica] = {}
        self._lock = asyncio.Lock()

    def add(self, kind: str, replica: Replica) -> None:
        self._replicas[kind] = replica

    def _replica(self, kind: str) -> Replica:
        replica = self._replicas.get(kind)
        if replica is None:
            raise InvalidArgument(f"no replicated state '{kind}'")
        return replica

    async def change(self, kind: str, change: Change) -> None:
        """Make ``change`` to ``kind`` in every process; raises the change's refusal, or a process's failure."""
        if not self.group.is_leader:
            await self.group.call(0, "POST", "change", params={"kind": kind}, body=orjson.dumps(change))
            return
        # Shielded: a client that hangs up halfway must not leave the processes differing.
        await asyncio.shield(self._everywhere(kind, change))

    async def _everywhere(self, kind: str, change: Change) -> None:
        replica = self._replica(kind)
        async with self._lock:
            replica.apply_local(change, checked=False)  # refused here: refused once, nothing changed anywhere
            failures = await self._on_followers(kind, change)
            if not failures:
                return
            undo = replica.undo(change)
            if undo is not None:
                replica.apply_local(undo, checked=True)
                done = [i for i in self.group.others() if i not in failures]
                lost = await self._on_followers(kind, undo, done)
                if lost:
                    log.error("%s: undoing %s failed in processes %s: %s", kind, change, sorted(lost),
                              "; ".join(map(str, lost.values())))
            raise failures[min(failures)]

    async def _on_followers(self, kind: str, change: Change, indices: list[int] | None = None
                            ) -> dict[int, BaseException]:
        indices = self.group.others() if indices is None else indices
        body = orjson.dumps(change)
        results = await asyncio.gather(
            *(self.group.call(i, "POST", "change_local", params={"kind": kind}, body=body) for i in indices),
            return_exceptions=True)
        failures = {i: r for i, r in zip(indices, results, strict=True) if isinstance(r, BaseException)}
        for r in failures.values():
            if not isinstance(r, Exception):  # cancellation and the like: not a peer's answer
                raise r
        return failures

    def apply_local(self, kind: str, change: Change) -> None:
        """A follower's part: the leader's change, already checked there."""
        self._replica(kind).apply_local(change, checked=True)


class GroupRegions(SharedMemoryRegistry):
    """The shared-memory regions (system and CUDA), registered and unregistered in every process."""

    KIND = "shared_memory"

    def __init__(self, replicator: Replicator) -> None:
        super().__init__()
        self._replicator = replicator
        replicator.add(self.KIND, self)

    async def apply_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        await self._replicator.change(self.KIND, {"op": "register", "name": name, "key": key, "offset": offset,
                                                  "byte_size": byte_size})

    async def apply_unregister(self, name: str = "") -> None:
        await self._replicator.change(self.KIND, {"op": "unregister", "name": name})

    async def apply_register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.check_cuda_register(name, raw_handle)  # refused here (no CUDA, no handle) before any peer is asked
        await self._replicator.change(self.KIND, {"op": "register_cuda", "name": name, "raw_handle": raw_handle.hex(),
                                                  "device_id": device_id, "byte_size": byte_size})

    async def apply_unregister_cuda(self, name: str = "") -> None:
        await self._replicator.change(self.KIND, {"op": "unregister_cuda", "name": name})

    def apply_local(self, change: Change, *, checked: bool) -> None:
        op, name = change["op"], change["name"]
        if op == "register":
            self.register(name, change["key"], int(change["offset"]), int(change["byte_size"]))
        elif op == "register_cuda":
            self.register_cuda(name, bytes.fromhex(change["raw_handle"]), int(change["device_id"]),
                               int(change["byte_size"]))
        elif op == "unregister_cuda":
            self.unregister_cuda(name)
        else:
            self.unregister(name)

    def undo(self, change: Change) -> Change | None:
        undo_of = {"register": "unregister", "register_cuda": "unregister_cuda"}
        return {"op": undo_of[change["op"]], "name": change["name"]} if change["op"] in undo_of else None


class GroupLogSettings(LogSettings):
    """The log settings, updated in every process."""

    KIND = "logging"

    def __init__(self, replicator: Replicator) -> None:
        super().__init__()
        self._replicator = replicator
        replicator.add(self.KIND, self)

    async def apply(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        await self._replicator.change(self.KIND, dict(settings))
        return self.current()

    def apply_local(self, change: Change, *, checked: bool) -> None:
        self.update(change)

    def undo(self, change: Change) -> Change | None:
        return None


class GroupTraceSettings(TraceSettings):
    """The trace settings, global and per model, updated in every process."""

    KIND = "trace"

    def __init__(self, config: TraceConfig, known_model: Callable[[str], bool], replicator: Replicator) -> None:
        super().__init__(config, known_model)
        self._replicator = replicator
        replicator.add(self.KIND, self)

    async def apply(self, model: str, settings: Mapping[str, list[str] | None]) -> dict[str, Any]:
        await self._replicator.change(self.KIND, {"model": model, "settings": dict(settings)})
        return self.current(model)

    def apply_local(self, change: Change, *, checked: bool) -> None:
        if checked:  # the leader knew the model; this process may not have probed it yet
            self.assign(change["model"], change["settings"])
        else:
            self.update(change["model"], change["settings"])

    def undo(self, change: Change) -> Change | None:
        return None
