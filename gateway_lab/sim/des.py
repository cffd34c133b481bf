"""Virtual-time driver: runs `Rank` schedulers on a discrete-event clock, with no HTTP and no sleeping.

Used for fast calibration checks (the Wafer table in seconds, not hours) and, later, fleet-scale routing runs.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable

from gateway_lab.sim.engine import Rank
from gateway_lab.sim.sim_request import Step


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run(self, until: float = float("inf")) -> None:
        while self._heap and self._heap[0][0] <= until:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()


class VirtualRank:
    """Drives one Rank on the event loop: whenever it is idle and something changed, plan the next forward."""

    def __init__(self, rank: Rank, loop: EventLoop) -> None:
        self.rank = rank
        self.loop = loop
        self.busy = False

    def kick(self) -> None:
        if self.busy:
            return
        step = self.rank.plan(self.loop.now)
        if step is None:
            return
        self.busy = True
        self.loop.at(self.loop.now + step.duration, functools.partial(self._done, step))

    def _done(self, step: Step) -> None:
        self.busy = False
        self.rank.complete(step, self.loop.now)
        self.kick()
