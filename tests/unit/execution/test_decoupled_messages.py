"""serve_decoupled's messages: each response's outputs, whatever the one before it held.

A plain response (no parameters, not final) is written as a copy of the last
plain one with new contents when its outputs have the same names, types and
shapes; any difference must give the message the general encoding gives.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
from tritonclient.grpc import service_pb2

from execution.backends.base import StreamEvent
from execution.decoupled import serve_decoupled
from execution.tensors import encode_response


class _Model:
    """What serve_decoupled reads of a loaded model: its version and the stream of one request."""

    version_str = "3"

    def __init__(self, events: list[StreamEvent]) -> None:
        self._events = events

    async def stream(self, request: service_pb2.ModelInferRequest) -> AsyncIterator[StreamEvent]:
        for event in self._events:
            yield event


def _expected(request: service_pb2.ModelInferRequest, event: StreamEvent) -> service_pb2.ModelStreamInferResponse:
    response = encode_response(request, "3", event.outputs, list(event.outputs))
    for key, value in event.parameters.items():
        response.parameters[key].string_param = str(value)
    response.parameters["triton_final_response"].bool_param = event.final
    return service_pb2.ModelStreamInferResponse(infer_response=response)


async def test_each_message_holds_its_own_outputs_when_shapes_names_and_types_change() -> None:
    events = [
        StreamEvent({"OUT": np.array([1], dtype=np.int32)}, False),
        StreamEvent({"OUT": np.array([2], dtype=np.int32)}, False),  # same shape: the copied form
        StreamEvent({"OUT": np.array([3, 4], dtype=np.int32)}, False),  # longer
        StreamEvent({"OUT": np.array([5.0], dtype=np.float32)}, False),  # another type
        StreamEvent({"OTHER": np.array([6], dtype=np.int32)}, False),  # another name
        StreamEvent({"OTHER": np.array([7], dtype=np.int32), "OUT": np.array([8], dtype=np.int32)}, False),
        StreamEvent({"OUT": np.array([b"token"], dtype=np.object_)}, False),
        StreamEvent({"OUT": np.array([b"longer token"], dtype=np.object_)}, False),  # BYTES of another size
        StreamEvent({"OUT": np.array([9], dtype=np.int32)}, True),
    ]
    request = service_pb2.ModelInferRequest(model_name="m", id="req-1")
    written: list[service_pb2.ModelStreamInferResponse] = []

    async def write(message: service_pb2.ModelStreamInferResponse) -> None:
        written.append(message)

    assert await serve_decoupled(_Model(events), request, write) == len(events)  # type: ignore[arg-type]
    assert written == [_expected(request, event) for event in events]
    assert written[7].infer_response.raw_output_contents[0] == b"\x0c\x00\x00\x00longer token"


def test_an_in_stream_error_names_its_status_and_tritons_names_none() -> None:
    import grpc

    from execution.decoupled import stream_error_code, stream_error_response
    from protos.errors import InvalidArgument, Unavailable

    request = service_pb2.ModelInferRequest(model_name="tiny_lm", model_version="1", id="r7")
    ours = stream_error_response(request, InvalidArgument("prompt of 601 tokens exceeds the context"))
    assert ours.error_message == "prompt of 601 tokens exceeds the context"
    assert (ours.infer_response.model_name, ours.infer_response.id) == ("tiny_lm", "r7")
    assert stream_error_code(ours) is grpc.StatusCode.INVALID_ARGUMENT
    assert stream_error_code(stream_error_response(request, Unavailable("unloading"))) is grpc.StatusCode.UNAVAILABLE
    tritons = service_pb2.ModelStreamInferResponse(error_message="boom", infer_response=service_pb2.ModelInferResponse(id="r7"))
    assert stream_error_code(tritons) is None
    ours.infer_response.parameters["infergate_error_code"].string_param = "NOT_A_STATUS"
    assert stream_error_code(ours) is None
