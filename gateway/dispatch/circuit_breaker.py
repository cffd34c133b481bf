"""Passive circuit breaker per replica: closed -> open after N consecutive failures -> half-open after a
cooldown (one trial request) -> closed on success, open again on failure. The clock is injected."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self._trial_in_flight = False

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
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def success(self) -> None:
        self.failures = 0
        self._trial_in_flight = False
        self.state = BreakerState.CLOSED

    def failure(self) -> None:
        self._trial_in_flight = False
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            self.state = BreakerState.OPEN
            self.opened_at = self.clock()

    def release(self) -> None:
        """The request ended without a verdict on the replica (e.g. the client left)."""
        self._trial_in_flight = False
