"""``infergate bench --streaming``: what a decoupled model's requests and responses are.

The mode's own part of the timed stream clients (``loadtest.stream_clients``):

- gRPC: the payload as a ``ModelInferRequest`` of raw contents with
  ``triton_enable_empty_final_response`` set; every response carrying
  outputs is a response.
- HTTP: the generate extension's body, each input by name with its values as
  a flat JSON list; every server-sent event carrying an output (a member
  other than the model's name, version, id and parameters) is a response.
  (Each event is one ``data:`` line, as Triton and the gateway send them.)
"""

from __future__ import annotations

import functools
from typing import Any

import orjson
from tritonclient.grpc import service_pb2

from loadtest.config import BenchConfig, BenchError, Protocol
from loadtest.inputs import Payload
from loadtest.stream_clients import EMPTY_FINAL, GrpcStreamClient, HttpStreamClient, StreamBenchClient, generate_events
from protos import codec, json_codec

# Members of a generate response that are not outputs.
_GENERATE_META = frozenset({"model_name", "model_version", "id", "parameters"})


def grpc_stream_request_bytes(model: str, version: str, payload: Payload, request_id: str = "") -> bytes:
    """A serialized ModelInferRequest for a stream: raw contents, empty final response enabled."""
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for tensor in payload:
        request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    request.parameters[EMPTY_FINAL].bool_param = True
    return request.SerializeToString()


def generate_body(payload: Payload) -> bytes:
    """The generate extension's request: each input by name, its values as a flat JSON list."""
    try:
        doc = {t.name: json_codec.raw_to_json(t.datatype, t.shape, t.raw, name=t.name) for t in payload}
    except codec.CodecError as exc:
        raise BenchError(f"{exc}: the generate endpoint takes JSON values only") from None
    return orjson.dumps(doc)


def is_data_event(doc: dict[str, Any]) -> bool:
    return any(key not in _GENERATE_META for key in doc)


def make_stream_client(config: BenchConfig) -> StreamBenchClient:
    """The streaming client for the configured protocol; create it inside the loop that uses it."""
    if config.protocol is Protocol.GRPC:
        return GrpcStreamClient(
            config, functools.partial(grpc_stream_request_bytes, config.model, config.model_version))
    return HttpStreamClient(config, generate_body, generate_events(is_data_event))
