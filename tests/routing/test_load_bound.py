"""The default policy's load bound on recent dispatches, as pure functions on fixed inputs and an injected clock: prefix
affinity alone keeps each prompt group where it first landed, so groups placed unevenly (or moved off a replica taken
out of routing) stay uneven, and a replica back in routing gets nothing back; the bound spreads them."""

import pytest

from gateway.config import GpuHourPricing, PoolTiming
from gateway.prediction.ttft import LoadView, TtftCorrector
from gateway.routing.engine import Attempt, RoutingEngine
from gateway.routing.features import TargetInfo, build_candidates
from gateway.routing.policies import prefix_sla_cost
from gateway.routing.policy import PolicyContext
from gateway.routing.recent import RecentDispatches
from gateway.routing.request import RoutingRequest

GPU = GpuHourPricing(gpus_per_replica=4, usd_per_gpu_hour=2.1, prefill_tokens_per_s=16_700, decode_tokens_per_s=3_600)
T = PoolTiming()
P = prefix_sla_cost.Params(load_bound_factor=1.25)  # off by default; these tests are about the rule when on
INFOS = [TargetInfo(f"r{i}", f"r{i}@0", "mi355x", T, GPU, None) for i in range(4)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def req(i: int = 0, group: int = 7) -> RoutingRequest:
    return RoutingRequest(f"x{i}", "t", "glm", "chat/completions", True, 4000, 64, tuple(range(group, group + 15)),
                          2.22, group_key=group)


def decide(matches, recent, params=P, loads=None, infos=INFOS):
    r = req()
    cands = build_candidates(r, infos, matches, loads or {}, TtftCorrector().get, 256, recent)
    return prefix_sla_cost.PrefixSlaCost(params, PolicyContext(chunk_tokens=256))(r, cands)


def test_recent_dispatches_decay_with_their_time_constant():
    """One dispatch counts 1 at once and 1/e of it a time constant later: smooth over `tau_s`, yet a replica nothing
    is sent to (out of routing) is back near 0 a few time constants on."""
    clock = Clock()
    rd = RecentDispatches(tau_s=20.0, clock=clock)
    rd.record("r0")
    rd.record("r0")
    assert rd.snapshot(["r0", "r1"]) == {"r0": 2.0, "r1": 0.0}
    clock.now += 20.0
    assert rd.snapshot(["r0"])["r0"] == pytest.approx(2 / 2.718281828, rel=1e-6)
    rd.record("r0")
    assert rd.snapshot(["r0"])["r0"] == pytest.approx(1 + 2 / 2.718281828, rel=1e-6)
    clock.now += 100.0
    assert rd.snapshot(["r0"])["r0"] < 0.02


def test_warm_replica_within_the_bound_keeps_its_group():
    """Past the floor but within 1.25x the mean: affinity decides as before."""
    d = decide({"r1@0": 7}, {"r0": 20, "r1": 24, "r2": 20, "r3": 20})
    assert d.branch == "prefix_hit" and d.chosen.name == "r1"


def test_warm_replica_past_the_bound_gives_the_request_to_a_warm_one_under_it():
    """r1 took 40 of the last ~84 dispatches (bound 1.25 x 85/4 = 26.6): the group, warm on r1 and r3, goes to r3,
    the cheapest under the bound; the decision says why."""
    d = decide({"r1@0": 7, "r3@0": 7}, {"r0": 12, "r1": 40, "r2": 20, "r3": 12})
    assert d.branch == "load_bound" and d.chosen.name == "r3"


def test_past_the_bound_with_no_warm_replica_under_it_the_ring_places_it_among_those_under():
    """The group is warm only on the overloaded replica: it is placed as a cold one, on the ring among the replicas
    under the bound, so every instance with the same view picks the same one."""
    recent = {"r0": 12, "r1": 40, "r2": 30, "r3": 2}  # bound 1.25 x 85/4 = 26.6: r1 and r2 are past it
    d = decide({"r1@0": 7}, recent)
    assert d.branch == "load_bound" and d.chosen.name in ("r0", "r3")
    assert decide({"r1@0": 7}, recent).chosen.name == d.chosen.name


def test_a_replica_back_in_routing_takes_groups_again():
    """Back from an ejection (nothing sent to it for a minute: its count near 0) while its peers hold its groups
    (each 1.33x the mean): their warm choices are past the bound, so it is offered requests at once."""
    d = decide({"r0@0": 7}, {"r0": 35, "r1": 35, "r2": 35, "r3": 0.1})
    assert d.branch == "load_bound" and d.chosen.name == "r3"


@pytest.mark.parametrize("recent", [
    {"r0": 0, "r1": 7, "r2": 0, "r3": 0},  # few requests: under the floor, affinity decides (no scattering)
    {"r0": 1, "r1": 40, "r2": 1, "r3": 1},
])
def test_the_floor_and_the_switch(recent):
    """Below MIN_RECENT dispatches a replica is never past the bound; `load_bound_factor: 0` turns the rule off."""
    if recent["r1"] < prefix_sla_cost.policy.MIN_RECENT:
        assert decide({"r1@0": 7}, recent).branch == "prefix_hit"
    else:
        assert decide({"r1@0": 7}, recent).branch == "load_bound"
    assert decide({"r1@0": 7}, recent, prefix_sla_cost.Params(load_bound_factor=0)).branch == "prefix_hit"


def test_the_bound_counts_only_feasible_self_hosted_replicas():
    """A replica predicted past the SLA is no alternative: with the only one under the bound infeasible, the warm
    choice keeps the request."""
    over = {"r3": LoadView(queued_prefill_tokens=40_000, inflight=2)}  # ~2.8 s predicted, limit 2.0 s
    assert decide({"r1@0": 7}, {"r0": 30, "r1": 30, "r2": 30, "r3": 0}, loads=over).chosen.name == "r1"


def test_the_engine_counts_its_dispatches_and_the_candidates_carry_them():
    """`dispatched` records the target; the next decision's candidates read it (and explain shows it)."""
    clock = Clock()
    policy = prefix_sla_cost.PrefixSlaCost(prefix_sla_cost.Params(), PolicyContext(chunk_tokens=256))
    eng = RoutingEngine(policy, uses_prefix=True, chunk_tokens=256, corrector=TtftCorrector(clock=clock),
                        speculative_ttl_s=10, residency_ttl_s=900)
    eng.recent.clock = clock
    for i in range(3):
        d = eng.decide(req(i), INFOS, {"r2@0": 7}, {})
        assert d.chosen is not None
        eng.dispatched(Attempt(req(i), d.chosen, d))
    d = eng.decide(req(9), INFOS, {"r2@0": 7}, {})
    assert d.features["r2"].recent == pytest.approx(3.0)
    assert {c["replica"]: c["recent_dispatches"] for c in d.explain()["candidates"]}["r2"] == 3.0
