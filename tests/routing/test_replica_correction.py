"""The TTFT correction per replica: a replica slower than its peers is predicted (and so routed) as such within a few
dozen of its requests, without raising its peers' predictions, and one nothing observes drifts back to its pool."""

import pytest

from gateway.config import PoolTiming
from gateway.prediction.ttft import FREE, SHIFT_AFTER, SLOT_WAIT, LoadView, TtftCorrector
from gateway.routing.features import TargetInfo, build_candidates
from gateway.routing.policies import prefix_sla_cost
from gateway.routing.policy import PolicyContext
from gateway.routing.request import RoutingRequest

T = PoolTiming()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fleet(c: TtftCorrector, clock: Clock, slow: str, ratio: float, n: int, replicas: int = 4,
          alone: bool = True) -> None:
    """`n` rounds of one observation per replica: `slow` takes `ratio` x the raw prediction, the others 1x (`alone`:
    nothing queued ahead of each)."""
    for _ in range(n):
        clock.now += 0.1
        for i in range(replicas):
            name = f"r{i}"
            c.observe("p", 1.0, ratio if name == slow else 1.0, FREE, name, alone=alone)


def test_a_slow_replica_is_learned_apart_from_its_peers():
    """6x slower on every request: its own factor rises to ~6 while the peers stay ~1 and the pool's correction is
    not dragged up by it (that would slow the whole pool's predictions and spill healthy traffic)."""
    clock = Clock()
    c = TtftCorrector(alpha=0.05, clock=clock)
    fleet(c, clock, "r3", 1.0, 50)
    fleet(c, clock, "r3", 6.0, 60)
    assert c.get("p", FREE, "r3") == pytest.approx(6.0, rel=0.15)
    for healthy in ("r0", "r1", "r2"):
        assert c.get("p", FREE, healthy) == pytest.approx(1.0, abs=0.25)
    assert c.get("p", FREE) < 1.6  # the pool's own factor


def test_a_step_change_is_learned_in_shift_after_requests_not_a_few_dozen():
    """A replica that turns 6x slower: SHIFT_AFTER free-regime first tokens in a row past SHIFT_RATIO x its factor
    move the factor to theirs at once (the EWMA alone needed ~20; at a quarter of a request a second per replica
    that was over a minute of clients paying for it). Fewer are not a slow replica: one or two slow answers move it
    by the EWMA only."""
    clock = Clock()
    c = TtftCorrector(clock=clock)
    fleet(c, clock, "r3", 1.0, 20)
    seen = 0
    while c.replica_factor("r3") < 3.0:
        fleet(c, clock, "r3", 6.0, 1)
        seen += 1
        assert seen < 40
        if seen < SHIFT_AFTER:
            assert c.replica_factor("r3") < 1.5
    assert seen == SHIFT_AFTER
    assert c.replica_factor("r3") == pytest.approx(6.0, rel=0.2)
    fleet(c, clock, "r3", 1.0, SHIFT_AFTER)  # recovered: as fast back down
    assert c.replica_factor("r3") < 1.5


def test_no_step_change_from_full_batch_waits_queues_or_alternating_answers():
    """With a full batch a run of long waits is the batch, not the replica (the slot-wait regime's residuals are
    heavy-tailed by design); behind a queue the residual is the queue's estimate as much as the replica; nor does a
    slow answer between fast ones make a step."""
    clock = Clock()
    c = TtftCorrector(clock=clock)
    fleet(c, clock, "r3", 1.0, 20)
    for _ in range(10):
        clock.now += 0.1
        c.observe("p", 1.0, 5.0, SLOT_WAIT, "r3")
    assert c.replica_factor("r3") < 3.0  # the EWMA's share only
    c.reset_replica("r3")
    fleet(c, clock, "r3", 1.0, 20)
    for ratio in (6.0, 6.0, 1.0, 6.0, 6.0, 1.0):
        fleet(c, clock, "r3", ratio, 1)
    assert c.replica_factor("r3") < 2.0
    c.reset_replica("r3")
    fleet(c, clock, "r3", 1.0, 20)
    fleet(c, clock, "r3", 6.0, SHIFT_AFTER, alone=False)  # behind a queue: the residual carries its estimate
    assert c.replica_factor("r3") < 2.0


def test_an_unobserved_replica_decays_back_and_a_reset_forgets():
    clock = Clock()
    c = TtftCorrector(replica_half_life_s=30.0, clock=clock)
    fleet(c, clock, "r3", 6.0, 80)
    high = c.replica_factor("r3")
    assert high > 4
    clock.now += 30.0  # one half-life with no traffic to it
    assert c.replica_factor("r3") == pytest.approx(1 + (high - 1) / 2)
    c.reset_replica("r3")
    assert c.replica_factor("r3") == 1.0


def test_off_it_is_one_correction_per_pool():
    clock = Clock()
    c = TtftCorrector(per_replica=False, clock=clock)
    fleet(c, clock, "r3", 6.0, 80)
    assert c.get("p", FREE, "r3") == c.get("p", FREE, "r0") == c.get("p", FREE)


def test_routing_moves_new_requests_off_the_slow_replica():
    """The policy reads the corrected prediction: with the slow replica's factor learned, a cold request whose SLA
    the slow replica would miss goes to a healthy one even when the slow one is the least loaded."""
    clock = Clock()
    c = TtftCorrector(clock=clock)
    fleet(c, clock, "r0", 1.0, 20)
    fleet(c, clock, "r0", 6.0, 60)
    infos = [TargetInfo(f"r{i}", f"r{i}@0", "p", T, None, None) for i in range(4)]
    loads = {"r0": LoadView(0, 0), **{f"r{i}": LoadView(4000, 4) for i in range(1, 4)}}
    req = RoutingRequest("x", "t", "m", "chat/completions", True, 6000, 100, ttft_sla_s=2.0)
    cands = build_candidates(req, infos, {}, loads, c.get, 256)
    by = {x.name: x for x in cands}
    assert by["r0"].ttft > 2.0 > max(by[f"r{i}"].ttft for i in range(1, 4))
    assert by["r0"].ttft_raw < by["r1"].ttft_raw  # the least loaded by the model alone
    d = prefix_sla_cost.PrefixSlaCost(prefix_sla_cost.Params(), PolicyContext(chunk_tokens=256))(req, cands)
    assert d.chosen.name != "r0"
    assert by["r0"].explain()["ttft_correction"] == pytest.approx(c.get("p", FREE, "r0"), rel=0.01)


def test_a_slow_warm_replica_keeps_no_stickiness():
    """Short prompts: a 3x slower replica holding the prefix is predicted well within the SLA and within the 1 s
    stickiness penalty of a cold healthy one, so stickiness alone would keep sending it the group. Its own
    correction past `slow_replica_factor` takes that away (`slow_replica`); off (0), it keeps the request."""
    clock = Clock()
    c = TtftCorrector(clock=clock)
    fleet(c, clock, "r0", 1.0, 20)
    fleet(c, clock, "r0", 3.0, SHIFT_AFTER)
    infos = [TargetInfo(f"r{i}", f"r{i}@0", "p", T, None, None) for i in range(4)]
    req = RoutingRequest("x", "t", "m", "chat/completions", True, 4000, 64, ttft_sla_s=2.22)
    cands = build_candidates(req, infos, {"r0@0": 2000 // 256}, {}, c.get, 256)
    by = {x.name: x for x in cands}
    assert by["r0"].slowness == pytest.approx(c.replica_factor("r0")) and by["r0"].slowness > 2
    assert by["r1"].slowness == pytest.approx(1.0, abs=0.2)
    assert by["r0"].ttft < 2.0 and by["r0"].ttft - by["r1"].ttft < 1.0  # feasible and inside the penalty
    ctx = PolicyContext(chunk_tokens=256)
    d = prefix_sla_cost.PrefixSlaCost(prefix_sla_cost.Params(), ctx)(req, cands)
    assert d.branch == "slow_replica" and d.chosen.name != "r0"
    off = prefix_sla_cost.PrefixSlaCost(prefix_sla_cost.Params(slow_replica_factor=0), ctx)(req, cands)
    assert off.branch == "prefix_hit" and off.chosen.name == "r0"
    assert by["r0"].explain()["replica_slowness"] == pytest.approx(by["r0"].slowness, rel=0.01)


def test_slow_replica_factor_is_off_or_past_one():
    with pytest.raises(ValueError, match="slow_replica_factor"):
        prefix_sla_cost.Params(slow_replica_factor=0.5)
