"""Which targets queued requests wait for, on every gateway instance: the cross-instance half of `gate.Pass`.

Within one instance, a request the fleet has no room for is passed over and the requests behind it in the fair order
go only on *other* targets than the one it waits for (its decision's first choice), so its replica drains for it.
Each instance keeps its own queue, though: without this board, an instance whose queue holds only a tenant over its
share keeps feeding that replica with its requests up to the gate's bound, while another instance's request of a
tenant under its share waits for it to drain — and with cold prompts whose own prefill is most of the SLA, it can
wait until it is late. On the virtual clock with two instances the noisy neighbour's victim fell from 99.1% to
96.8% of the requests that can meet its SLA (`gateway replay --noisy ... --instances 2`; docs/flow-control.md).

So each instance publishes, after each pass, the targets its passed-over requests wait for with the most urgent
waiter's place in the fair order (its band and its flow's start tag), and before a request goes on a target the
gate asks whether another instance has a request *ahead* of it waiting there (a higher band, or the same band and a
smaller start tag: a tenant under its share is ahead of one over it; a tenant is never ahead of itself). An entry
lives `ttl_s` unless published again: an instance that stopped, or whose request went, stops blocking the target
soon after. The board is one object per process in the virtual-clock fleet and a Redis hash between gateways
(`shared.RedisFairTags`: `publish_waits`, read by `refresh`), merged into the same object before each pass.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.flow.controller import FairTags, Ticket

TTL_S = 0.5  # a pump passes every tick_s (0.02 s) while it has anything queued: many times within this


@dataclass(frozen=True, slots=True)
class Wait:
    band: int
    start: float  # the waiting flow's start tag when published
    until: float  # the board's clock: not believed after this


class WaitBoard:
    def __init__(self, ttl_s: float = TTL_S) -> None:
        self.ttl_s = ttl_s
        self._by: dict[str, dict[str, Wait]] = {}  # instance -> target -> its most urgent waiter there

    def publish(self, instance: str, waits: dict[str, tuple[int, float]], now: float) -> dict[str, Wait]:
        """Replace `instance`'s entries with `waits` (target -> (band, start tag)); returns them as stored."""
        mine = {target: Wait(band, start, now + self.ttl_s) for target, (band, start) in waits.items()}
        if mine:
            self._by[instance] = mine
        else:
            self._by.pop(instance, None)
        return mine

    def merge(self, instance: str, waits: dict[str, Wait]) -> None:
        """Another instance's entries as read from the shared store (replacing what was known of it)."""
        if waits:
            self._by[instance] = waits
        else:
            self._by.pop(instance, None)

    def others(self, instance: str) -> set[str]:
        return {i for i in self._by if i != instance}

    def ahead(self, target: str, band: int, start: float, instance: str, now: float) -> bool:
        """Another instance has a request ahead of (band, start) in the fair order waiting for `target`."""
        for inst, waits in self._by.items():
            if inst == instance:
                continue
            w = waits.get(target)
            if w is not None and w.until >= now and (w.band, w.start) < (band, start):
                return True
        return False

    def waiting_elsewhere(self, instance: str, targets: Collection[str], now: float) -> int:
        """How many of `targets` another instance has requests waiting for (counted once per instance)."""
        return sum(1 for inst, waits in self._by.items() if inst != instance
                   for target in targets if (w := waits.get(target)) is not None and w.until >= now)

    def elsewhere(self, instance: str, tags: FairTags, now: float) -> Callable[[str, Ticket], bool]:
        """`gate.Pass`'s question for `instance`: does another instance have a request ahead of a ticket (its flow's
        start tag in `tags`) waiting for a target."""
        return lambda target, t: self.ahead(target, t.band, tags.start(t.band, t.tenant), instance, now)
