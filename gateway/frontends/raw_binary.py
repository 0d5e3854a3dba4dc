"""Raw binary inference requests of the REST protocol, as Triton serves them.

A request with ``Inference-Header-Content-Length: 0`` has no JSON header:
its whole body is the data of the model's one input, and every output goes
back as binary data. This module owns Triton's rules for that form, worded
as Triton words them:

- the model must have exactly one input;
- its shape is the model's: ``[1]`` for the batch dim when the model
  batches, then the config's dims, of which at most one may be variable
  (``-1``); that one is deduced from the body's size;
- a BYTES input must have the single-element shape ``[1]``: the body is that
  one element (its length prefix is added here).

A body whose size does not fit the deduced shape is then refused by the
ordinary validation ("input byte size mismatch ...").
"""

from __future__ import annotations

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.frontends.http_codec import DecodedInfer
from gateway.types import InferRequest, Tensor
from protos import codec
from protos.errors import InvalidArgument

Buffer = bytes | bytearray | memoryview


def decode_raw_request(
    body: Buffer,
    *,
    model: str,
    version: str,
    metadata: service_pb2.ModelMetadataResponse,
    config: model_config_pb2.ModelConfig,
) -> DecodedInfer:
    """The ``InferRequest`` of a raw binary body for ``model``; outputs go back binary."""
    inputs = list(config.input)
    if len(inputs) != 1 or len(metadata.inputs) != 1:
        raise InvalidArgument(
            f"Raw request must only have 1 input (found 1) to be deduced but got {len(inputs)} inputs "
            f"in '{model}' model configuration"
        )
    spec = inputs[0]
    datatype = metadata.inputs[0].datatype
    shape = [1] if config.max_batch_size > 0 else []
    variable: int | None = None
    fixed_count = 1
    for dim in spec.dims:
        if dim == -1:
            if variable is not None:
                raise InvalidArgument(
                    f"The shape of the raw input '{spec.name}' can not be deduced because there are more "
                    "than one variable-sized dimension"
                )
            variable = len(shape)
        else:
            fixed_count *= dim
        shape.append(dim)
    size = memoryview(body).nbytes
    if datatype == "BYTES":
        if variable is not None or fixed_count != 1:
            raise InvalidArgument(f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]")
        data: Buffer = size.to_bytes(4, "little") + bytes(body)
    else:
        if variable is not None:
            row_bytes = fixed_count * (codec.byte_size(datatype, [1]) or 1)
            # A size that does not divide evenly is refused by validation, as in Triton.
            shape[variable] = size // row_bytes if row_bytes else 0
        data = body
    request = InferRequest(
        model=model,
        version=version,
        id="",
        inputs=[Tensor(name=spec.name, datatype=datatype, shape=tuple(shape), data=data, parameters={})],
        outputs=[],
        parameters={},
    )
    return DecodedInfer(request=request, binary_data_output=True)
