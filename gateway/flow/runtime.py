"""Flow control in the gateway: the controller (`controller.py`) behind one async call per request, a pump that
serves the queue while the routing engine says the fleet has room (`gate.py`), and the fair tags shared through
Redis (`shared.py`).

    await flow.hold(ticket, route)   -> the routing Decision it was let through on (or None: not held; route as usual)
                                        raises FlowRefused (429 queue_full; 503 queue_timeout, evicted, overloaded)

A request is held only under contention (two or more flows within the window, or anything queued). The pump runs
while anything is queued: at each arrival and every `tick_s`, it expires what waited too long, then serves the
fair order: each request goes when its decision admits it (`gate.py`), and one the fleet has no room for is passed
over for the next, which goes only on another target than the one it waits for (`gate.Pass`, at most `lookahead`
in a pass). Every request held ends in exactly one of: granted (with its
decision), refused (with a reason and Retry-After), cancelled (the client left; no charge).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from gateway.background import BackgroundTask
from gateway.config import PoolTiming
from gateway.errors import NoCapacity, RateLimited
from gateway.flow.controller import FlowController, Refusal, Ticket
from gateway.flow.gate import Pass, bound, meets_sla, placed_cost, tightened, verdict
from gateway.flow.metrics import FlowMetrics
from gateway.flow.settings import FlowControl
from gateway.flow.shared import RedisFairTags
from gateway.flow.waits import WaitBoard
from gateway.routing.decision import Decision
from gateway.routing.request import RoutingRequest

log = logging.getLogger("gateway.flow")

# the watch's longest period: also how stale the other instances' waits may be to a request that finds nothing
# queued here (the board's entries live waits.TTL_S)
WATCH_MAX_S = 0.25

# decide(request, route, tightened request) -> the routing engine's decision, with the chosen target's load claimed
Decide = Callable[[RoutingRequest, Any], Awaitable[Decision[Any]]]


class FlowRefused(Exception):
    """Turned into the API's error by the request path (`pipeline/flow.py`)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal

    def error(self) -> RateLimited | NoCapacity:
        r = self.refusal
        cls = RateLimited if r.status == 429 else NoCapacity
        return cls(r.message, code=f"flow_{r.reason}", retry_after=r.retry_after_s)


@dataclass
class Held:
    """What a queued request waits on: its routing request and route, the future the pump resolves."""

    rreq: RoutingRequest
    route: Any
    timing: PoolTiming
    done: asyncio.Future[Decision[Any]]


class FlowGate:
    def __init__(self, cfg: FlowControl, decide: Decide, release: Callable[[str], None], metrics: FlowMetrics,
                 shared: RedisFairTags | None = None, clock: Callable[[], float] = time.monotonic,
                 reserve: Callable[[str, str, float], None] | None = None) -> None:
        """`decide`: the router's decision (claims the chosen target's load); `release`: drop that claim (a decision
        that did not admit); `reserve`: claim another target's (the gate let the request through on the policy's
        next choice, `gate.within`)."""
        self.cfg = cfg
        self.ctl = FlowController(cfg)
        self.decide = decide
        self.release = release
        self.reserve = reserve
        self.metrics = metrics
        self.shared = shared
        self.clock = clock
        self._wake = asyncio.Event()
        self._pump = BackgroundTask(self._run, "flow-pump")
        self._watch = BackgroundTask(self._watch_shared, "flow-watch")
        self._tags_seen: dict[tuple[int, str], float] = {}
        self._bg: set[asyncio.Task[None]] = set()
        self._served: dict[tuple[int, str], tuple[float, float]] = {}  # flow -> (cost / weight in window, last at)
        # the targets queued requests wait for, here and (read from Redis) on the other instances (waits.py)
        self.instance = uuid.uuid4().hex[:12]
        self.board = WaitBoard()
        self._sent: dict[str, tuple[int, float]] = {}  # the waits last written to Redis, and when to renew them
        self._renew_at = 0.0
        metrics.fairness.set_function(self.fairness)

    def start(self) -> None:
        self._pump.start()
        if self.shared is not None:
            self._watch.start()

    async def stop(self) -> None:
        await self._pump.stop()
        await self._watch.stop()
        for t in list(self.ctl.queued()):  # shutdown: nothing queued is left unanswered
            self.ctl.cancel(t)
            h: Held = t.payload
            if not h.done.done():
                h.done.set_exception(FlowRefused(Refusal(t, 503, "overloaded", 1.0, "The gateway is shutting down; "
                                                         "retry on another instance.")))
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)

    # -- per request -------------------------------------------------------------------------------------------
    def band_of(self, policy_band: str | None, client_bands: list[str], asked: str | None) -> int:
        """The tenant's band; a client's `x-gateway-band` only when its policy lists that band."""
        if asked and asked in client_bands:
            return self.cfg.band_index(asked)
        return self.cfg.band_index(policy_band)

    async def hold(self, t: Ticket, rreq: RoutingRequest, route: Any, timing: PoolTiming,
                   tenant_cap: int | None = None) -> Decision[Any] | None:
        """Hold `t` until the fleet has room for it in the fair order: its decision, or None when not held."""
        now = self.clock()
        band = self.cfg.bands[t.band].name
        if not self.ctl.contended(now):
            self.ctl.charge(t, now)
            self._charged(t, held=False, waited=0.0)
            return None
        if not len(self.ctl):  # nobody waiting here: go now if routing predicts the SLA, else wait in the fair order
            decision = await self.decide(rreq, route)
            go = meets_sla(decision, rreq, self.cfg.queue_for(t.band))
            if go is not None and go.chosen is not None and self._elsewhere(go.chosen.name, t):
                go = None  # another instance's request ahead of it waits for that target: the queue instead
            if go is not None and not len(self.ctl):
                now = self.clock()
                self._claim(rreq, decision, go)
                self.ctl.charge(t, now, placed_cost(self.ctl, t, go))
                self._charged(t, held=False, waited=0.0)
                return go
            self.release(rreq.request_id)
            now = self.clock()
        loop = asyncio.get_running_loop()
        held = Held(rreq, route, timing, loop.create_future())
        t.payload = held
        for r in self.ctl.offer(t, now, tenant_cap):
            self._refuse(r)
        if t.state == "refused":
            return await held.done  # raises the refusal
        self.metrics.depth.labels(t.tenant, band).inc()
        self._wake.set()
        try:
            return await held.done
        except asyncio.CancelledError:
            if self.ctl.cancel(t):  # the client left while queued: gone, uncharged
                self.metrics.depth.labels(t.tenant, band).dec()
            elif held.done.done() and not held.done.cancelled() and held.done.exception() is None:
                self.release(rreq.request_id)  # granted as it left: the claim goes back
            raise

    # -- other instances ---------------------------------------------------------------------------------------
    async def _watch_shared(self) -> None:
        """Contention is fleet-wide: a tenant served only on another instance still contends with this one's, so the
        shared tags are read every tenth of the contention window and a flow whose tag moved counts as seen here."""
        assert self.shared is not None
        while True:
            try:
                await self.watch_once()
            except Exception:  # logged, tried again: contention seen late is a fairness lapse, not an outage
                log.exception("flow watch failed")
            await asyncio.sleep(max(0.05, min(self.cfg.contention_window_s / 10, WATCH_MAX_S)))

    async def watch_once(self) -> None:
        assert self.shared is not None
        # the pump reads the other instances' waits while it runs; idle, the watch does
        board = self.board if self.cfg.share_waits and not len(self.ctl) else None
        tags = await self.shared.scan(self.ctl.tags, len(self.cfg.bands), board, self.instance, self.clock())
        now = self.clock()
        for flow, f in tags.items():
            if f > self._tags_seen.get(flow, 0.0):
                if flow in self._tags_seen:  # moved since the last read (the first read is only a baseline)
                    self.ctl.seen(flow, now)
                self._tags_seen[flow] = f

    # -- the pump ----------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            if not len(self.ctl):
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.pump()
            except Exception:  # one bad pass must not stop the queue: logged, tried again at the next tick
                log.exception("flow pump failed")
            await asyncio.sleep(self.cfg.tick_s)

    async def pump(self) -> None:
        ctl = self.ctl
        if self.shared is not None and len(ctl):
            board = self.board if self.cfg.share_waits else None
            await self.shared.refresh(ctl.tags, {t.flow for t in ctl.queued()}, board, self.instance, self.clock())
        now = self.clock()
        for r in ctl.expire(now):
            self._refuse(r)
        p = Pass(self.cfg.lookahead, self._elsewhere)
        while (t := ctl.head(now, p.skip)) is not None:
            h: Held = t.payload
            q = self.cfg.queue_for(t.band)
            if ctl.under_share(t):  # first in the fair order and under its share: its whole SLA (gate.meets_sla)
                decision = await self.decide(h.rreq, h.route)
                go = p.free(meets_sla(decision, h.rreq, q), t)
            else:
                decision = await self.decide(tightened(h.rreq, bound(h.rreq, h.timing, q)), h.route)
                go = p.free(verdict(decision, h.rreq, q), t)
            now = self.clock()
            if t.state != "queued":  # cancelled while the decision was awaited
                self.release(h.rreq.request_id)
                continue
            if go is None:  # no room for it now: the next in the fair order may fit elsewhere
                self.release(h.rreq.request_id)
                if not p.passed(t, decision, ctl.tags.start(t.band, t.tenant)):
                    break
                continue
            self._claim(h.rreq, decision, go)
            ctl.grant(t, now, placed_cost(ctl, t, go))
            self.metrics.depth.labels(t.tenant, self.cfg.bands[t.band].name).dec()
            self._charged(t, held=True, waited=now - t.arrived)
            h.done.set_result(go)
        await self._publish(p, now)

    def _elsewhere(self, target: str, t: Ticket) -> bool:
        return self.cfg.share_waits and self.board.ahead(target, t.band, self.ctl.tags.start(t.band, t.tenant),
                                                         self.instance, self.clock())

    async def _publish(self, p: Pass, now: float) -> None:
        """This pass's waits onto the board, and to Redis when they changed or half their life has gone."""
        if not self.cfg.share_waits:
            return
        mine = self.board.publish(self.instance, p.waits, now)
        if self.shared is None or (p.waits == self._sent and not (mine and now >= self._renew_at)):
            return
        self._sent, self._renew_at = dict(p.waits), now + self.board.ttl_s / 2
        await self.shared.publish_waits(self.instance, mine, now)

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def _claim(self, rreq: RoutingRequest, decision: Decision[Any], go: Decision[Any]) -> None:
        """The gate let the request through on another target than the decision chose: the claim moves there."""
        first, chosen = decision.chosen, go.chosen
        if first is None or chosen is None or chosen.name == first.name or self.reserve is None:
            return
        self.release(rreq.request_id)
        self.reserve(rreq.request_id, chosen.name, chosen.uncached_tokens)

    def _refuse(self, r: Refusal) -> None:
        t, band = r.ticket, self.cfg.bands[r.ticket.band].name
        self.metrics.refused.labels(t.tenant, band, r.reason).inc()
        h = t.payload
        if isinstance(h, Held):
            if t.seq:  # it was queued (an eviction or a timeout), not refused on arrival
                self.metrics.depth.labels(t.tenant, band).dec()
            if not h.done.done():
                h.done.set_exception(FlowRefused(r))

    def _charged(self, t: Ticket, held: bool, waited: float) -> None:
        band = self.cfg.bands[t.band].name
        self.metrics.granted.labels(t.tenant, band, "yes" if held else "no").inc()
        self.metrics.wait.labels(t.tenant, band).observe(waited)
        self.metrics.served_cost.labels(t.tenant, band).inc(t.cost)
        now = self.clock()
        used, at = self._served.get(t.flow, (0.0, now))
        decay = max(0.0, 1 - (now - at) / self.cfg.contention_window_s)
        self._served[t.flow] = (used * decay + t.cost / t.weight, now)
        if self.shared is not None:
            task = asyncio.get_running_loop().create_task(
                self.shared.charge(self.ctl.tags, t.band, t.tenant, t.cost / t.weight))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    def fairness(self) -> float:
        """Jain's index over the flows' weight-normalised service within the contention window."""
        now = self.clock()
        xs = [used * max(0.0, 1 - (now - at) / self.cfg.contention_window_s) for used, at in self._served.values()]
        xs = [x for x in xs if x > 0]
        sq = sum(x * x for x in xs)
        return (sum(xs) ** 2) / (len(xs) * sq) if sq else 1.0

    def waiting_for(self, pool: str, targets: Collection[str] = ()) -> int:
        """Requests queued here that `pool` could serve, plus the pool's `targets` that requests on other instances
        wait for (the waits board): the latency outlier detector's sign that the pool is saturated, whichever
        instance holds the queue."""
        here = sum(1 for t in self.ctl.queued() if pool in getattr(t.payload.route, "pools", ())) if len(self.ctl) else 0
        there = self.board.waiting_elsewhere(self.instance, targets, self.clock()) if self.cfg.share_waits else 0
        return here + there

    def snapshot(self) -> dict[str, Any]:
        """The admin view: queues per flow, the fair tags, the fairness index."""
        now = self.clock()
        names = [b.name for b in self.cfg.bands]
        return {"enabled": True, "queued": len(self.ctl), "fairness": round(self.fairness(), 4),
                "flows": [{"tenant": tenant, "band": names[band], "queued": n, "oldest_wait_s": round(w, 3),
                           "start_tag": round(self.ctl.tags.start(band, tenant), 1)}
                          for (band, tenant), (n, w) in sorted(self.ctl.waits(now).items())]}


def build(cfg: FlowControl, decide: Decide, release: Callable[[str], None], registry: Any, redis_client: Any,
          prefix: str, timeout_s: float, guard: Any,
          reserve: Callable[[str, str, float], None] | None = None) -> FlowGate:
    """The gateway's flow gate: tags shared through Redis when the gateway has one."""
    shared = RedisFairTags(redis_client, prefix, timeout_s, guard) if redis_client is not None else None
    return FlowGate(cfg, decide, release, FlowMetrics(registry), shared, reserve=reserve)
