"""Preemption (`flow.preemption`): a request of a higher band that the fleet has no room for may cancel lower bands'
requests that were sent but have not sent their first byte; they go back to their queue (`FlowController.requeue`:
their place kept, not charged twice), never lost.

Why: prefill is not preemptive on the engines. A critical request that arrives while every replica is prefilling a
long prompt of a lower band waits for one to finish (the conversation trace's prompts reach tens of thousands of
tokens: seconds), however the gateway orders its own queue. Cancelling that prefill frees the replica at its next
forward; what it already prefilled stays in the engine's prefix cache, so the cancelled request, sent again to the
same replica, redoes little.

`choose` prefers: the target where, once the lower bands' requests without a first byte are cancelled, the least
prefill stays ahead of the request (the request's own band and higher are never cancelled); it cancels only when that
is within the request's allowance (`allowance_s`: seconds of prefill it may find ahead) and it removes something.
Each request is preempted at most once (a request cancelled twice could starve: its band's work is never done).
Tie-break: fewer requests cancelled, then the target's name. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gateway.flow.controller import Ticket


@dataclass(frozen=True)
class Preemption:
    target: str
    victims: list[Ticket]
    ahead_after_s: float  # prefill (seconds) left ahead of the request on `target` once they are cancelled


def choose(head: Ticket, inflight: Sequence[Ticket], rate: Mapping[str, float], allowance_s: float) -> Preemption | None:
    """`inflight`: requests sent without a first byte yet; `rate`: each target's prefill tokens per second (a
    target not named: not considered)."""
    by_target: dict[str, list[Ticket]] = {}
    for t in inflight:
        if t.target in rate:
            by_target.setdefault(t.target, []).append(t)
    best: Preemption | None = None
    for target in sorted(by_target):
        mine = by_target[target]
        victims = [t for t in mine if t.band > head.band and not t.preempted]
        if not victims:
            continue
        after = sum(t.uncached for t in mine if t.band <= head.band or t.preempted) / rate[target]
        if after > allowance_s:
            continue
        if best is None or (after, len(victims)) < (best.ahead_after_s, len(best.victims)):
            best = Preemption(target, victims, after)
    return best
