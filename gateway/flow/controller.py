"""The flow controller's core: bands, fair sharing, deadlines, bounded queues. Synchronous and pure (the caller
passes the clock), so the gateway (`flow/admission.py`, async, Redis-shared tags) and the virtual-clock fleet
(`gateway_lab/sim/fleet.py`) run this one object.

Order of service, when the fleet has room for one more request (`gate.py` decides that):
1. Band: the highest band with anything queued; a lower band waits while a higher one has work.
2. Tenant, within the band: start-time fair queueing at the tenant level. Each (band, tenant) flow has a finish tag
   F; the band has a virtual time V. The flow served next is the one with the least start tag max(F, V); serving a
   request of cost c (prefill-weighted tokens) at weight w sets F = start + c / w and V = max(V, start). Over any
   busy period, tenants of one band get service in proportion to their weights, whatever their arrival rates; a
   flow that was idle restarts at V less a bounded burst credit (`burst_credit`), so idleness banks no more than
   one burst. Ties: the earlier deadline, then the name.
3. Request, within the tenant: the earliest deadline (the latest dispatch that still meets the tenant's TTFT SLA:
   arrival + SLA - the TTFT it is dispatched against) first, among those whose deadline has not passed; a request past its deadline goes only when its tenant has none that can still make it
   (then oldest first). Under overload, plain earliest-deadline-first serves only requests that are already late —
   each one served late makes the next one late too; this way a tenant over its share gets its share served within
   the SLA, and its requests that can no longer be time out (503) instead of taking capacity to be late.
4. A request the fleet has no room for now is passed over for this pass (`head(now, skip)`): the next one in the
   same order is offered (the caller, `gate.Pass`, keeps the target the first waits for out of reach of the rest).

Preemption (`preempt.py` chooses): a request sent and without its first byte is `sent`; a higher band may have it
cancelled upstream and `requeue`d — in its place, not charged twice, once at most.

Refusals (each a `Refusal` with a status, a reason and a Retry-After):
- `queue_full` (429): the tenant's own queue is at its bound; the tenant is over its share, nobody else is.
- `evicted` (503): the instance's queues are full and a higher band's request arrived: the newest request of the
  lowest sheddable band below it makes room.
- `overloaded` (503): the queues are full and nothing sheddable is below the arrival.
- `queue_timeout` (503): waited its tenant's queue timeout without the fleet having room for it.

The fair tags (`FairTags`) are the only state another instance needs: `flow/shared.py` keeps them in Redis so the
share is fleet-wide; each instance's queue stays its own (a request waits where its connection is).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from gateway.flow.settings import FlowControl

RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0  # the OpenAI SDK ignores a longer Retry-After


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's place in the queue. `cost`: prefill-weighted tokens; `deadline`: the latest dispatch that can
    still meet its SLA."""

    key: str
    tenant: str
    band: int
    weight: float
    cost: float
    arrived: float
    deadline: float
    expires: float
    sheddable: bool = False
    payload: Any = None
    seq: int = 0
    state: str = "new"  # new -> queued -> granted | refused | cancelled; granted -> queued again when preempted
    granted_at: float | None = None
    start_tag: float = 0.0
    output_tokens: int = 0
    target: str = ""  # where it was sent (preemptible there until its first byte)
    uncached: int = 0  # the prompt tokens it prefills there
    preempted: int = 0  # times sent back to the queue before its first byte (at most once)
    boost: int = 0  # added to its engine priority where the target schedules by priority (`engine_boost`)

    @property
    def flow(self) -> tuple[int, str]:
        return self.band, self.tenant


@dataclass(frozen=True, slots=True)
class Refusal:
    ticket: Ticket
    status: int  # 429 the tenant's own queue; 503 the fleet's
    reason: str  # queue_full | evicted | overloaded | queue_timeout
    retry_after_s: float
    message: str


class FairTags:
    """Per band a virtual time V, per (band, tenant) a finish tag F. `merge` takes values another instance wrote
    (Redis): tags only grow, so the larger value is the later one. `burst`: how far behind V a flow may start (in
    cost / weight): a tenant within its share that sends a burst (the conversation trace delivers ~10 turns in one
    millisecond every few seconds) has its burst served first instead of interleaved with a backlogged tenant's
    requests; a backlogged flow's F is ahead of V, so it never has credit."""

    def __init__(self, burst: float = 0.0) -> None:
        self.burst = burst
        self.finish: dict[tuple[int, str], float] = {}
        self.vtime: dict[int, float] = {}

    def start(self, band: int, tenant: str) -> float:
        return max(self.finish.get((band, tenant), 0.0), self.vtime.get(band, 0.0) - self.burst)

    def charge(self, band: int, tenant: str, amount: float) -> float:
        s = self.start(band, tenant)
        self.finish[(band, tenant)] = s + amount
        if s > self.vtime.get(band, 0.0):
            self.vtime[band] = s
        return s

    def merge(self, band: int, tenant: str, finish: float, vtime: float) -> None:
        if finish > self.finish.get((band, tenant), 0.0):
            self.finish[(band, tenant)] = finish
        if vtime > self.vtime.get(band, 0.0):
            self.vtime[band] = vtime


@dataclass
class _Served:
    """A flow's recent grants, for Retry-After: how fast its queue drains."""

    rate: float = 0.0  # grants per second, smoothed
    last: float | None = None


class FlowController:
    def __init__(self, cfg: FlowControl, tags: FairTags | None = None) -> None:
        """`tags`: shared with other controllers (the fleet's instances on one state); default its own."""
        self.cfg = cfg
        self.tags = tags if tags is not None else FairTags(cfg.burst_credit)
        self._queues: list[dict[str, list[tuple[float, int, Ticket]]]] = [{} for _ in self.cfg.bands]
        self._late: dict[tuple[int, str], list[tuple[int, Ticket]]] = {}  # past their deadline, by arrival (heap)
        self._expiry: list[tuple[float, int, Ticket]] = []  # lazy: entries of tickets no longer queued are skipped
        self._per_tenant: dict[str, int] = {}
        self._queued = 0
        self._seq = 0
        self._seen: dict[tuple[int, str], float] = {}
        self._served: dict[str, _Served] = {}
        self.sheddable = [b.sheddable for b in self.cfg.bands]
        self._inflight: dict[Ticket, None] = {}  # sent, no first byte yet (preemptible), in dispatch order

    # -- what is queued ----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._queued

    def queued(self) -> Iterator[Ticket]:
        for band in self._queues:
            for heap in band.values():
                for _, _, t in heap:
                    yield t
        for late in self._late.values():
            for _, t in late:
                yield t

    def depth(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def seen(self, flow: tuple[int, str], now: float) -> None:
        """A flow served elsewhere (another instance, through the shared tags) counts towards contention here."""
        self._seen[flow] = max(now, self._seen.get(flow, now))

    def contended(self, now: float) -> bool:
        """More than one flow seen within the contention window, or anything queued: only then is a request held.
        A single flow's order is first come, first served in the gateway's queue or the engine's alike, and the
        engine's is better informed (no feedback delay), so a lone tenant is never held."""
        if self._queued:
            return True
        cutoff = now - self.cfg.contention_window_s
        stale = [f for f, at in self._seen.items() if at < cutoff]
        for f in stale:
            del self._seen[f]
        return len(self._seen) > 1

    # -- arrivals ----------------------------------------------------------------------------------------------
    def ticket(self, key: str, tenant: str, band: int, weight: float, prompt_tokens: int, output_tokens: int,
               now: float, sla_s: float, timeout_s: float | None = None, payload: Any = None,
               lead_s: float = 0.0) -> Ticket:
        """`lead_s`: the TTFT the request is dispatched against (gate.bound); its deadline is then the latest
        dispatch that can still meet the SLA, so "late" means it can no longer make it, not that it already missed."""
        self._seen[(band, tenant)] = now
        return Ticket(key, tenant, band, weight, self.cost(prompt_tokens, 0, output_tokens), now,
                      now + max(0.0, sla_s - lead_s),
                      now + (timeout_s if timeout_s is not None else self.cfg.queue_timeout_s),
                      self.sheddable[band], payload, output_tokens=output_tokens)

    def offer(self, t: Ticket, now: float, tenant_cap: int | None = None) -> list[Refusal]:
        """Queue `t`, or refuse it. Returns the refusals this arrival caused: `t`'s own, or an evicted request's."""
        self._seen[t.flow] = now
        cap = tenant_cap if tenant_cap is not None else self.cfg.max_queued_per_tenant
        if self._per_tenant.get(t.tenant, 0) >= cap:
            t.state = "refused"
            return [Refusal(t, 429, "queue_full", self._retry_after(t.tenant, now),
                            f"This key's queue is full ({cap} requests waiting); it is sending more than its share "
                            "of the fleet. Retry after the time in Retry-After.")]
        out: list[Refusal] = []
        if self._queued >= self.cfg.max_queued:
            victim = self._eviction_victim(t.band)
            if victim is None:
                t.state = "refused"
                return [Refusal(t, 503, "overloaded", self._retry_after(t.tenant, now),
                                "The gateway's queues are full; retry shortly.")]
            self._remove(victim)
            victim.state = "refused"
            out.append(Refusal(victim, 503, "evicted", self._retry_after(victim.tenant, now),
                               "Evicted from the queue to make room for higher-priority traffic; retry shortly."))
        self._push(t)
        return out

    def _push(self, t: Ticket) -> None:
        self._seq += 1
        t.seq, t.state = self._seq, "queued"
        entry = (t.deadline, t.seq, t)
        heapq.heappush(self._queues[t.band].setdefault(t.tenant, []), entry)
        heapq.heappush(self._expiry, (t.expires, t.seq, t))
        self._per_tenant[t.tenant] = self._per_tenant.get(t.tenant, 0) + 1
        self._queued += 1

    def _eviction_victim(self, band: int) -> Ticket | None:
        for b in range(len(self._queues) - 1, band, -1):  # lowest band first, strictly below the arrival's
            if not self.sheddable[b] or not self._queues[b]:
                continue
            return max((t for t in self.queued() if t.band == b), key=lambda t: t.seq)
        return None

    # -- service -----------------------------------------------------------------------------------------------
    def head(self, now: float, skip: Collection[Ticket] = ()) -> Ticket | None:
        """The next request to serve (not removed): the highest non-empty band, its flow with the least start tag,
        that flow's earliest deadline still ahead (else its oldest late request). `skip`: requests the fleet has no
        room for now, passed over in this pass (the next one in the same order is served instead: one request
        waiting for its one warm replica does not hold the queue behind it)."""
        tags = self.tags
        for b, flows in enumerate(self._queues):
            nxt = {n: t for n in list(flows) if (t := self._next(b, n, now, skip)) is not None}
            if nxt:
                return nxt[min(nxt, key=lambda n: (tags.start(b, n), nxt[n].deadline, n))]
        return None

    def under_share(self, t: Ticket) -> bool:
        """`t`'s flow has used less than its share of its band in the current busy period: its start tag is behind
        the band's virtual time (it was idle, or sends less than its weight's share). A backlogged flow's start tag
        is at or ahead of the virtual time (serving it moves the virtual time to it)."""
        return self.tags.start(t.band, t.tenant) < self.tags.vtime.get(t.band, 0.0)

    def engine_boost(self, t: Ticket) -> int:
        """What `t` adds to its engine priority, read as it is dispatched (before its charge moves its tag): its
        band's `engine_priority`, plus `under_share_priority` while its flow is under its share. In the engine's
        queue it then goes ahead of over-share flows' requests that the gateway let through before it: the gateway's
        fair order reaches into the engine. A flow under its share cannot starve the others with it (past its share
        it loses the boost). The caller sends it only where the target schedules by priority
        (`Target.priority_for`)."""
        boost = self.cfg.bands[t.band].engine_priority
        if self.cfg.under_share_priority and self.under_share(t):
            boost += self.cfg.under_share_priority
        return boost

    def _next(self, band: int, tenant: str, now: float, skip: Collection[Ticket] = ()) -> Ticket | None:
        heap = self._queues[band][tenant]
        late = self._late.get((band, tenant))
        while heap and heap[0][0] <= now:  # deadline passed: to the late list, served after those that can make it
            _, seq, t = heapq.heappop(heap)
            if late is None:
                late = self._late[(band, tenant)] = []
            heapq.heappush(late, (seq, t))
        k = len(skip) + 1  # of the k first, one at least is not skipped
        for _, _, t in heapq.nsmallest(k, heap):
            if t not in skip:
                return t
        for _, t in heapq.nsmallest(k, late or []):
            if t not in skip:
                return t
        return None

    def cost(self, uncached: int, cached: int, output: int) -> float:
        c = self.cfg
        return max(1.0, uncached * c.prefill_weight + cached * c.cached_weight + output * c.output_weight)

    def grant(self, t: Ticket, now: float, cost: float | None = None) -> None:
        """Serve `t` (queued): remove it and charge its flow (`cost`: as placed, e.g. less its cached prefix). A
        preempted request was charged when first granted: its second grant is not charged again."""
        self._remove(t)
        if t.preempted:
            t.state, t.granted_at = "granted", now
            return
        self.charge(t, now, cost)

    def charge(self, t: Ticket, now: float, cost: float | None = None) -> None:
        """Charge `t`'s flow for its service (also for a request that never queued: what it used counts)."""
        if cost is not None:
            t.cost = cost
        t.boost = self.engine_boost(t)
        t.start_tag = self.tags.charge(t.band, t.tenant, t.cost / t.weight)
        t.state, t.granted_at = "granted", now
        s = self._served.setdefault(t.tenant, _Served())
        if s.last is not None and now > s.last:
            s.rate = 0.8 * s.rate + 0.2 / (now - s.last)
        s.last = now

    def cancel(self, t: Ticket) -> bool:
        """The client left while queued: removed without a charge."""
        if t.state != "queued":
            return False
        self._remove(t)
        t.state = "cancelled"
        return True

    def expire(self, now: float) -> list[Refusal]:
        out = []
        while self._expiry and self._expiry[0][0] <= now:
            at, _, t = heapq.heappop(self._expiry)
            if t.state != "queued" or at != t.expires:  # served, or queued again (preempted) with a new timeout
                continue
            self._remove(t)
            t.state = "refused"
            out.append(Refusal(t, 503, "queue_timeout", self._retry_after(t.tenant, now),
                               f"Waited {now - t.arrived:.1f} s in the queue without the fleet having room within "
                               "this key's TTFT target; retry shortly."))
        return out

    # -- preemption (flow/preempt.py chooses; the caller cancels the upstream request) ----------------------------
    def sent(self, t: Ticket, target: str, uncached: int) -> None:
        """`t` (granted) was sent to `target`, where it prefills `uncached` tokens: preemptible until its first
        byte (`first_byte`) or its end."""
        t.target, t.uncached = target, uncached
        self._inflight[t] = None

    def first_byte(self, t: Ticket) -> None:
        """`t`'s first byte reached the client (or it ended): no longer preemptible."""
        self._inflight.pop(t, None)

    def inflight(self) -> list[Ticket]:
        return list(self._inflight)

    def requeue(self, t: Ticket, now: float) -> None:
        """`t` was preempted before its first byte (its upstream request cancelled): back in its flow's queue, in
        its place (its deadline and arrival), with a new queue timeout from now; never refused for the queue bounds
        (it was admitted once), and not charged again when granted."""
        assert t.state == "granted", t.state
        self._inflight.pop(t, None)
        t.preempted += 1
        t.expires = now + (t.expires - t.arrived)
        t.granted_at = None
        self._push(t)

    def _remove(self, t: Ticket) -> None:
        heap = self._queues[t.band][t.tenant]
        late = self._late.get(t.flow)
        if heap and heap[0][2] is t:
            heapq.heappop(heap)
        elif late and late[0][1] is t:
            heapq.heappop(late)
        elif late and (t.seq, t) in late:
            late.remove((t.seq, t))
            heapq.heapify(late)
        else:
            heap.remove((t.deadline, t.seq, t))
            heapq.heapify(heap)
        if late is not None and not late:
            del self._late[t.flow]
        if not heap and not late:
            del self._queues[t.band][t.tenant]
        self._per_tenant[t.tenant] -= 1
        if not self._per_tenant[t.tenant]:
            del self._per_tenant[t.tenant]
        self._queued -= 1

    def _retry_after(self, tenant: str, now: float) -> float:
        """How long this tenant's queue takes to drain at its recent service rate (bounded)."""
        s = self._served.get(tenant)
        queued = self._per_tenant.get(tenant, 0) + 1
        if s is None or s.rate <= 0 or math.isinf(s.rate):
            return self.cfg.queue_timeout_s if queued > 1 else RETRY_AFTER_MIN_S
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, queued / s.rate))

    def waits(self, now: float) -> dict[tuple[int, str], tuple[int, float]]:
        """Per flow: (queued, oldest wait in seconds)."""
        out: dict[tuple[int, str], tuple[int, float]] = {}
        for t in self.queued():
            n, oldest = out.get(t.flow, (0, 0.0))
            out[t.flow] = (n + 1, max(oldest, now - t.arrived))
        return out
