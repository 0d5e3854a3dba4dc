"""The worker's own ``triton_python_backend_utils``: the API a Triton
Python-backend ``model.py`` imports (``import triton_python_backend_utils as
pb_utils``), implemented for models run in the worker's process.

Owns the subset real models use, with Triton's names and meanings:
``Tensor``, ``InferenceRequest`` (inputs, id, parameters as a JSON string,
requested outputs, response sender, cancellation), ``InferenceResponse``,
``InferenceResponseSender``, ``TritonError`` with its codes,
``TritonModelException``, the config helpers (``get_input_config_by_name``,
``get_output_config_by_name``, ``using_decoupled_model_transaction_policy``),
the type tables (``triton_string_to_numpy`` and friends), the BYTES
(de)serialisers, ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` and ``Logger``.

``execution.backends.python`` puts this module into ``sys.modules`` under the
name ``triton_python_backend_utils`` while Python models are loaded. What a
sender receives goes to a :class:`ResponseSink`, which that module provides:
a model may send from any thread, so a sink must be thread-safe.
"""

from __future__ import annotations

import enum
import json
import logging
import struct
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

MODULE_NAME = "triton_python_backend_utils"
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1  # accepted for compatibility; requests are released by the worker

_model_log = logging.getLogger("workers.python_model")

# --- types -------------------------------------------------------------------

TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
# Triton's numeric TRITONSERVER_DataType codes, in its order.
_NUMPY_BY_CODE: dict[int, Any] = {
    1: np.bool_, 2: np.uint8, 3: np.uint16, 4: np.uint32, 5: np.uint64, 6: np.int8, 7: np.int16,
    8: np.int32, 9: np.int64, 10: np.float16, 11: np.float32, 12: np.float64, 13: np.object_,
}  # fmt: skip
_CODE_BY_NUMPY: dict[Any, int] = {np.dtype(t) if t is not np.object_ else np.dtype(object): c for c, t in _NUMPY_BY_CODE.items()}


def triton_string_to_numpy(triton_type_string: str) -> Any:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int) -> Any:
    return _NUMPY_BY_CODE.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.type is np.bytes_:
        return 13
    return _CODE_BY_NUMPY.get(dtype)


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | None:
    """Length-prefixed (4-byte little-endian) elements in C order, as a uint8 array."""
    if input_tensor.size == 0:
        return np.empty([0], dtype=np.uint8)
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts: list[bytes] = []
    for item in input_tensor.flatten(order="C"):
        raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """The elements of a length-prefixed buffer, as a 1-D object array of bytes."""
    items: list[bytes] = []
    offset = 0
    data = bytes(encoded_tensor)
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        items.append(data[offset : offset + length])
        offset += length
    return np.array(items, dtype=np.object_)


# --- errors ------------------------------------------------------------------


class TritonError:
    """An error a model attaches to a response (or that the worker reports)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = message
        self._code = code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """What a model raises to fail its requests; also what this API raises on misuse."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self._msg = msg

    def message(self) -> str:
        return self._msg


# --- tensors, requests, responses ---------------------------------------------


class Tensor:
    """A named input or output array."""

    def __init__(self, name: str, numpy_array: np.ndarray, triton_dtype: int | None = None) -> None:
        if not isinstance(numpy_array, np.ndarray):
            raise TritonModelException(f"Tensor '{name}' needs a numpy.ndarray, got {type(numpy_array).__name__}")
        if numpy_array.dtype.type is np.str_ or numpy_array.dtype == np.void:
            raise TritonModelException(
                "Tensor dtype used for numpy_array is not support by Python backend. Please use np.object_ instead."
            )
        if triton_dtype is not None:
            wanted = triton_to_numpy_type(triton_dtype)
            if wanted is not None and numpy_array.dtype != np.dtype(wanted):
                numpy_array = numpy_array.view(wanted)
        else:
            triton_dtype = numpy_to_triton_type(numpy_array.dtype)
        self._name = name
        self._array = numpy_array
        self._triton_dtype = triton_dtype

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def triton_dtype(self) -> int | None:
        return self._triton_dtype

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, dtype={self._array.dtype}, shape={list(self._array.shape)})"


class InferenceResponse:
    """One response: output tensors, or an error."""

    def __init__(
        self, output_tensors: Sequence[Tensor] | None = None, error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:  # fmt: skip
        if output_tensors is None:
            output_tensors = []
        if not isinstance(output_tensors, (list, tuple)):
            raise TritonModelException('"output_tensors" must be a list.')
        self._outputs = list(output_tensors)
        self._error = error
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters or {})

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class ResponseSink(Protocol):
    """Where a request's responses go (``execution.backends.python`` provides it). Thread-safe."""

    def send(self, response: InferenceResponse | None, final: bool) -> None: ...

    def cancelled(self) -> bool: ...


class InferenceResponseSender:
    """Sends a decoupled request's responses; the last send carries the final flag."""

    def __init__(self, sink: ResponseSink) -> None:
        self._sink = sink
        self._lock = threading.Lock()
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(f"send() takes an InferenceResponse, not {type(response).__name__}")
        if response is None and not final:
            raise TritonModelException("Inference Response object must be provided when the response flags is not FINAL")
        with self._lock:  # two threads of one model must not both send the final response
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            self._closed = final
            self._sink.send(response, final)

    def is_cancelled(self) -> bool:
        return self._sink.cancelled()

    @property
    def closed(self) -> bool:
        return self._closed


class InferenceRequest:
    """One request handed to ``execute``."""

    def __init__(
        self,
        inputs: Sequence[Tensor],
        request_id: str = "",
        correlation_id: int | str = 0,
        requested_output_names: Sequence[str] = (),
        parameters: dict[str, Any] | str | None = None,
        sender: InferenceResponseSender | None = None,
        model_name: str = "",
        model_version: int = -1,
    ) -> None:
        self._inputs = list(inputs)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._requested_output_names = list(requested_output_names)
        self._parameters = parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        self._sender = sender
        self._model_name = model_name
        self._model_version = model_version

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def parameters(self) -> str:
        """The request's parameters as a JSON object string, as Triton gives them."""
        return self._parameters

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def flags(self) -> int:
        return 0

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException("this request has no response sender")
        return self._sender

    def is_cancelled(self) -> bool:
        return self._sender is not None and self._sender.is_cancelled()


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


# --- the model config, as the dict ``json.loads(args["model_config"])`` gives ----


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


# --- logging -----------------------------------------------------------------


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_LEVELS = {LogLevel.INFO: logging.INFO, LogLevel.WARNING: logging.WARNING, LogLevel.ERROR: logging.ERROR,
           LogLevel.VERBOSE: logging.DEBUG}  # fmt: skip


class Logger:
    """A model's log lines, written to the worker's log (logger ``workers.python_model``)."""

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        _model_log.log(_LEVELS.get(LogLevel(level), logging.INFO), "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        _model_log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        _model_log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        _model_log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        _model_log.debug("%s", message)
