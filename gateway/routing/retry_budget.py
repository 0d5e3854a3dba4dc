"""How much the router may retry: a retry budget and a jittered backoff.

:class:`RetryBudget` keeps retries from amplifying an outage. Every extra
attempt (a retry after a failure, a hedge, a speculative attempt beside a
call that hangs) needs a token, and the tokens out at once are bounded by a
share of the routed calls in flight (``budget_percent``, 20 by default) or a
small floor (``min_concurrency``) when few calls run. When every replica
fails, the first attempts fail and at most that many retries follow: the
load on the cluster grows by a bounded fraction, not by ``retry.limit``
times. A call denied a token gives up with its last error.

:class:`Backoff` spaces retries: full jitter, a random wait in
``[0, min(max_s, base_s * 2**(n-1)))`` before the n-th retry, so callers that
failed together do not come back together.

Both are plain counters on the gateway's one event loop: no locks, and no
await between checking a budget and taking its token.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

from gateway.settings import RetrySettings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BudgetCounters:
    """A snapshot for metrics: calls and extra attempts in flight, tokens granted and denied."""

    active: int
    extra_inflight: int
    granted: int
    denied: int


class RetryBudget:
    """Bounds extra attempts in flight to ``max(min_concurrency, budget_percent% of active calls)``.

    The router calls :meth:`call_started` / :meth:`call_finished` around every
    routed call, and :meth:`try_acquire` / :meth:`release` around every extra
    attempt. A token is held while its attempt runs (as Envoy's retry budget
    counts active retries), not for a time window.
    """

    def __init__(self, budget_percent: float = 20.0, min_concurrency: int = 3) -> None:
        if not 0 <= budget_percent <= 100 or min_concurrency < 0:
            raise ValueError("budget_percent must be within 0..100 and min_concurrency >= 0")
        self._ratio = budget_percent / 100.0
        self._floor = min_concurrency
        self._active = 0
        self._extra = 0
        self._granted = 0
        self._denied = 0

    @classmethod
    def from_settings(cls, settings: RetrySettings) -> RetryBudget:
        return cls(settings.budget_percent, settings.min_concurrency)

    def call_started(self) -> None:
        self._active += 1

    def call_finished(self) -> None:
        self._active -= 1

    def limit(self) -> int:
        """Extra attempts allowed in flight right now."""
        return max(self._floor, math.floor(self._active * self._ratio))

    def try_acquire(self, *, failover: bool = False) -> bool:
        """Take a token for one extra attempt; False when the budget is spent.

        A ``failover`` (the batch's replica left the model's rotation) always
        gets one: it moves work off a replica that is going rather than adding
        load, and each such failure takes its replica out, so they are bounded
        by the replicas. Its token still counts while its attempt runs.
        """
        if self._extra >= self.limit() and not failover:
            self._denied += 1
            return False
        self._extra += 1
        self._granted += 1
        return True

    def release(self) -> None:
        """Return a token taken by :meth:`try_acquire` (its attempt ended)."""
        if self._extra <= 0:
            raise RuntimeError("retry budget released more tokens than it granted")
        self._extra -= 1

    def counters(self) -> BudgetCounters:
        return BudgetCounters(self._active, self._extra, self._granted, self._denied)


class Backoff:
    """Full-jitter exponential backoff: before retry n, wait U(0, min(max_s, base_s * 2**(n-1)))."""

    def __init__(self, base_s: float = 0.025, max_s: float = 0.25, rng: random.Random | None = None) -> None:
        if base_s < 0 or max_s < base_s:
            raise ValueError("backoff needs 0 <= base_s <= max_s")
        self.base_s = base_s
        self.max_s = max_s
        self._rng = rng or random.Random()

    def ceiling_s(self, retry: int) -> float:
        """The longest wait before retry number ``retry`` (1 = the first retry)."""
        if retry < 1:
            return 0.0
        # min() before the power would overflow a float for absurd retry counts.
        return min(self.max_s, self.base_s * 2 ** min(retry - 1, 60))

    def delay_s(self, retry: int) -> float:
        ceiling = self.ceiling_s(retry)
        return self._rng.uniform(0.0, ceiling) if ceiling > 0 else 0.0
