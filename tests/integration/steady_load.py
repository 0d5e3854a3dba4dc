"""A steady closed-loop load on a gateway for the reliability tests, with a
ledger of every request: each carries a unique id, and each answer must echo
its own id, exactly once.

Clients speak gRPC (raw KServe stubs) and HTTP (JSON) to the ``mlp`` example
model (``INPUT`` FP32 [n, 64] -> ``OUTPUT`` FP32 [n, 10]) by default, or to
any one-input, one-output model a :class:`Workload` describes (which may also
give the exact answer each request must carry). Runs on the test's event
loop; tests run blocking process control in threads meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

MODEL = "mlp"
ROW = np.linspace(-1, 1, 64, dtype=np.float32)


@dataclass(frozen=True)
class Workload:
    """What each request sends: ``row`` (one batch row) as input ``input_name`` of
    ``model``; an answer is good when its first output has ``output_row_shape``
    per row and, where ``expected_row`` is given, those values (to ``atol``)."""

    model: str
    input_name: str
    datatype: str
    row: np.ndarray
    output_row_shape: tuple[int, ...]
    expected_row: np.ndarray | None = None
    atol: float = 1e-4

    def good(self, shape: list[int], values: object, rows: int) -> bool:
        if list(shape) != [rows, *self.output_row_shape]:
            return False
        if self.expected_row is None:
            return True
        try:
            got = np.asarray(values, dtype=np.float32).reshape(shape)
        except (TypeError, ValueError):  # missing or ill-shaped values: a bad answer
            return False
        return bool(np.allclose(got, np.broadcast_to(self.expected_row, got.shape), atol=self.atol, rtol=0))


MLP = Workload(MODEL, "INPUT", "FP32", ROW, (10,))


@dataclass(frozen=True, slots=True)
class Outcome:
    request_id: str
    protocol: str
    ok: bool
    code: str  # "OK", a gRPC status name, or "HTTP <status>"
    latency_s: float
    retry_after: str | None = None
    message: str = ""


@dataclass
class Ledger:
    """Every request sent and every answer received."""

    sent: list[str] = field(default_factory=list)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    answers: Counter[str] = field(default_factory=Counter)  # echoed ids of successful answers
    duplicates: list[str] = field(default_factory=list)  # ids answered more than once
    mismatched: list[tuple[str, str]] = field(default_factory=list)  # (sent id, echoed id)

    @property
    def ok(self) -> int:
        return sum(1 for o in self.outcomes.values() if o.ok)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes.values() if not o.ok]

    def codes(self) -> Counter[str]:
        return Counter(o.code for o in self.outcomes.values())

    def check_exactly_once(self) -> None:
        assert not self.duplicates, f"answered more than once: {self.duplicates[:5]}"
        assert not self.mismatched, f"answers carrying another request's id: {self.mismatched[:5]}"
        assert len(set(self.sent)) == len(self.sent), "request ids must be unique"
        assert set(self.outcomes) == set(self.sent), "some requests got no answer at all"
        assert all(n == 1 for n in self.answers.values())
        assert set(self.answers) == {i for i, o in self.outcomes.items() if o.ok}


class SteadyLoad:
    """``grpc_clients`` + ``http_clients`` closed-loop clients, each sending the next
    request as soon as its previous one is answered, until :meth:`stop`."""

    def __init__(
        self,
        grpc_port: int,
        http_port: int,
        *,
        grpc_clients: int = 6,
        http_clients: int = 2,
        timeout_s: float = 20.0,
        rows: int = 1,
        prefix: str = "req",
        priority: int = 0,
        host: str = "127.0.0.1",
        workload: Workload = MLP,
    ) -> None:
        self._target = f"{host}:{grpc_port}"
        self._http = f"http://{host}:{http_port}"
        self._clients = [("grpc", i) for i in range(grpc_clients)] + [("http", i) for i in range(http_clients)]
        self._timeout_s = timeout_s
        self._rows = rows
        self._prefix = prefix
        self._priority = priority
        self._seq = itertools.count()
        self.ledger = Ledger()
        self._stopping = asyncio.Event()
        self._progress = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._channel: grpc.aio.Channel | None = None
        self._session: aiohttp.ClientSession | None = None
        self._workload = workload
        self._data = np.repeat(workload.row[np.newaxis], rows, axis=0)

    async def start(self) -> SteadyLoad:
        self._channel = grpc.aio.insecure_channel(self._target)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        for protocol, _ in self._clients:
            coro = self._grpc_client(stub) if protocol == "grpc" else self._http_client(self._session)
            self._tasks.append(asyncio.create_task(coro))
        return self

    async def until_ok(self, more: int, timeout_s: float = 60.0) -> None:
        """Wait until ``more`` further requests have succeeded."""
        target = self.ledger.ok + more
        deadline = time.monotonic() + timeout_s
        while self.ledger.ok < target:
            if time.monotonic() > deadline:
                raise AssertionError(f"load made no progress: {self.ledger.ok}/{target} ok, codes {self.ledger.codes()}")
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def outstanding(self) -> set[str]:
        """Requests sent and not answered yet."""
        return set(self.ledger.sent) - set(self.ledger.outcomes)

    async def until_answered(self, ids: set[str], timeout_s: float = 60.0) -> None:
        """Wait until every request in ``ids`` has its answer."""
        deadline = time.monotonic() + timeout_s
        while not ids <= self.ledger.outcomes.keys():
            missing = ids - self.ledger.outcomes.keys()
            assert time.monotonic() < deadline, f"{len(missing)} requests never answered, e.g. {sorted(missing)[:3]}"
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> Ledger:
        self._stopping.set()
        await asyncio.gather(*self._tasks)
        if self._session is not None:
            await self._session.close()
        if self._channel is not None:
            await self._channel.close()
        return self.ledger

    # ---- clients --------------------------------------------------------------

    def _next_id(self, protocol: str) -> str:
        request_id = f"{self._prefix}-{protocol}-{next(self._seq)}"
        self.ledger.sent.append(request_id)
        return request_id

    def _record(self, outcome: Outcome, echoed: str | None) -> None:
        ledger = self.ledger
        if outcome.request_id in ledger.outcomes:
            ledger.duplicates.append(outcome.request_id)
        ledger.outcomes[outcome.request_id] = outcome
        if outcome.ok:
            if echoed != outcome.request_id:
                ledger.mismatched.append((outcome.request_id, str(echoed)))
            ledger.answers[str(echoed)] += 1
            self._progress.set()

    async def _grpc_client(self, stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
        while not self._stopping.is_set():
            request_id = self._next_id("grpc")
            work = self._workload
            pb = service_pb2.ModelInferRequest(model_name=work.model, id=request_id)
            pb.inputs.add(name=work.input_name, datatype=work.datatype, shape=list(self._data.shape))
            pb.raw_input_contents.append(self._data.tobytes())
            if self._priority:
                pb.parameters["priority"].uint64_param = self._priority
            started = time.monotonic()
            try:
                call = stub.ModelInfer(pb, timeout=self._timeout_s)
                response = await call
            except grpc.aio.AioRpcError as e:
                retry_after = dict(e.trailing_metadata() or ()).get("retry-after")
                self._record(Outcome(request_id, "grpc", False, e.code().name, time.monotonic() - started,
                                     retry_after, e.details() or ""), None)
                continue
            ok = len(response.outputs) == 1 and len(response.raw_output_contents) == 1 and work.good(
                list(response.outputs[0].shape), _raw_values(response), self._rows)
            self._record(Outcome(request_id, "grpc", ok, "OK" if ok else "BAD_OUTPUT", time.monotonic() - started),
                         response.id)

    async def _http_client(self, session: aiohttp.ClientSession) -> None:
        work = self._workload
        url = f"{self._http}/v2/models/{work.model}/infer"
        data = self._data.tolist()
        while not self._stopping.is_set():
            request_id = self._next_id("http")
            body: dict[str, object] = {
                "id": request_id,
                "inputs": [{"name": work.input_name, "datatype": work.datatype, "shape": list(self._data.shape),
                            "data": data}],
            }
            if self._priority:
                body["parameters"] = {"priority": self._priority}
            started = time.monotonic()
            try:
                async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=self._timeout_s)) as r:
                    payload = await r.json(content_type=None)
                    latency = time.monotonic() - started
                    if r.status != 200:
                        self._record(Outcome(request_id, "http", False, f"HTTP {r.status}", latency,
                                             r.headers.get("Retry-After"), str(payload.get("error", ""))), None)
                        continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self._record(Outcome(request_id, "http", False, type(e).__name__, time.monotonic() - started,
                                     None, str(e)), None)
                continue
            outputs = payload.get("outputs") or [{}]
            ok = work.good(outputs[0].get("shape") or [], outputs[0].get("data"), self._rows)
            self._record(Outcome(request_id, "http", ok, "OK" if ok else "BAD_OUTPUT", latency), payload.get("id"))


def _raw_values(response: service_pb2.ModelInferResponse) -> np.ndarray:
    """The first output's values (FP32, the only output type the workloads check)."""
    if response.outputs[0].datatype != "FP32":
        return np.frombuffer(b"", dtype=np.float32)
    return np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
