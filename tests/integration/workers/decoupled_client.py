"""A tritonclient gRPC stream for decoupled-model tests, shared by the worker's
and the real Triton server's tests: inputs of the example decoupled models,
and a stream that gathers what comes back, as (request id, outputs, final flag)
or an error message, in arrival order.

``close()`` half-closes the stream and returns once the server has ended the
call, so everything the server sent is in by then: tests count responses
after it, never after a sleep.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

FINAL = "triton_final_response"


@dataclass(frozen=True, slots=True)
class Received:
    request_id: str
    outputs: dict[str, np.ndarray]
    final: bool
    error: str | None = None


@dataclass
class Stream:
    client: grpcclient.InferenceServerClient
    received: list[Received] = field(default_factory=list)
    _arrivals: queue.Queue[Received] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        self.client.start_stream(callback=self._callback)

    def _callback(self, result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
        if error is not None:
            item = Received("", {}, True, error.message())
        else:
            assert result is not None
            response = result.get_response()
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            item = Received(response.id, outputs, response.parameters[FINAL].bool_param)
        self._arrivals.put(item)

    def send(self, model: str, inputs: dict[str, np.ndarray], request_id: str, *, empty_final: bool = True) -> None:
        self.client.async_stream_infer(model, infer_inputs(inputs), request_id=request_id,
                                       enable_empty_final_response=empty_final)

    def next(self, timeout_s: float = 10.0) -> Received:
        item = self._arrivals.get(timeout=timeout_s)
        self.received.append(item)
        return item

    def until_final(self, request_id: str, timeout_s: float = 10.0) -> list[Received]:
        """Responses until ``request_id``'s final one (or an error), others kept in ``received``."""
        deadline = time.monotonic() + timeout_s
        mine: list[Received] = []
        while True:
            item = self.next(max(0.0, deadline - time.monotonic()))
            if item.request_id == request_id or item.error is not None:
                mine.append(item)
                if item.final:
                    return mine

    def close(self, cancel: bool = False) -> list[Received]:
        """End the stream (cancelling the call with ``cancel``); everything received, in order."""
        self.client.stop_stream(cancel_requests=cancel)
        while not self._arrivals.empty():
            self.received.append(self._arrivals.get_nowait())
        return self.received


_DATATYPES = {np.dtype(np.int32): "INT32", np.dtype(np.uint32): "UINT32"}


def infer_inputs(inputs: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), _DATATYPES[array.dtype])
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def square(n: int) -> dict[str, np.ndarray]:
    return {"IN": np.array([n], dtype=np.int32)}


def repeat(values: list[int], delay_ms: int | list[int] = 0, wait_ms: int = 0) -> dict[str, np.ndarray]:
    delays = delay_ms if isinstance(delay_ms, list) else [delay_ms] * len(values)
    return {
        "IN": np.array(values, dtype=np.int32),
        "DELAY": np.array(delays, dtype=np.uint32),
        "WAIT": np.array([wait_ms], dtype=np.uint32),
    }


def by_request(received: list[Received]) -> dict[str, list[Received]]:
    grouped: dict[str, list[Received]] = {}
    for item in received:
        grouped.setdefault(item.request_id, []).append(item)
    return grouped


def assert_square_answer(received: list[Received], request_id: str, n: int, empty_final: bool) -> None:
    """``n`` responses of OUT = n, none final; then one empty final response if asked for."""
    data = [r for r in received if r.outputs]
    assert [r.request_id for r in received] == [request_id] * len(received)
    assert len(data) == n
    for r in data:
        assert list(r.outputs) == ["OUT"] and r.outputs["OUT"].dtype == np.int32
        assert r.outputs["OUT"].tolist() == [n] and not r.final
    empties = [r for r in received if not r.outputs]
    assert empties == ([Received(request_id, {}, True)] if empty_final else [])
    if empties:
        assert received[-1] == empties[0]  # the empty final response comes last
