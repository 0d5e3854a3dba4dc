"""A ``ModelInferRequest`` checked against one model's signature, its tensors
decoded to numpy, and numpy outputs encoded into a ``ModelInferResponse``.

Three steps, so the worker's statistics can time them apart:
:func:`check_request` (names, datatypes, shapes, batch size; cheap, before
the request waits for an instance), :func:`decode_inputs` (bytes to arrays,
zero-copy for fixed-size types; byte counts checked) and
:func:`encode_response` (outputs only in ``raw_output_contents``).
Every problem is an ``InvalidArgument`` worded like Triton's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from protos import codec, contents_codec
from protos.errors import InvalidArgument, Unsupported
from execution.repository import wire_datatype

_SHM_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str  # KServe datatype
    dims: tuple[int, ...]  # without the batch dim; -1 = any size
    optional: bool = False


@dataclass(frozen=True, slots=True)
class ModelSignature:
    """What a request to one model version may contain; built once per load."""

    name: str
    max_batch_size: int
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]

    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> ModelSignature:
        return cls(
            name=config.name,
            max_batch_size=config.max_batch_size,
            inputs={
                t.name: TensorSpec(t.name, wire_datatype(t.data_type), tuple(t.dims), t.optional) for t in config.input
            },
            outputs={t.name: TensorSpec(t.name, wire_datatype(t.data_type), tuple(t.dims)) for t in config.output},
        )

    def full_shape(self, spec: TensorSpec) -> list[int]:
        """The shape metadata reports: a leading -1 for the batch dim when batching."""
        return ([-1] if self.max_batch_size > 0 else []) + list(spec.dims)


@dataclass(frozen=True, slots=True)
class CheckedRequest:
    batch_size: int
    output_names: list[str]


def _fmt(shape: list[int] | tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def check_request(sig: ModelSignature, request: service_pb2.ModelInferRequest) -> CheckedRequest:
    """Validate names, datatypes, shapes and batch size; returns the batch size and outputs to compute."""
    model = sig.name
    seen: set[str] = set()
    batch_size: int | None = None
    for tensor in request.inputs:
        spec = sig.inputs.get(tensor.name)
        if spec is None:
            raise InvalidArgument(f"unexpected inference input '{tensor.name}' for model '{model}'")
        if tensor.name in seen:
            raise InvalidArgument(f"input '{tensor.name}' already exists in request for model '{model}'")
        seen.add(tensor.name)
        if any(p in tensor.parameters for p in _SHM_PARAMETERS):
            raise Unsupported(f"input '{tensor.name}': shared memory is not supported by this server")
        if tensor.datatype != spec.datatype:
            raise InvalidArgument(
                f"inference input '{tensor.name}' data-type is '{tensor.datatype}', but model '{model}' expects '{spec.datatype}'"
            )
        shape = list(tensor.shape)
        expected = sig.full_shape(spec)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"input '{tensor.name}' for model '{model}' has a negative dim in shape {_fmt(shape)}")
        if sig.max_batch_size > 0:
            if not shape:
                raise InvalidArgument(f"input '{tensor.name}' for model '{model}' has no batch dimension; expected {_fmt(expected)}")
            if batch_size is None:
                batch_size = shape[0]
            elif shape[0] != batch_size:
                raise InvalidArgument(
                    f"input '{tensor.name}' batch size {shape[0]} does not match the other inputs' {batch_size} for model '{model}'"
                )
        if len(shape) != len(expected) or any(e != -1 and e != d for e, d in zip(expected, shape)):
            raise InvalidArgument(
                f"unexpected shape for input '{tensor.name}' for model '{model}'. Expected {_fmt(expected)}, got {_fmt(shape)}"
            )
    missing = [name for name, spec in sig.inputs.items() if name not in seen and not spec.optional]
    if missing:
        raise InvalidArgument(
            f"expected {len(sig.inputs)} inputs but got {len(seen)} inputs for model '{model}'; "
            f"missing required input(s) {missing}"
        )
    if sig.max_batch_size > 0:
        if batch_size is None or batch_size < 1 or batch_size > sig.max_batch_size:
            raise InvalidArgument(
                f"inference request batch-size must be <= {sig.max_batch_size} for '{model}' (and >= 1), got {batch_size}"
            )
    else:
        batch_size = 1
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise InvalidArgument(
            f"raw_input_contents has {len(request.raw_input_contents)} entries for {len(request.inputs)} inputs "
            f"for model '{model}'; give one per input, in order"
        )
    names: list[str] = []
    for requested in request.outputs:
        if requested.name not in sig.outputs:
            raise InvalidArgument(f"unexpected inference output '{requested.name}' for model '{model}'")
        if "classification" in requested.parameters:
            raise Unsupported(f"output '{requested.name}': the classification extension is not supported by this server")
        if any(p in requested.parameters for p in _SHM_PARAMETERS):
            raise Unsupported(f"output '{requested.name}': shared memory is not supported by this server")
        if requested.name in names:
            raise InvalidArgument(f"output '{requested.name}' already exists in request for model '{model}'")
        names.append(requested.name)
    return CheckedRequest(batch_size=batch_size, output_names=names or list(sig.outputs))


def decode_inputs(sig: ModelSignature, request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray]:
    """Arrays of the request's inputs (call after :func:`check_request`); checks byte counts."""
    raw_contents = request.raw_input_contents
    arrays: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        shape = tuple(tensor.shape)
        if raw_contents:
            if tensor.HasField("contents"):
                raise InvalidArgument(
                    f"contents field must not be specified when using raw_input_contents for '{tensor.name}' for model '{sig.name}'"
                )
            raw: bytes = raw_contents[index]
        else:
            raw = contents_codec.contents_to_raw(tensor.datatype, shape, tensor.contents, name=tensor.name)
        arrays[tensor.name] = codec.decode(tensor.datatype, shape, raw, name=tensor.name, model=sig.name)
    return arrays


def encode_response(
    request: service_pb2.ModelInferRequest,
    version: str,
    outputs: Mapping[str, np.ndarray],
    output_names: list[str],
) -> service_pb2.ModelInferResponse:
    """The reply, each requested output in ``raw_output_contents`` in request order."""
    response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version=version, id=request.id)
    for name in output_names:
        datatype, shape, raw = codec.encode(outputs[name])
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(raw)
    return response
