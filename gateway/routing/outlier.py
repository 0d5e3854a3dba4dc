"""Outlier ejection and a circuit breaker per worker, fed by the router.

The cluster's probes find workers that are down; this module finds workers
that are up but serve badly, from the outcome of every routed attempt:

* consecutive failures: ``consecutive_failures`` (5) failed attempts in a row
  -- errors the worker answered, broken connections, and attempts that hung
  past the router's hang threshold -- eject the worker;
* latency: a worker whose latency for a model (the median of its latest 16
  attempts) is ``latency_factor`` (3) times the median of that model's other
  replicas, and slower by at least ``latency_min_excess_s``, is ejected too.
  Latencies are compared only at the same load and batch size: each attempt
  is filed under its load -- the executions it waits out on its worker
  before its own starts (the batches there beyond the model's execution
  slots, per slot: 0, up to 1/2, 1, 2, more), its batch's rows (rounded up
  to a power of two) and the gateway's own load (the other attempts running
  in it when it started: none, up to 7, more) -- and a worker is judged
  against its peers' attempts filed alike. A worker the gateway itself loads
  (a burst queued behind its batches) is slower than an idle peer by the
  gateway's own doing, not its fault; so is one whose answers wait in a
  gateway busy taking in a burst (its event loop reads them late); a truly
  slow worker is slower than its peers at every load.

Each worker's circuit is CLOSED (in rotation), OPEN (ejected: no new
attempts) or HALF_OPEN (the ejection ran out: one trial attempt at a time;
success closes the circuit, failure opens it again). The n-th ejection lasts
``base_ejection_s * n`` (capped at ``max_ejection_s``); the count starts over
once a worker has served ``max_ejection_s`` without one, and when the cluster
sees it come back up after being down (a restarted worker starts clean).

At most ``max_ejection_percent`` of the workers that are up are ejected at
once (at least one when there are two or more, never all of them): a
detector must not take a whole model away because the cluster as a whole is
slow. The router goes further: when every replica of a model is ejected it
uses them anyway (Envoy's panic mode), so ejection only ever picks among
replicas.

Runs on the gateway's event loop only; every method is synchronous, so a
verdict and the state it reads cannot interleave with another attempt's.
The clock is injectable (``clock()`` -> monotonic seconds) for tests.
"""

from __future__ import annotations

import enum
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gateway.settings import OutlierSettings

log = logging.getLogger(__name__)

# A worker's latency for a model is the median of its latest samples: one
# slow call (a pause, a cold cache) moves it little; a slow worker moves it all.
_LATENCY_WINDOW = 16
# Judging a latency costs a few sorts: done on every few samples, not each one.
_JUDGE_EVERY = 4
# Load buckets: the executions an attempt waits out on its worker before its own, rounded up to these.
_LOAD_BUCKETS = (0.0, 0.5, 1.0, 2.0)
_MOST_LOAD = 4.0


# The gateway's own load: the other attempts running in it when an attempt started, rounded up to these.
_BESIDE_BUCKETS = (0, 7)
_MOST_BESIDE = 8
Bucket = tuple[float, int, int]


def load_bucket(queued: float, rows: int = 1, beside: int = 0) -> Bucket:
    """What an attempt is judged at: the executions it waits out first, its rows, and the other
    attempts running in the gateway (none, up to 7, more), bucketed."""
    return (next((b for b in _LOAD_BUCKETS if queued <= b), _MOST_LOAD), 1 << max(0, rows - 1).bit_length(),
            next((b for b in _BESIDE_BUCKETS if beside <= b), _MOST_BESIDE))


def _describe(bucket: Bucket) -> str:
    beside = {0: "no other attempt", 7: "up to 7 other attempts"}.get(bucket[2], "8 or more other attempts")
    return (f"batches of up to {bucket[1]} rows, waiting up to {bucket[0]:g} executions first, "
            f"{beside} in the gateway")


# Why a worker was ejected, as counted (``infergate_worker_ejections_total{reason}``).
EJECTION_REASONS = ("failures", "latency", "trial")


class CircuitState(enum.Enum):
    CLOSED = "CLOSED"  # in rotation
    OPEN = "OPEN"  # ejected until ejected_until
    HALF_OPEN = "HALF_OPEN"  # ejection over: trial attempts decide


@dataclass(frozen=True, slots=True)
class WorkerHealth:
    """A snapshot of one worker's circuit, for metrics and the dashboard."""

    address: str
    state: str
    consecutive_failures: int
    ejections: int  # ejections since the count last started over
    ejected_for_s: float  # time left in the current ejection (0 unless OPEN)
    reason: str  # why it was last ejected
    ejected_ago_s: float = 0.0  # how long ago the current ejection began (0 when CLOSED)


@dataclass(slots=True)
class _Latency:
    samples: int = 0
    window: deque[float] = field(default_factory=lambda: deque(maxlen=_LATENCY_WINDOW))

    def add(self, seconds: float) -> None:
        self.window.append(seconds)
        self.samples += 1

    def median_s(self) -> float:
        ordered = sorted(self.window)
        return ordered[len(ordered) // 2]


@dataclass(slots=True)
class _Circuit:
    address: str
    up: bool = True
    state: CircuitState = CircuitState.CLOSED
    consecutive_failures: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    ejected_at: float = 0.0
    closed_since: float = -math.inf  # when the circuit last closed after an ejection
    trials: int = 0
    reason: str = ""
    latency: dict[tuple[str, Bucket], _Latency] = field(default_factory=dict)  # by (model, load bucket)


class OutlierDetector:
    """Per-worker circuits keyed by worker address."""

    ejection_reasons = EJECTION_REASONS

    def __init__(self, settings: OutlierSettings | None = None, *, clock: Callable[[], float] | None = None) -> None:
        self.settings = settings or OutlierSettings()
        # Told of each ejection: (address, model or "", seconds): gateway.routing.outlier_trials.
        self.on_eject: Callable[[str, str, float], None] | None = None
        self._now = clock or time.monotonic
        self._circuits: dict[str, _Circuit] = {}
        # Ejections ever made, by (address, kind): kind is "failures", "latency" or "trial".
        self._ejections_total: dict[tuple[str, str], int] = {}

    # ---- membership (from the cluster) ---------------------------------------

    def sync(self, workers: Iterable[tuple[str, bool]]) -> None:
        """Follow the cluster: ``(address, is_up)`` for every worker it has.

        A worker seen coming back up after being down starts with a clean,
        closed circuit; workers no longer listed are forgotten.
        """
        seen: set[str] = set()
        for address, up in workers:
            seen.add(address)
            circuit = self._circuits.get(address)
            if circuit is None:
                self._circuits[address] = _Circuit(address, up=up)
                continue
            if up and not circuit.up:
                if circuit.state is not CircuitState.CLOSED:
                    log.info("worker %s is back up: its circuit closes", address)
                self._circuits[address] = _Circuit(address, up=True)
            else:
                circuit.up = up
        for address in [a for a in self._circuits if a not in seen]:
            del self._circuits[address]

    # ---- the hot path ---------------------------------------------------------

    def routable(self, address: str) -> bool:
        """Whether a new attempt may go to ``address`` now."""
        circuit = self._circuits.get(address)
        if circuit is None or circuit.state is CircuitState.CLOSED:
            return True
        if circuit.state is CircuitState.OPEN:
            if self._now() < circuit.ejected_until:
                return False
            self._half_open(circuit)
        return circuit.trials < self.settings.half_open_trials

    def attempt_started(self, address: str) -> bool:
        """Note an attempt sent to ``address``; True when it is a half-open trial.

        Pass the flag back to :meth:`succeeded`, :meth:`failed` or :meth:`abandoned`.
        """
        circuit = self._circuit(address)
        if circuit.state is CircuitState.OPEN and self._now() >= circuit.ejected_until:
            self._half_open(circuit)
        if circuit.state is CircuitState.HALF_OPEN:
            circuit.trials += 1
            return True
        return False

    def succeeded(self, address: str, model: str, latency_s: float | None, trial: bool = False, *,
                  queued: float = 0.0, rows: int = 1, beside: int = 0) -> None:
        """``latency_s``: None for an attempt whose time is no latency sample (a stream's first response);
        ``queued``: the executions the attempt waited out on its worker before its own; ``rows``: its
        batch's; ``beside``: the other attempts running in the gateway when it started."""
        circuit = self._circuit(address)
        if trial:
            circuit.trials -= 1
        if circuit.state is CircuitState.HALF_OPEN:
            if not trial:
                return  # an attempt from before the ejection: the trials decide
            log.info("worker %s: trial attempt succeeded; circuit closed", address)
            circuit.state = CircuitState.CLOSED
            circuit.closed_since = self._now()
        elif circuit.state is CircuitState.OPEN:
            return
        circuit.consecutive_failures = 0
        if latency_s is not None:
            self._observe_latency(circuit, model, latency_s, load_bucket(queued, rows, beside))

    def failed(self, address: str, reason: str, trial: bool = False) -> None:
        circuit = self._circuit(address)
        if trial:
            circuit.trials -= 1
        if circuit.state is CircuitState.OPEN:
            return
        if circuit.state is CircuitState.HALF_OPEN:
            if trial:
                self._eject(circuit, f"trial attempt failed: {reason}", "trial", force=True)
            return
        circuit.consecutive_failures += 1
        limit = self.settings.consecutive_failures
        if limit and circuit.consecutive_failures >= limit:
            self._eject(circuit, f"{circuit.consecutive_failures} consecutive failures, last: {reason}", "failures")

    def trial_passed(self, address: str) -> None:
        """A synthetic return trial (no model latency to file) succeeded: the circuit closes."""
        circuit = self._circuit(address)
        circuit.trials = max(0, circuit.trials - 1)
        if circuit.state is CircuitState.HALF_OPEN:
            log.info("worker %s: return trial succeeded; circuit closed", address)
            circuit.state = CircuitState.CLOSED
            circuit.closed_since = self._now()
            circuit.consecutive_failures = 0

    def abandoned(self, address: str, model: str, elapsed_s: float, trial: bool = False, *,
                  queued: float = 0.0, rows: int = 1, beside: int = 0) -> None:
        """The attempt was cancelled (a faster attempt won, or its caller left): no verdict.

        Its running time is still a lower bound of the worker's latency; a
        worker whose attempts always lose to hedges is slow, and must show it.
        """
        circuit = self._circuit(address)
        if trial:
            circuit.trials -= 1
        if circuit.state is CircuitState.CLOSED:
            self._observe_latency(circuit, model, elapsed_s, load_bucket(queued, rows, beside))

    # ---- views -------------------------------------------------------------------

    def state(self, address: str) -> CircuitState:
        circuit = self._circuits.get(address)
        return CircuitState.CLOSED if circuit is None else circuit.state

    def snapshot(self) -> list[WorkerHealth]:
        # The clock is read only when a time is shown: with every circuit closed none is.
        now = self._now() if any(c.state is not CircuitState.CLOSED for c in self._circuits.values()) else 0.0
        return [
            WorkerHealth(
                c.address, c.state.name, c.consecutive_failures, c.ejections,
                max(0.0, c.ejected_until - now) if c.state is CircuitState.OPEN else 0.0, c.reason,
                now - c.ejected_at if c.state is not CircuitState.CLOSED else 0.0,
            )
            for c in self._circuits.values()
        ]

    def ejections_total(self) -> dict[tuple[str, str], int]:
        """Ejections ever made, by (worker address, kind: failures, latency or trial); a copy."""
        return dict(self._ejections_total)

    def max_ejected(self) -> int:
        """How many of the workers that are up may be ejected at once."""
        up = sum(1 for c in self._circuits.values() if c.up)
        if up < 2:
            return 0
        share = math.floor(up * self.settings.max_ejection_percent / 100)
        return min(up - 1, max(1, share)) if self.settings.max_ejection_percent > 0 else 0

    # ---- internals -------------------------------------------------------------------

    def _circuit(self, address: str) -> _Circuit:
        circuit = self._circuits.get(address)
        if circuit is None:
            # A worker the cluster has not told us about yet (sync runs on its changes).
            circuit = self._circuits[address] = _Circuit(address)
        return circuit

    def _half_open(self, circuit: _Circuit) -> None:
        circuit.state = CircuitState.HALF_OPEN
        circuit.trials = 0
        # Judge the worker on what it does from now on, not on the samples that ejected it.
        circuit.latency.clear()
        log.info("worker %s: ejection over; trying it again", circuit.address)

    def _observe_latency(self, circuit: _Circuit, model: str, latency_s: float, bucket: Bucket) -> None:
        key = (model, bucket)
        stats = circuit.latency.get(key)
        if stats is None:
            stats = circuit.latency[key] = _Latency()
        stats.add(latency_s)
        factor, least = self.settings.latency_factor, self.settings.latency_min_samples
        if not factor or stats.samples < least or (stats.samples - least) % _JUDGE_EVERY:
            return
        peers = [  # the model's other replicas under the same load
            c.latency[key].median_s()
            for c in self._circuits.values()
            if c is not circuit and c.state is CircuitState.CLOSED and c.up
            and key in c.latency and c.latency[key].samples >= least
        ]
        if not peers:
            return
        reference = statistics.median(peers)
        mine = stats.median_s()
        if mine > factor * reference and mine - reference > self.settings.latency_min_excess_s:
            self._eject(circuit, f"latency outlier for model {model}: {mine * 1e3:.1f} ms against a median of "
                                 f"{reference * 1e3:.1f} ms on its peers at the same load ({_describe(bucket)})",
                                 "latency", model=model)

    def _eject(self, circuit: _Circuit, reason: str, kind: str, *, force: bool = False, model: str = "") -> None:
        """Open the circuit; unless ``force`` (a failed trial), only within the ejection share."""
        now = self._now()
        if not force:
            ejected = sum(1 for c in self._circuits.values() if c.up and c.state is not CircuitState.CLOSED)
            if ejected >= self.max_ejected():
                log.info("worker %s would be ejected (%s), but %d of the workers are ejected already",
                         circuit.address, reason, ejected)
                return
        if circuit.state is CircuitState.CLOSED and now - circuit.closed_since >= self.settings.max_ejection_s:
            circuit.ejections = 0  # it served well for a long time: start the count over
        circuit.ejections += 1
        duration = min(self.settings.max_ejection_s, self.settings.base_ejection_s * circuit.ejections)
        circuit.state = CircuitState.OPEN
        circuit.ejected_until = now + duration
        circuit.ejected_at = now
        key = (circuit.address, kind)
        self._ejections_total[key] = self._ejections_total.get(key, 0) + 1
        circuit.consecutive_failures = 0
        circuit.reason = reason
        log.warning("worker %s ejected for %.1fs (ejection %d): %s", circuit.address, duration, circuit.ejections, reason)
        if self.on_eject is not None:
            self.on_eject(circuit.address, model, duration)
