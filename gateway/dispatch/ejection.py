"""Fast ejection of a replica that stops answering, from time-to-first-byte evidence across requests.

A replica is ejected (its breaker tripped, so routing skips it until the cooldown's trial) when at least
`min_requests` streamed attempts from different request bodies are overdue for their first byte on it and it has
answered nothing at all — no first byte, no response, no error — for `stall_s`. A live replica, even a loaded one,
keeps answering someone; a hung one answers no one. One slow request alone never ejects (that may be a poison body,
`quarantine.py`); a half-open trial is judged alone (the replica is already under suspicion).

"Overdue" is `stall_s` plus twice the router's predicted TTFT for that attempt, so long prefills the router expects
are not outliers. Non-streamed attempts do not count as evidence (their first byte is the whole answer) but are
failed over with the rest when the replica is ejected: every attempt waiting on it gets its first-byte wait cut short.

State is this module's, keyed by target name; it needs no background task (a timer per attempt checks). A replica
that answers, only slowly, is `outliers.py`'s (latency outlier ejection against its peers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.circuit_breaker import BreakerState
from gateway.dispatch.quarantine import BodyPrint


@dataclass(eq=False, slots=True)
class Waiting:
    target: Any
    body: BodyPrint
    stream: bool
    started: float
    overdue_after: float
    timeout: asyncio.Timeout = field(default_factory=lambda: asyncio.timeout(None))
    timer: asyncio.TimerHandle | None = None
    ejected: bool = False


class StallDetector:
    def __init__(self, stall_s: float, min_requests: int, on_eject: Callable[[Any, int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self.min_requests = min_requests
        self.on_eject = on_eject
        self.clock = clock
        self._waiting: dict[str, set[Waiting]] = {}
        self._answered: dict[str, float] = {}

    def begin(self, target: Any, body: BodyPrint, stream: bool, predicted_ttft_s: float) -> Waiting:
        w = Waiting(target, body, stream, self.clock(), self.stall_s + 2 * max(predicted_ttft_s, 0.0))
        self._waiting.setdefault(target.name, set()).add(w)
        self._answered.setdefault(target.name, w.started)  # a replica never seen is given the benefit of the doubt
        if stream:
            w.timer = asyncio.get_running_loop().call_later(w.overdue_after, self._check, target)
        return w

    def answered(self, target: Any) -> None:
        """The replica answered something (a first byte, a body, an HTTP error): it is alive."""
        self._answered[target.name] = self.clock()

    def answered_since(self, target: Any, t: float) -> bool:
        return self._answered.get(target.name, float("-inf")) > t

    def end(self, w: Waiting) -> None:
        if w.timer is not None:
            w.timer.cancel()
        ws = self._waiting.get(w.target.name)
        if ws is not None:
            ws.discard(w)

    def _check(self, target: Any) -> None:
        now = self.clock()
        ws = [w for w in self._waiting.get(target.name) or () if not w.ejected]
        if now - self._answered.get(target.name, now) < self.stall_s:
            return
        overdue = [w for w in ws if w.stream and now - w.started >= w.overdue_after]
        need = 1 if target.breaker.state is BreakerState.HALF_OPEN else self.min_requests
        if len({w.body.key for w in overdue}) < need:
            return
        loop = asyncio.get_running_loop()
        for w in ws:  # every attempt waiting on the replica fails over now, not after its first-byte timeout
            w.ejected = True
            w.timeout.reschedule(loop.time())
        self.on_eject(target, len(overdue))
