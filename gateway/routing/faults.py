"""Whose fault a batch's INTERNAL failure is: the worker's or the batch's.

An attempt the worker failed with INTERNAL is a *suspect*: the failure may be
the worker's or the batch's. It counts against no one until one confirming
attempt on another replica decides: served there, the first worker is charged
(a failure that does not reproduce is the worker's); the same failure there
makes it the request's fault (``InvalidArgument``, with the cause; no worker
charged). With no other replica, or no budget for the confirming attempt,
the call answers the INTERNAL with its cause, and no one is charged.

:class:`SuspectFailures` keeps one call's suspects; the call
(``gateway.routing.attempts.AttemptRace``) decides when to ask it.
"""

from __future__ import annotations

import logging
from typing import Generic, Protocol, TypeVar

from gateway.routing.outlier import OutlierDetector
from protos.errors import InferGateError, InvalidArgument

log = logging.getLogger(__name__)


class Worker(Protocol):
    """A replica as the router keeps it (its ``WorkerState``)."""

    @property
    def address(self) -> str: ...


_W = TypeVar("_W", bound=Worker)


class SuspectFailures(Generic[_W]):
    """The suspect failures of one call, in order, until a verdict clears them."""

    def __init__(self, model: str, outliers: OutlierDetector) -> None:
        self._model = model
        self._outliers = outliers
        self._failures: list[tuple[_W, InferGateError]] = []

    def __bool__(self) -> bool:
        return bool(self._failures)

    def add(self, worker: _W, error: InferGateError) -> None:
        self._failures.append((worker, error))

    @property
    def confirmed(self) -> bool:
        """Whether a second replica failed the batch too: time for :meth:`verdict`."""
        return len(self._failures) > 1

    @property
    def cause(self) -> InferGateError:
        """The latest suspect failure: the answer when no confirming attempt can run."""
        return self._failures[-1][1]

    def served_by(self, worker: _W) -> None:
        """Another replica served the batch: the suspect failures were their workers' own."""
        failures, self._failures = self._failures, []
        for failed, error in failures:
            if failed is worker:
                continue
            failed.failures += 1  # type: ignore[attr-defined]
            self._outliers.failed(failed.address, f"{error} (another replica served the batch)")

    def verdict(self) -> InferGateError:
        """Two replicas failed the batch: the same failure is the request's fault."""
        (first, error), (second, again) = self._failures[0], self._failures[-1]
        self._failures = []
        if type(error) is type(again) and error.message == again.message:
            log.info("model %s: the batch failed the same way on %s and %s: the request's fault: %s",
                     self._model, first.address, second.address, error)
            return InvalidArgument(f"{error.message} (the same failure on 2 replicas: the request cannot run)")
        log.warning("model %s: the batch failed differently on %s (%s) and %s (%s)",
                    self._model, first.address, error, second.address, again)
        return again
