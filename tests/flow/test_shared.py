"""Flow gates over a real Redis: two instances share the fair order; Redis away leaves each instance a local fair
share and loses nothing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gateway.config import PoolTiming
from gateway.flow.controller import Ticket
from gateway.flow.metrics import FlowMetrics
from gateway.flow.runtime import FlowGate, FlowRefused, build
from gateway.flow.settings import FlowControl
from gateway.flow.waits import Wait
from gateway.prediction.ttft import LoadView
from gateway.routing.decision import Decision, Inputs
from gateway.routing.features import Candidate, TargetInfo
from gateway.routing.request import RoutingRequest
from gateway.shared_redis import RedisGuard, build_client
from tests.support import RedisServer


def chosen(req: RoutingRequest) -> Decision[None]:
    """A decision for one target without a prediction (ttft_raw 0: policies that do not predict), which admits."""
    cand = Candidate(TargetInfo("r0", "r0@0", "p", PoolTiming(), None, None), 0, 0, req.prompt_tokens, LoadView(),
                     0.0, 0.0, 0.0)
    return Decision.of([cand], "test", Inputs.of(req))


class Gate:
    """The routing seam, reduced to its answer: `open` a chosen target without predictions (admits), closed a shed
    (never admits). What is under test is the order the queue is served in, not where requests go."""

    def __init__(self) -> None:
        self.open = False
        self.released: list[str] = []

    async def decide(self, req: RoutingRequest, route: Any) -> Decision[None]:
        return chosen(req) if self.open else Decision((), "shed", Inputs.of(req))


def rreq(rid: str, tenant: str) -> RoutingRequest:
    return RoutingRequest(rid, tenant, "m", "chat/completions", True, 1000, 10)


def make(gate: Gate, redis_url: str | None, prefix: str = "t:", **cfg: Any) -> FlowGate:
    client = build_client(redis_url, password=None, max_connections=8, pool_timeout=1.0, connect_timeout=0.5) \
        if redis_url else None
    return build(FlowControl.model_validate({"enabled": True, "tick_s": 0.005, **cfg}), gate.decide,
                 gate.released.append, CollectorRegistry(), client, prefix, 0.5, RedisGuard("flow", retry_after=60))


async def submit(fg: FlowGate, rid: str, tenant: str, order: list[str]) -> Ticket:
    t = fg.ctl.ticket(rid, tenant, 1, 1.0, 1000, 10, fg.clock(), 2.0)

    async def run() -> None:
        await fg.hold(t, rreq(rid, tenant), None, PoolTiming())
        order.append(rid)

    asyncio.get_running_loop().create_task(run())
    return t


async def queue(fg: FlowGate, order: list[str], counts: dict[str, int], tag: str = "") -> None:
    """Submit `counts[tenant]` requests for each tenant, in that order (ids: the tenant in lower case, `tag`, then the
    index: "a0", "b2-1"), and wait until every one of them is queued."""
    for tenant, k in counts.items():
        for i in range(k):
            await submit(fg, f"{tenant.lower()}{tag}{i}", tenant, order)
    total = sum(counts.values())
    await until(lambda: len(fg.ctl) == total, f"{total} queued")


async def until(pred: Any, what: str) -> None:
    for _ in range(2000):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_tenant_served_on_one_instance_waits_behind_another_tenant_on_the_other(redis_server: RedisServer):
    """Two instances on one Redis: tenant A's service on instance 1 counts on instance 2, so with A and B both
    queued there, B (unserved anywhere) goes first although A's requests arrived first."""
    async def main() -> None:
        g1, g2 = Gate(), Gate()
        one, two = make(g1, redis_server.url, "share:"), make(g2, redis_server.url, "share:")
        one.start()
        two.start()
        g1.open = True
        for i in range(20):  # A alone on instance 1: not held, charged (in Redis too)
            assert await one.hold(one.ctl.ticket(f"a1-{i}", "A", 1, 1.0, 5000, 0, one.clock(), 2.0),
                                  rreq(f"a1-{i}", "A"), None, PoolTiming()) is None
        await until(lambda: not one._bg, "instance 1's charges to reach Redis")
        order: list[str] = []
        await queue(two, order, {"A": 3, "B": 3}, tag="2-")
        g2.open = True
        await until(lambda: len(order) == 6, "all six granted")
        assert order[:3] == ["b2-0", "b2-1", "b2-2"], order
        await one.stop()
        await two.stop()

    asyncio.run(main())


def test_with_redis_away_an_instance_keeps_a_local_fair_share_and_loses_nothing():
    """Redis gone: charges and reads fall back (counted), the order is this instance's own fair share, and every
    queued request is granted once there is room."""
    server = RedisServer()
    url = server.url
    server.stop()

    async def main() -> None:
        g = Gate()
        fg = make(g, url, "away:")
        fg.start()
        order: list[str] = []
        await queue(fg, order, {"A": 4, "B": 2})
        g.open = True
        await until(lambda: len(order) == 6, "all six granted")
        assert order[:4] == ["a0", "b0", "a1", "b1"], order  # equal weights, equal costs: alternate
        assert fg.shared is not None and fg.shared.guard.down_reason is not None
        await fg.stop()

    asyncio.run(main())


def test_a_full_queue_refuses_with_429_and_a_timeout_with_503_and_retry_after():
    async def main() -> None:
        g = Gate()
        fg = make(g, None, max_queued_per_tenant=2, queue_timeout_s=0.05)
        fg.start()
        order: list[str] = []
        await queue(fg, order, {"A": 2, "B": 1})
        t = fg.ctl.ticket("a9", "A", 1, 1.0, 1000, 10, fg.clock(), 2.0)
        with pytest.raises(FlowRefused) as full:
            await fg.hold(t, rreq("a9", "A"), None, PoolTiming())
        err = full.value.error()
        assert (err.status, err.code) == (429, "flow_queue_full") and err.headers()["retry-after"]
        t = fg.ctl.ticket("b9", "B", 1, 1.0, 1000, 10, fg.clock(), 2.0)
        with pytest.raises(FlowRefused) as late:  # the gate stays closed: it waits its 50 ms and is refused
            await fg.hold(t, rreq("b9", "B"), None, PoolTiming())
        err = late.value.error()
        assert (err.status, err.code) == (503, "flow_queue_timeout") and "retry-after" in err.headers()
        await until(lambda: len(fg.ctl) == 0, "the rest timed out too")
        assert order == []
        await fg.stop()

    asyncio.run(main())


def test_a_client_band_is_honoured_only_when_its_policy_lists_it():
    fg = FlowGate(FlowControl(enabled=True), Gate().decide, lambda _: None, FlowMetrics(CollectorRegistry()))
    assert fg.band_of(None, [], "critical") == 1  # not allowed: the default band (standard)
    assert fg.band_of("sheddable", ["critical"], "critical") == 0
    assert fg.band_of("sheddable", ["critical"], "standard") == 2  # a band the policy does not list: ignored


def test_a_tenant_served_only_on_another_instance_makes_this_one_contended(redis_server: RedisServer):
    """Contention is fleet-wide: B alone on instance 2 is not held until A, served only on instance 1, shows in the
    shared tags; from then on B's requests are held in the fair order there too."""
    async def main() -> None:
        g1, g2 = Gate(), Gate()
        g1.open = True
        one, two = make(g1, redis_server.url, "watch:"), make(g2, redis_server.url, "watch:")
        one.start()
        two.start()
        two.ctl.ticket("b0", "B", 1, 1.0, 1000, 10, two.clock(), 2.0)  # B seen on instance 2
        assert not two.ctl.contended(two.clock())
        i = 0

        def served_a_elsewhere() -> bool:
            return two.ctl.contended(two.clock())

        for _ in range(2000):
            if served_a_elsewhere():
                break
            i += 1
            await one.hold(one.ctl.ticket(f"a{i}", "A", 1, 1.0, 1000, 10, one.clock(), 2.0), rreq(f"a{i}", "A"), None,
                           PoolTiming())
            await asyncio.sleep(0.01)
        assert served_a_elsewhere()
        await one.stop()
        await two.stop()

    asyncio.run(main())


def test_a_request_the_fleet_has_no_room_for_does_not_hold_the_queue_behind_it():
    """The gateway's pump passes over a request its decision does not admit (its one warm replica is busy) and
    serves the next in the fair order; the one passed over keeps its place and goes once there is room."""
    class Blocked(Gate):
        def __init__(self) -> None:
            super().__init__()
            self.blocked = {"a0"}

        async def decide(self, req: RoutingRequest, route: Any) -> Decision[None]:
            ok = self.open and req.request_id not in self.blocked
            return chosen(req) if ok else Decision((), "shed", Inputs.of(req))

    async def main() -> None:
        g = Blocked()
        fg = make(g, None)
        fg.start()
        order: list[str] = []
        await queue(fg, order, {"A": 3, "B": 1})
        g.open = True
        await until(lambda: len(order) == 3, "the three behind a0 granted")
        assert "a0" not in order and len(fg.ctl) == 1
        g.blocked.clear()
        await until(lambda: len(order) == 4, "a0 granted once it fits")
        await fg.stop()

    asyncio.run(main())


def test_a_target_a_request_waits_for_on_one_instance_is_not_taken_by_a_later_flow_on_the_other(
        redis_server: RedisServer):
    """B (under its share) waits on instance 1 for r0, its one target, which is busy; instance 2's A requests (over
    their share) would fit on r0 at once. Through the waits board in Redis, instance 2 holds them off r0 until B
    has gone there; then they go. Without the board, instance 2 would keep r0's queue full of A's and B would wait."""
    class Busy(Gate):
        def __init__(self) -> None:
            super().__init__()
            self.busy = False
            self.decided: list[str] = []

        async def decide(self, req: RoutingRequest, route: Any) -> Decision[None]:
            self.decided.append(req.request_id)
            if req.tenant == "B" and self.busy:  # r0 predicted far past B's SLA: passed over, waiting for r0
                cand = Candidate(TargetInfo("r0", "r0@0", "p", PoolTiming(), None, None), 0, 0, req.prompt_tokens,
                                 LoadView(), 10.0, 10.0, 0.0)
                return Decision.of([cand], "test", Inputs.of(req))
            return chosen(req)

    async def main() -> None:
        g1, g2 = Busy(), Busy()
        cfg = {"contention_window_s": 0.5}
        one, two = make(g1, redis_server.url, "waits:", **cfg), make(g2, redis_server.url, "waits:", **cfg)
        one.start()
        two.start()
        for fg in (one, two):  # both tenants served on both instances: each sees two flows (contended), A far ahead
            for i in range(5):
                await fg.hold(fg.ctl.ticket(f"a{fg.instance}-{i}", "A", 1, 1.0, 5000, 0, fg.clock(), 2.0),
                              rreq(f"a{fg.instance}-{i}", "A"), None, PoolTiming())
            await fg.hold(fg.ctl.ticket(f"b{fg.instance}", "B", 1, 1.0, 10, 0, fg.clock(), 2.0),
                          rreq(f"b{fg.instance}", "B"), None, PoolTiming())
        await until(lambda: not one._bg and not two._bg, "the charges to reach Redis")
        order: list[str] = []
        g1.busy = True
        await submit(one, "b-wait", "B", order)
        start_a = two.ctl.tags.start(1, "A")
        await until(lambda: two.board.ahead("r0", 1, start_a, two.instance, two.clock()),
                    "instance 2 to read instance 1's wait for r0")
        await submit(two, "a-next", "A", order)
        await until(lambda: len(two.ctl) == 1 and g2.decided.count("a-next") >= 5,
                    "instance 2 to have tried a-next several times")
        assert order == [], order  # a-next fits r0, but B waits for r0 on instance 1 and is ahead of it
        g1.busy = False
        await until(lambda: order[:1] == ["b-wait"], "B granted on instance 1")
        await until(lambda: order == ["b-wait", "a-next"], "a-next granted once nobody ahead waits for r0")
        await one.stop()
        await two.stop()

    asyncio.run(main())


def test_waiting_for_counts_the_queued_requests_each_pool_could_serve():
    """What the latency outlier detector asks (gateway/app.py): how many requests wait here for a pool's capacity."""
    async def main() -> None:
        gate = Gate()
        fg = make(gate, None)
        fg.start()
        assert fg.waiting_for("p") == 0
        for i, (tenant, pools) in enumerate((("A", ["p"]), ("B", ["p", "q"]), ("A", ["q"]))):  # two flows: held
            t = fg.ctl.ticket(f"r{i}", tenant, 1, 1.0, 1000, 10, fg.clock(), 2.0)
            asyncio.get_running_loop().create_task(fg.hold(t, rreq(f"r{i}", tenant), SimpleNamespace(pools=pools),
                                                           PoolTiming()))
        await until(lambda: len(fg.ctl) == 3, "three queued")
        assert (fg.waiting_for("p"), fg.waiting_for("q"), fg.waiting_for("other")) == (2, 2, 0)
        # another instance's requests waiting for one of the pool's targets (the waits board) count too
        fg.board.merge("elsewhere", {"r7": Wait(1, 0.0, fg.clock() + 10), "x1": Wait(1, 0.0, fg.clock() + 10)})
        assert fg.waiting_for("p", ["r6", "r7"]) == 3 and fg.waiting_for("other", ["r6"]) == 0
        fg.board.merge("stale", {"r6": Wait(1, 0.0, fg.clock() - 1)})  # past its time: not believed
        assert fg.waiting_for("other", ["r6"]) == 0
        gate.open = True
        await until(lambda: len(fg.ctl) == 0, "all granted")
        assert fg.waiting_for("p") == 0
        await fg.stop()

    asyncio.run(main())
