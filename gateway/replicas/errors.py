"""The failures a replica reports beyond ``protos.errors``' classes, which the
router reads to tell a lost replica from a busy one, one going from one model,
and a request's own fault.

Every class keeps the status of its base (``Unavailable`` or
``Overloaded``), so a client that gets one sees the code it would have got
from the replica itself.
"""

from __future__ import annotations

from protos.errors import Internal, Overloaded, Unavailable


class WorkerUnreachable(Unavailable):
    """The call did not reach the replica, or its connection broke: retryable, and the replica is marked DOWN."""


class WorkerBusy(Overloaded):
    """The replica refused the call for now: its queue for the model is full
    (a refusal with a retry hint, Triton's "Exceeds maximum queue size", a
    generation backend at capacity). Retryable on another replica, and no
    fault of this one."""


class PingsRefused(WorkerBusy):
    """The worker closed the connection for too many keepalive pings (GOAWAY "too_many_pings"):
    retryable, and no fault of the worker; the channel reconnects, pinging less often."""


class RestrictedProtocol(Unavailable):
    """The worker refused a protocol group that the headers sent do not unlock
    (Triton's ``--grpc-restricted-protocol``): the worker is up, the call is not allowed."""


class ModelNotReady(Unavailable):
    """The replica has the model but not ready (Triton unloading it, or shutting down):
    retryable, and that replica should leave the model's rotation."""


class ModelControlDisabled(Unavailable):
    """The worker does not load or unload models on request (a Triton server
    without ``--model-control-mode=explicit``); it serves what it loaded at start."""


class ModelStreamError(Internal):
    """The replica ended a streamed request with an in-stream error: its words, no status code."""
