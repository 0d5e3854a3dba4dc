"""The one error hierarchy of infergate.

Each class carries the HTTP status and the gRPC status code Triton uses for the
same case, and a message that is safe to show a user. Errors are converted to
wire responses only at the edges (one aiohttp middleware, one gRPC helper);
status codes coming back from workers map into the same classes through
:func:`from_grpc_code`.
"""

from __future__ import annotations

import math

import grpc


class InferGateError(Exception):
    """Base class: an error with a user-safe message and wire status codes."""

    http_status: int = 500
    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(InferGateError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class ModelNotFound(InferGateError):
    """Unknown model or version. Triton answers 400 over HTTP, NOT_FOUND over gRPC."""

    http_status = 400
    grpc_code = grpc.StatusCode.NOT_FOUND


class NotFound(InferGateError):
    """Something named in the request other than a model (e.g. a shared-memory region): Triton's 404."""

    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(InferGateError):
    http_status = 400
    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class Unavailable(InferGateError):
    """No healthy replica, model not ready, server shutting down: try again later.

    Every one carries a retry hint (HTTP Retry-After, gRPC trailing metadata;
    see :func:`retry_metadata`), so a client backs off instead of giving up.
    """

    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    retry_after_s: float = 1.0


class Overloaded(Unavailable):
    """A bounded queue is full: rejected at once, with a retry hint."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceeded(InferGateError):
    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(InferGateError):
    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(InferGateError):
    http_status = 400
    grpc_code = grpc.StatusCode.CANCELLED


class Unauthenticated(InferGateError):
    http_status = 401
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(InferGateError):
    http_status = 403
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class Unsupported(InferGateError):
    http_status = 501
    grpc_code = grpc.StatusCode.UNIMPLEMENTED


class PayloadTooLarge(InferGateError):
    http_status = 413
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Internal(InferGateError):
    """Unexpected failure: the message names the cause; the traceback is logged, never returned."""

    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL

    @classmethod
    def caused_by(cls, where: str, exc: BaseException | None, request_id: str = "") -> "Internal":
        """``where`` failed because of ``exc``: its type and message, and the request id to find the log."""
        cause = "no cause recorded" if exc is None else f"{type(exc).__name__}: {exc}".rstrip(": ")
        if len(cause) > 300:
            cause = cause[:297] + "..."
        tail = f" (request id '{request_id}'; the gateway log has the traceback)" if request_id else \
            " (the gateway log has the traceback)"
        return cls(f"internal error {where}: {cause}{tail}")


ALL_ERRORS: tuple[type[InferGateError], ...] = (
    InvalidArgument,
    ModelNotFound,
    NotFound,
    AlreadyExists,
    Unavailable,
    Overloaded,
    QuotaExceeded,
    DeadlineExceeded,
    Cancelled,
    Unauthenticated,
    PermissionDenied,
    Unsupported,
    PayloadTooLarge,
    Internal,
)

_BY_GRPC_CODE: dict[grpc.StatusCode, type[InferGateError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QuotaExceeded,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNIMPLEMENTED: Unsupported,
    grpc.StatusCode.INTERNAL: Internal,
}


def retry_metadata(error: InferGateError) -> tuple[tuple[str, str], ...]:
    """gRPC trailing metadata with the retry hint of ``error`` (``Unavailable``, ``QuotaExceeded``); () for others.

    ``retry-after`` is in whole seconds, as HTTP's Retry-After header, so both
    frontends say the same; ``grpc-retry-pushback-ms`` is what a gRPC client
    with a retry policy waits before its next attempt.
    """
    retry_after_s = getattr(error, "retry_after_s", None)
    if retry_after_s is None:
        return ()
    seconds = max(1, math.ceil(retry_after_s))
    return (("retry-after", str(seconds)), ("grpc-retry-pushback-ms", str(max(1, round(retry_after_s * 1000)))))


def from_grpc_code(code: grpc.StatusCode, message: str) -> InferGateError:
    """Map a status received from a worker (or a Triton server) to our hierarchy."""
    return _BY_GRPC_CODE.get(code, Internal)(message or code.name)
