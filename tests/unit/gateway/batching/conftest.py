"""The ``rig`` fixture of the Batcher tests: builds started rigs and checks, after the test, that
every request was answered and no dispatch went past the backend's capacity."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.batching.batcher import BatchPolicy
from tests.unit.gateway.batching.fakes import Rig


@pytest.fixture
async def rig():
    rigs: list[Rig] = []

    async def make(slots: int = 1, room: int | None = None, **policy: Any) -> Rig:
        policy.setdefault("max_batch_size", 8)
        r = Rig(slots, BatchPolicy(**policy), room)
        await r.batcher.start()
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        await r.batcher.close(0)
        assert all(t.done() for t in r.tasks.values())
        for t in r.tasks.values():
            if not t.cancelled():
                t.exception()  # retrieved: the test looked at the ones it cares about
        assert r.backend.over_capacity == 0
