"""Recent dispatches per replica: an exponentially decayed count (time constant `tau_s`), what this instance has
sent each replica lately. Routing reads it as each candidate's `recent` feature; the policy bounds the warm choice by
it (`prefix_sla_cost`: `load_bound_factor`).

Why not the in-flight count: at a few requests per second each replica has one or two requests in flight, so a
snapshot of it is mostly noise (the cold ring's bound never binds below `ring.MIN_BOUND`), and prefix affinity then
keeps every group where it first landed. Placed by hash, 16 prompt groups on 4 replicas took 7% to 43% of the
requests each; the groups of a replica taken out of routing land on its peers the same way, and a replica back in
routing gets no group back at all (docs/results/2026-11-27-gray-failure.md). The decayed count is smooth over
`tau_s` and follows a change of placement within it.

Per instance: each gateway bounds its own traffic (with N instances each sends about 1/N of it, so the bound holds
for the sum as well). The clock is injected (the virtual-clock fleet sets its own).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

TAU_S = 20.0


class RecentDispatches:
    def __init__(self, tau_s: float = TAU_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.tau_s = tau_s
        self.clock = clock
        self._count: dict[str, tuple[float, float]] = {}  # name -> (decayed count, as of)

    def _decayed(self, name: str, now: float) -> float:
        count, at = self._count.get(name, (0.0, now))
        return count * math.exp(-max(0.0, now - at) / self.tau_s)

    def record(self, name: str) -> None:
        """One request dispatched to `name` now."""
        now = self.clock()
        self._count[name] = (self._decayed(name, now) + 1.0, now)

    def snapshot(self, names: Iterable[str]) -> dict[str, float]:
        now = self.clock()
        return {n: self._decayed(n, now) for n in names}
