"""Bursts of concurrent calls for the burst tests, and the tally of their outcomes.

Every call sends one row of the ``mlp`` example model (``INPUT`` FP32
[1, 64] -> ``OUTPUT`` FP32 [1, 10]), one of :data:`ROWS` distinct rows, all
at once: gRPC calls over one or several channels (raw KServe stubs, so the
trailing metadata with the retry hint is visible), HTTP calls each on a
connection of its own. Each outcome is one of: served (its output checked
against the model run here with onnxruntime), refused with a retryable
status and a retry hint, or anything else (a failure of the test).

:func:`retrying_grpc_burst` is a client that honours the hint: a refused call
waits the hinted time (jittered) and tries again, until it is served.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import onnxruntime as ort
from tritonclient.grpc import service_pb2, service_pb2_grpc

MODEL = "mlp"
ROWS = 64
RETRYABLE_GRPC = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})
RETRYABLE_HTTP = frozenset({503, 429})


@dataclass(frozen=True)
class Rows:
    """The distinct input rows and the model's own output for each."""

    inputs: np.ndarray  # [ROWS, 64]
    outputs: np.ndarray  # [ROWS, 10]

    @classmethod
    def for_repository(cls, repo: Path) -> Rows:
        inputs = np.random.default_rng(7).uniform(-1, 1, (ROWS, 64)).astype(np.float32)
        session = ort.InferenceSession(str(repo / MODEL / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        (outputs,) = session.run(None, {session.get_inputs()[0].name: inputs})
        return cls(inputs, outputs)

    def correct(self, i: int, output: np.ndarray) -> bool:
        return output.shape == (1, 10) and bool(np.allclose(output[0], self.outputs[i % ROWS], rtol=1e-4, atol=1e-5))


@dataclass
class Tally:
    """Outcomes of one burst: served, refused with a hint, and everything else by kind."""

    served: int = 0
    wrong: int = 0  # served with an output that is not the model's
    refused: Counter[str] = field(default_factory=Counter)  # code: message
    no_hint: int = 0  # refused without a retry hint
    other: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return self.served + self.wrong + sum(self.refused.values()) + sum(self.other.values())

    def check(self, calls: int) -> None:
        """Every call served correctly or refused retryably with a hint; nothing else."""
        assert self.total == calls, self
        assert not self.other, f"calls neither served nor refused retryably: {self.other.most_common(5)}"
        assert self.wrong == 0, f"{self.wrong} calls served with a wrong output"
        assert self.no_hint == 0, f"{self.no_hint} refusals without a retry hint: {self.refused.most_common(3)}"
        assert self.served > 0, self


def _request(rows: Rows, i: int) -> service_pb2.ModelInferRequest:
    pb = service_pb2.ModelInferRequest(model_name=MODEL, id=str(i))
    pb.inputs.add(name="INPUT", datatype="FP32", shape=[1, 64])
    pb.raw_input_contents.append(rows.inputs[i % ROWS].tobytes())
    return pb


def _output(response: service_pb2.ModelInferResponse) -> np.ndarray:
    shape = tuple(response.outputs[0].shape)
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(shape)


async def grpc_burst(address: str, rows: Rows, calls: int, channels: int = 1) -> Tally:
    """``calls`` unary ModelInfer calls at once, spread over ``channels`` channels."""
    opened = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in opened]
    tally = Tally()

    async def one(i: int) -> None:
        try:
            response = await stubs[i % channels].ModelInfer(_request(rows, i), timeout=120)
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            if code not in RETRYABLE_GRPC:
                tally.other[f"{code}: {e.details()}"] += 1
                return
            tally.refused[f"{code}: {e.details()}"] += 1
            hint = dict(e.trailing_metadata() or ()).get("retry-after")
            tally.no_hint += 0 if hint and int(hint) >= 1 else 1
            return
        if rows.correct(i, _output(response)) and response.id == str(i):
            tally.served += 1
        else:
            tally.wrong += 1

    try:
        await asyncio.gather(*(one(i) for i in range(calls)))
    finally:
        for channel in opened:
            await channel.close()
    return tally


async def http_burst(base_url: str, rows: Rows, calls: int) -> Tally:
    """``calls`` REST infer calls at once, each on a connection of its own."""
    tally = Tally()
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one(i: int) -> None:
            body = {"id": str(i), "inputs": [
                {"name": "INPUT", "datatype": "FP32", "shape": [1, 64], "data": rows.inputs[i % ROWS].tolist()}]}
            try:
                async with session.post(f"{base_url}/v2/models/{MODEL}/infer", json=body) as r:
                    doc = await r.json()
                    hint = r.headers.get("Retry-After")
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                tally.other[f"{type(e).__name__}: {e}"] += 1
                return
            if status == 200:
                output = np.asarray(doc["outputs"][0]["data"], np.float32).reshape(doc["outputs"][0]["shape"])
                ok = rows.correct(i, output) and doc.get("id") == str(i)
                tally.served += ok
                tally.wrong += not ok
            elif status in RETRYABLE_HTTP:
                tally.refused[f"{status}: {doc.get('error')}"] += 1
                tally.no_hint += 0 if hint and int(hint) >= 1 else 1
            else:
                tally.other[f"{status}: {doc.get('error')}"] += 1

        await asyncio.gather(*(one(i) for i in range(calls)))
    return tally


async def retrying_grpc_burst(address: str, rows: Rows, calls: int, max_attempts: int = 30) -> tuple[int, Counter[str]]:
    """Every call retried after each refusal, waiting its hint (jittered); (served correctly, other outcomes)."""
    channel = grpc.aio.insecure_channel(address)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    served = 0
    other: Counter[str] = Counter()

    async def one(i: int) -> None:
        nonlocal served
        for _ in range(max_attempts):
            try:
                response = await stub.ModelInfer(_request(rows, i), timeout=120)
            except grpc.aio.AioRpcError as e:
                hint = dict(e.trailing_metadata() or ()).get("retry-after")
                if e.code().name not in RETRYABLE_GRPC or not hint:
                    other[f"{e.code().name}: {e.details()}"] += 1
                    return
                # The hint is whole seconds; spread the retries over it so they do not come back as one burst.
                await asyncio.sleep(float(hint) * random.uniform(0.2, 1.0))
                continue
            if rows.correct(i, _output(response)):
                served += 1
            else:
                other["wrong output"] += 1
            return
        other["still refused after every attempt"] += 1

    try:
        await asyncio.gather(*(one(i) for i in range(calls)))
    finally:
        await channel.close()
    return served, other


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc status")


class PeakRss:
    """Samples a process's resident memory on the event loop while a burst runs."""

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        self.pid = pid
        self.idle_mb = rss_mb(pid)
        self.peak_mb = self.idle_mb
        self._every_s = every_s
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak_mb = max(self.peak_mb, rss_mb(self.pid))
            await asyncio.sleep(self._every_s)  # a sampling period, not a wait for readiness

    async def __aenter__(self) -> PeakRss:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        self.peak_mb = max(self.peak_mb, rss_mb(self.pid))

    @property
    def growth_mb(self) -> float:
        return self.peak_mb - self.idle_mb
