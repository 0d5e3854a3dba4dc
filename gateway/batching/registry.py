"""The live batchers, one per (model, version), and the policy each is made with.

The core asks for a model's batcher on the model's first request and starts
one then (``start``); unloading a model closes its batchers (``close_model``),
stopping the gateway closes them all (``close_all``). ``policy_for`` is the
one place a model's ``BatchPolicy`` is chosen: the composition root hands it
in, built from the gateway config, so nothing here reads the config.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tritonclient.grpc import model_config_pb2

from gateway.batching.batcher import Batcher
from gateway.batching.policy import BatchPolicy
from gateway.batching.seams import Capacity, Dispatch

# (model name, its Triton config, whether the model's servers batch it themselves) -> its policy.
PolicyFor = Callable[[str, model_config_pb2.ModelConfig, bool], BatchPolicy]


class Batchers:
    """Batchers by (model, version); ``snapshot`` is a copy, safe to iterate while requests come and go."""

    def __init__(self, policy_for: PolicyFor) -> None:
        self._policy_for = policy_for
        self._live: dict[tuple[str, str], Batcher] = {}

    def policy(self, name: str, config: model_config_pb2.ModelConfig, *, backend_batches: bool) -> BatchPolicy:
        return self._policy_for(name, config, backend_batches)

    def get(self, name: str, version: str) -> Batcher | None:
        return self._live.get((name, version))

    async def start(self, name: str, version: str, policy: BatchPolicy, dispatch: Dispatch,
                    capacity: Capacity) -> Batcher:
        batcher = Batcher(f"{name}:{version}", policy, dispatch, capacity)
        # Registered before it starts: a request arriving meanwhile joins this batcher, not a second one.
        self._live[(name, version)] = batcher
        await batcher.start()
        return batcher

    def snapshot(self) -> dict[tuple[str, str], Batcher]:
        return dict(self._live)

    async def close_model(self, name: str, grace_s: float) -> None:
        """Close every version's batcher of ``name`` (unloaded), one after the other."""
        for key in [k for k in self._live if k[0] == name]:
            await self._live.pop(key).close(grace_s)

    async def close_all(self, grace_s: float) -> None:
        """Close every batcher at once, each letting its queued requests finish within ``grace_s``."""
        batchers = list(self._live.values())
        self._live.clear()
        if batchers:
            await asyncio.gather(*(b.close(grace_s) for b in batchers), return_exceptions=True)
