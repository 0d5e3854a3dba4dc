"""A tritonclient gRPC stream for generation tests and the generation benchmark:
requests of the generation contract (``text_input``, ``max_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop``), and each request's tokens,
end and timings gathered by request id.
"""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

FINAL = "triton_final_response"


@dataclass
class Generation:
    tokens: list[bytes] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # time.monotonic() at each token's arrival
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def text(self) -> bytes:
        return b"".join(self.tokens)


def gen_inputs(prompt: str | bytes, *, max_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, seed: int | None = None, stop: list[bytes] | None = None) -> list[grpcclient.InferInput]:  # fmt: skip
    text = prompt.encode() if isinstance(prompt, str) else prompt
    tensors = []

    def add(name: str, array: np.ndarray, datatype: str) -> None:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)

    add("text_input", np.array([text], dtype=np.object_), "BYTES")
    if max_tokens is not None:
        add("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")
    if temperature is not None:
        add("temperature", np.array([temperature], dtype=np.float32), "FP32")
    if top_p is not None:
        add("top_p", np.array([top_p], dtype=np.float32), "FP32")
    if seed is not None:
        add("seed", np.array([seed], dtype=np.uint64), "UINT64")
    if stop:
        add("stop", np.array(stop, dtype=np.object_), "BYTES")
    return tensors


class GenStream:
    """One ``ModelStreamInfer`` call carrying any number of generation requests at once."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.generations: dict[str, Generation] = {}
        self.stream_errors: list[str] = []
        self._lock = threading.Lock()
        self.client.start_stream(callback=self._callback)

    def _callback(self, result: grpcclient.InferResult | None, error: InferenceServerException | None) -> None:
        now = time.monotonic()
        if error is not None:
            # An in-stream error names no request: it ends the oldest one still open.
            with self._lock:
                open_ones = [g for g in self.generations.values() if not g.done.is_set()]
            if not open_ones:
                self.stream_errors.append(error.message())
                return
            open_ones[0].error = error.message()
            open_ones[0].done.set()
            return
        assert result is not None
        response = result.get_response()
        generation = self.generations[response.id]
        if any(o.name == "text_output" for o in response.outputs):
            generation.tokens.extend(result.as_numpy("text_output").tolist())
            generation.token_times.append(now)
        if response.parameters[FINAL].bool_param:
            params = response.parameters
            generation.finish_reason = params["finish_reason"].string_param
            generation.prompt_tokens = params["prompt_tokens"].int64_param
            generation.completion_tokens = params["completion_tokens"].int64_param
            generation.done.set()

    def send(self, model: str, request_id: str, prompt: str | bytes, *, parameters: dict[str, object] | None = None,
             **options: object) -> Generation:
        generation = Generation()
        with self._lock:
            self.generations[request_id] = generation
        self.client.async_stream_infer(model, gen_inputs(prompt, **options), request_id=request_id,  # type: ignore[arg-type]
                                       parameters=parameters)
        return generation

    def generate(self, model: str, request_id: str, prompt: str | bytes, timeout_s: float = 30.0, **options: object) -> Generation:
        generation = self.send(model, request_id, prompt, **options)
        assert generation.done.wait(timeout_s), f"{request_id}: no final response within {timeout_s}s"
        return generation

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def generation_request(request_id: str, prompt: str, max_tokens: int) -> service_pb2.ModelInferRequest:
    """A raw greedy ``tiny_lm`` request run to ``max_tokens`` (``ignore_eos``), its end always marked."""
    request = service_pb2.ModelInferRequest(model_name="tiny_lm", id=request_id)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    request.parameters["ignore_eos"].bool_param = True
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    data = prompt.encode()
    request.raw_input_contents.extend([struct.pack("<I", len(data)) + data, struct.pack("<i", max_tokens)])
    return request
