"""What the streaming tests share: inputs of ``square_int32`` and ``repeat_int32``, one
tritonclient gRPC stream that collects every response, and polls of a process's
/metrics (each a condition with a deadline, never a fixed sleep), and the
gateway's per-worker generation gauges.

Used by ``test_stream_gateway.py``, ``test_stream_faults.py``,
``test_stream_triton.py`` and ``test_stream_multiproc.py``.
"""

from __future__ import annotations

import queue
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Proc, worker_url

WAIT_S = 20.0


def square_inputs(n: int) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([n], np.int32))
    return [tensor]


def repeat_inputs(values: list[int], delay_ms: int | list[int] = 0, wait_ms: int = 0) -> list[grpcclient.InferInput]:
    delays = delay_ms if isinstance(delay_ms, list) else [delay_ms] * len(values)
    arrays = {"IN": np.array(values, np.int32), "DELAY": np.array(delays, np.uint32), "WAIT": np.array([wait_ms], np.uint32)}
    tensors = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "INT32" if name == "IN" else "UINT32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


@dataclass
class Received:
    """One response (or in-stream error) as the client saw it."""

    id: str
    values: list[int] | None  # OUT, None for an empty response
    index: int | None  # IDX (repeat_int32)
    final: bool | None  # triton_final_response, None when absent
    error: str | None = None


class Stream:
    """One tritonclient gRPC stream to ``url``; every response lands in ``got`` as it comes."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self._queue: queue.Queue[Received] = queue.Queue()
        self.got: list[Received] = []
        self.client.start_stream(callback=self._callback, headers=headers)

    def _callback(self, result: grpcclient.InferResult | None, error: Exception | None) -> None:
        if error is not None:
            self._queue.put(Received("", None, None, None, str(error)))
            return
        response = result.get_response()
        names = {o.name for o in response.outputs}
        final = response.parameters.get("triton_final_response")
        self._queue.put(Received(
            response.id,
            result.as_numpy("OUT").tolist() if "OUT" in names else None,
            int(result.as_numpy("IDX")[0]) if "IDX" in names else None,
            final.bool_param if final is not None else None,
        ))

    def send(self, model: str, inputs: list[grpcclient.InferInput], request_id: str, *,
             empty_final: bool = False, timeout_us: int | None = None) -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=empty_final,
                                       timeout=timeout_us)

    def wait_for(self, condition: Callable[[list[Received]], bool], timeout_s: float = WAIT_S) -> list[Received]:
        """Take responses until ``condition(got)`` holds."""
        deadline = time.monotonic() + timeout_s
        while not condition(self.got):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"condition not met within {timeout_s} s; got {self.got}")
            try:
                self.got.append(self._queue.get(timeout=left))
            except queue.Empty:
                pass
        return self.got

    def finish(self, cancel: bool = False) -> list[Received]:
        """Half-close (or cancel) and wait for the stream to end; every response received."""
        self.client.stop_stream(cancel_requests=cancel)
        while True:
            try:
                self.got.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self.client.close()
        return self.got

    def of(self, request_id: str) -> list[Received]:
        return [r for r in self.got if r.id == request_id]


def metric_values(url: str, name: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every sample of family ``name`` on ``http://URL/metrics``: labels text -> value."""
    request = urllib.request.Request(f"http://{url}/metrics", headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            found[m.group(1) or ""] = float(m.group(2))
    return found


def metric(url: str, name: str, label: str = "", headers: dict[str, str] | None = None) -> float:
    """The sum of the samples of ``name`` whose labels contain ``label``."""
    return sum(v for k, v in metric_values(url, name, headers).items() if label in k)


# The gateway's generation gauges per worker and model (``infergate_generation_worker_*``).
WORKER_GAUGES = ("sequences_running", "sequences_waiting", "cache_bytes", "cache_reserved_bytes")


def figures(proc: Proc, worker: str, model: str = "tiny_lm") -> dict[str, float]:
    """The gateway's generation gauges for ``model`` on ``worker`` (empty before the first poll)."""
    text = requests.get(f"http://127.0.0.1:{proc.ready['http_port']}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("infergate_generation_worker_") and s.labels == {"worker": worker, "model": model}:
                out[s.name.removeprefix("infergate_generation_worker_")] = s.value
    return out


def poll(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Wait until ``condition()`` holds, checking every 50 ms (a condition with a deadline, not a sleep)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)


def repeat_request(request_id: str, values: list[int], delay_ms: int, *, empty_final: bool = False
                   ) -> service_pb2.ModelInferRequest:
    """A raw ``repeat_int32`` request: ``values`` back one a response, ``delay_ms`` apart."""
    request = service_pb2.ModelInferRequest(model_name="repeat_int32", id=request_id)
    if empty_final:
        request.parameters["triton_enable_empty_final_response"].bool_param = True
    arrays = {"IN": np.array(values, np.int32), "DELAY": np.full(len(values), delay_ms, np.uint32),
              "WAIT": np.array([0], np.uint32)}
    for name, array in arrays.items():
        request.inputs.add(name=name, datatype="INT32" if name == "IN" else "UINT32", shape=list(array.shape))
        request.raw_input_contents.append(array.tobytes())
    return request


@dataclass
class GatewayCluster:
    """Workers and a gateway in front of them, started by a test's fixture."""

    workers: list[Proc]
    gateway: Proc

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['grpc_port']}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['http_port']}"

    def inflight(self, worker: Proc) -> float:
        """What the gateway counts in flight on ``worker`` (its streams included)."""
        return metric(self.http_url, "infergate_worker_inflight_batches", f'worker="{worker_url(worker)}"')

