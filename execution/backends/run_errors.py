"""Whose fault a failed model execution is, and a message a user can act on.

ONNX Runtime reports every failure of ``InferenceSession.run`` as one of its
status exceptions. Some say the request itself cannot run (shapes that do
not broadcast, an index past a table, a reshape that does not fit): ONNX
Runtime raises ``InvalidArgument`` for the checks at its inputs and for many
kernels' own checks, and ``Fail`` with the kernel's message for the others.
Those answer INVALID_ARGUMENT (400), and another replica would fail the
same way. Failures of the server itself (memory, a device error, a bug)
answer INTERNAL (500), with their cause, and count against the worker.

Messages keep what ONNX Runtime tells the user and lose what it tells its
own developers: the ``[ONNXRuntimeError] : 1 : FAIL :`` prefix, source file
paths with line numbers, C++ signatures and the failed check's expression.
"""

from __future__ import annotations

import logging
import re

from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from protos.errors import InferGateError, Internal, InvalidArgument

logger = logging.getLogger(__name__)

# Messages of ONNX Runtime's ``Fail`` status that the request's content causes.
_REQUEST_FAULT = re.compile(
    r"broadcast|dimension mismatch|dimensions? (?:do not|don't) match|cannot be reshaped|shape|"
    r"out of (?:data )?(?:range|bounds)|must be within|invalid (?:rank|dim|index|indices|argument|input)|"
    r"index|indices|mismatch|incompatible|not divisible|exceeds|too (?:long|large|many)",
    re.IGNORECASE,
)
# ... unless the message is about the server's resources or devices.
_SERVER_FAULT = re.compile(
    r"allocat|out of memory|bad_alloc|\bOOM\b|CUDA|cuDNN|cuBLAS|cudaError|device|driver|"
    r"segmentation|thread pool|not enough memory",
    re.IGNORECASE,
)
_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*")
_NODE = re.compile(r"Non-zero status code returned while running (\w+) node\. Name:'([^']*)' Status Message:\s*")
# A source location (``/src/.../element_wise_ops.h:583`` or ``matmul_helper.h:59``).
_SOURCE = re.compile(r"(?:[\w.+-]*/)*[\w.+-]+\.(?:h|hpp|cc|cpp|cxx|c|cu|cuh):\d+\s*")
# A C++ signature ORT_ENFORCE puts before the check: ``void onnxruntime::X::Y(int, long)``.
_SIGNATURE = re.compile(r"^(?:[\w:<>,*&\s]+\s)?(?:\w+::)+[\w~]+\([^)]*\)(?:\s*const)?\s*")
# The failed check's expression, ``axis == 1 || axis == largest was false.``
_CHECK = re.compile(r"^.*? was false\.\s*")
# Any other absolute path (a model file, a temporary directory): only its last part is kept.
_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+([\w.+-]+)")


def clean_message(text: str) -> str:
    """ONNX Runtime's message without paths, signatures and check expressions."""
    text = _ORT_PREFIX.sub("", text.strip())
    node = ""
    match = _NODE.search(text)
    if match:
        op, name = match.groups()
        node = f"{op} node '{name}': " if name else f"{op} node: "
        text = text[match.end():]
    text = _SOURCE.sub("", text)
    text = _SIGNATURE.sub("", text)
    if _CHECK.match(text) and _CHECK.sub("", text):
        text = _CHECK.sub("", text)
    text = _PATH.sub(r"\1", text)
    text = " ".join(text.split())  # ORT's multi-line messages on one line
    return f"{node}{text}" if text else node.rstrip(": ")


def is_request_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised by ``InferenceSession.run``, is the request's own fault."""
    if isinstance(exc, ort_errors.InvalidArgument):
        return True
    text = str(exc)
    if isinstance(exc, ort_errors.RuntimeException):
        # A kernel refusing a value (a string Cast to a number that is not one).
        return not _SERVER_FAULT.search(text)
    if isinstance(exc, ort_errors.Fail):
        return bool(_REQUEST_FAULT.search(text)) and not _SERVER_FAULT.search(text)
    return False


def classify_run_error(exc: Exception, model: str = "") -> InferGateError:
    """The error a failed ``session.run`` of ``model`` answers with: INVALID_ARGUMENT or INTERNAL, with a cause."""
    if isinstance(exc, InferGateError):
        return exc
    message = clean_message(str(exc)) or type(exc).__name__
    whose = f"model '{model}': " if model else ""
    if is_request_fault(exc):
        logger.debug("model %s refused a request: %s: %s", model, type(exc).__name__, exc)
        return InvalidArgument(f"{whose}onnx runtime error: {message}")
    logger.error("model %s execution failed: %s: %s", model, type(exc).__name__, exc)
    return Internal(f"{whose}onnx runtime failed to run the model: {message}")
