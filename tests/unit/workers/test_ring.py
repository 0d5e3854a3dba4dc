"""The ring all-reduce (``workers.ring``) on an in-memory transport: N ranks
as coroutines of one event loop, messages in per-hop queues. The ring's sum
equals the plain sum, every rank ends with the same bytes, each chunk is
added in its fixed ring order whatever the delivery timing, and each rank
sends 2(N-1)/N of the tensor."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from workers.ring import chunk_bounds, ring_allreduce, sum_order


class Wire:
    """Every (hop, source, target) message, delivered after a random number of loop turns."""

    def __init__(self, seed: int) -> None:
        self._boxes: dict[tuple[int, int, int], asyncio.Future[np.ndarray]] = {}
        self._random = random.Random(seed)
        self.sent: list[tuple[int, int, int]] = []

    def _box(self, key: tuple[int, int, int]) -> asyncio.Future[np.ndarray]:
        return self._boxes.setdefault(key, asyncio.get_running_loop().create_future())

    def hops(self, rank: int) -> "RankHops":
        return RankHops(self, rank)

    async def deliver(self, key: tuple[int, int, int], chunk: np.ndarray) -> None:
        self.sent.append(key)
        copy = chunk.copy()  # the wire holds bytes, not a view the sender may change
        for _ in range(self._random.randrange(5)):
            await asyncio.sleep(0)  # reorders deliveries between ranks, not a timing wait
        self._box(key).set_result(copy)


class RankHops:
    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank = wire, rank

    async def send(self, part: int, target: int, chunk: np.ndarray) -> None:
        await self.wire.deliver((part, self.rank, target), chunk)

    async def receive(self, part: int, source: int) -> np.ndarray:
        return await self.wire._box((part, source, self.rank))


def run_ring(parts: list[np.ndarray], seed: int = 0) -> tuple[list[np.ndarray], list[int], Wire]:
    async def main() -> tuple[list[np.ndarray], list[int], Wire]:
        wire = Wire(seed)
        n = len(parts)
        done = await asyncio.gather(*(ring_allreduce(parts[r], r, n, wire.hops(r)) for r in range(n)))
        return [d[0] for d in done], [d[1] for d in done], wire

    return asyncio.run(main())


@pytest.mark.parametrize("n", [3, 4, 5])
@pytest.mark.parametrize("shape", [(1, 7, 64), (2, 3), (5,)])
def test_the_ring_sum_is_the_sum_on_every_rank_in_bytes(n: int, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(n)
    parts = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
    results, _, _ = run_ring(parts)
    np.testing.assert_allclose(results[0], np.sum(parts, axis=0), atol=1e-5, rtol=0)
    for r in results[1:]:
        assert r.shape == shape and r.dtype == np.float32
        assert r.tobytes() == results[0].tobytes()


def test_each_chunk_is_added_in_its_ring_order_whatever_the_timing() -> None:
    n = 4
    rng = np.random.default_rng(7)
    # Values whose float32 sum depends on the order of the additions.
    parts = [(rng.standard_normal((1, 33)) * 10.0 ** rng.integers(-4, 5, size=(1, 33))).astype(np.float32) for _ in range(n)]
    expected = np.empty(33, np.float32)
    for c, (start, stop) in enumerate(chunk_bounds(33, n)):
        order = sum_order(c, n)
        acc = parts[order[0]].reshape(-1)[start:stop].copy()
        for r in order[1:]:
            acc = acc + parts[r].reshape(-1)[start:stop]
        expected[start:stop] = acc
    for seed in range(5):
        results, _, _ = run_ring(parts, seed)
        for r in results:
            assert r.reshape(-1).tobytes() == expected.tobytes()


def test_each_rank_sends_its_right_neighbour_two_n_minus_one_chunks() -> None:
    n = 4
    parts = [np.ones((1, 128, 64), np.float32) * r for r in range(n)]
    results, sent, wire = run_ring(parts)
    assert float(results[2][0, 0, 0]) == 6.0
    assert sent == [2 * (n - 1) * parts[0].nbytes // n] * n  # 1.5x the tensor, not 3x as a direct exchange
    assert all(target == (source + 1) % n for _, source, target in wire.sent)
    assert sorted({part for part, _, _ in wire.sent}) == list(range(2 * (n - 1)))


def test_chunks_cover_the_tensor_when_n_does_not_divide_it() -> None:
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    results, _, _ = run_ring([np.full(2, r, np.float32) for r in range(3)])
    assert results[0].tolist() == [3.0, 3.0]
