"""The per-target probe gate: a replica back from a latency ejection takes one request at a time until it has shown
it is well, like a half-open breaker's single trial (Envoy's half-open, applied to slowness rather than errors).

Without it a returning replica gets its full share at once: under steady load several requests land on it before
the first of them has a first token, and if it is still slow every one of them is slow (measured: a replica slowed
6x on prefill, back from its first ejection, put enough 6x requests into the fleet's window to move its TTFT p95 by
several points). With the gate, a still-slow replica costs one slow request at a time until the outlier detector
has its `probe_samples` and ejects it again.

States: closed (not probing: every request may go), probing and free (the next request may go, and holds the slot),
probing and held (no request may go; routing skips the replica). The outlier detector (`dispatch/outliers.py`)
opens it when an ejection ends and closes it once the replica is judged well (or ejected again); the dispatcher
acquires the slot for an attempt and dispatch feedback releases it when the attempt ends. A slot held past
`stale_s` (an attempt whose end was never reported) is free again, so the gate can slow a replica down but never
shut it out. The clock is injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ProbeGate:
    stale_s: float = 120.0  # a held slot older than this is taken as abandoned
    probing: bool = False
    holder: str | None = None  # the attempt holding the slot (its request id)
    held_at: float = -math.inf
    probes: int = 0  # requests let through since the gate opened (for admin state)
    clock: Callable[[], float] = time.monotonic

    def open(self) -> None:
        """Probing: one request at a time from now on."""
        self.probing, self.holder, self.probes = True, None, 0

    def close(self) -> None:
        """Not probing: every request may go."""
        self.probing, self.holder = False, None

    def available(self) -> bool:
        """Whether a request may go now (routing reads this; it claims nothing)."""
        return not self.probing or self.holder is None or self.clock() - self.held_at >= self.stale_s

    def acquire(self, attempt: str) -> bool:
        """Claim the slot for one attempt (always granted when not probing)."""
        if not self.probing:
            return True
        if not self.available():
            return False
        self.holder, self.held_at = attempt, self.clock()
        self.probes += 1
        return True

    def release(self, attempt: str) -> None:
        """The attempt ended (served, failed or cancelled): the slot is free if it held it."""
        if self.holder == attempt:
            self.holder = None
