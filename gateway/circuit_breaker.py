"""Passive circuit breaker per replica: closed -> open after N consecutive failures -> half-open after a
cooldown (one trial request) -> closed on success, open again on failure. The clock is injected.

Blast radius: it opens only on replica-level evidence. A failure carries the fingerprint of the request body that
met it and the tenant that sent it, or None for evidence about the replica itself (connection refused, overload, a
body another replica served); N consecutive failures open the breaker only when they come from at least
`min_distinct` different sources — tenants, when known — so one tenant, replaying one bad body or sending many,
cannot close a replica to everyone. This is what protects a pool of one target (every hosted endpoint), where no
second replica can tell the body's fault from the target's. Failures the dispatcher judges the request's fault
never reach the breaker at all. `trip` opens it at once (a replica that stopped answering, `ejection.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic,
                 min_distinct: int = 2) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.min_distinct = min_distinct
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.reason = ""  # why it last opened (failures | stalled)
        self.last_success_at = float("-inf")
        self._sources: set[str] = set()  # distinct tenants (else body fingerprints) among the consecutive failures
        self._replica_level = 0  # failures that are evidence about the replica whatever the body
        self._trial_in_flight = False
        # told every transition (new state, why): the registry logs it as a `breaker` event (upstreams.py)
        self.on_change: Callable[[BreakerState, str], None] | None = None

    def _set(self, state: BreakerState, why: str) -> None:
        if state is not self.state:
            self.state = state
            if self.on_change is not None:
                self.on_change(state, why)

    def available(self) -> bool:
        """Would a request be let through now? (no side effects: routing asks this for every candidate)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return self.clock() - self.opened_at >= self.cooldown_s
        return not self._trial_in_flight

    def acquire(self) -> bool:
        """Take the slot for a request about to be sent; in half-open only one trial goes at a time."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and self.clock() - self.opened_at >= self.cooldown_s:
            self._set(BreakerState.HALF_OPEN, "cooldown over: one trial request")
        if self.state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def success(self) -> None:
        self.failures = 0
        self._sources.clear()
        self._replica_level = 0
        self._trial_in_flight = False
        self._set(BreakerState.CLOSED, "a request succeeded")
        self.last_success_at = self.clock()

    def failure(self, source: str | None = None, tenant: str | None = None) -> None:
        """One failed attempt; `source`: the body's fingerprint, None when the failure is about the replica itself;
        `tenant`: who sent that body (its failures count as one source, however many bodies)."""
        self._trial_in_flight = False
        self.failures += 1
        if source is None:
            self._replica_level += 1
        elif len(self._sources) < self.min_distinct:
            self._sources.add(f"tenant:{tenant}" if tenant is not None else source)
        distinct = self._replica_level + len(self._sources)
        if self.state is BreakerState.HALF_OPEN or (
                self.failures >= self.failure_threshold and distinct >= min(self.min_distinct, self.failure_threshold)):
            self._open("failures")

    def trip(self, reason: str) -> None:
        """Open now, whatever the count (replica-level evidence strong enough on its own)."""
        self._trial_in_flight = False
        self._open(reason)

    def release(self) -> None:
        """The request ended without a verdict on the replica (the client left, or the request was at fault)."""
        self._trial_in_flight = False

    def answered_within(self, seconds: float) -> bool:
        """Has the replica served a request successfully in the last `seconds`? (it is up for other traffic)"""
        return self.clock() - self.last_success_at <= seconds

    def _open(self, reason: str) -> None:
        self.opened_at = self.clock()
        self.reason = reason
        self._set(BreakerState.OPEN, reason)
