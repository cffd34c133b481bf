"""The default policy's load bound on the requests in flight at each replica, as pure functions on fixed inputs: prefix
affinity alone keeps each prompt group where it first landed, so the groups of a replica taken out of routing pile on
whichever peer the hash names; the bound passes a request on once its warm replica holds far more in flight than its
peers, and leaves every choice to affinity at light load (a conversation's turns stay with its context)."""

import pytest
from pydantic import ValidationError

from gateway.config import GpuHourPricing, PoolTiming, Routing
from gateway.prediction.ttft import LoadView, TtftCorrector
from gateway.routing.engine import RoutingEngine
from gateway.routing.features import TargetInfo, build_candidates
from gateway.routing.policies import prefix_sla_cost
from gateway.routing.policy import PolicyContext
from gateway.routing.request import RoutingRequest

GPU = GpuHourPricing(gpus_per_replica=4, usd_per_gpu_hour=2.1, prefill_tokens_per_s=16_700, decode_tokens_per_s=3_600)
T = PoolTiming()
P = prefix_sla_cost.Params()  # the default: on, factor 2
INFOS = [TargetInfo(f"r{i}", f"r{i}@0", "mi355x", T, GPU, None) for i in range(4)]


def req(i: int = 0, group: int = 7) -> RoutingRequest:
    return RoutingRequest(f"x{i}", "t", "glm", "chat/completions", True, 4000, 64, tuple(range(group, group + 15)),
                          2.22, group_key=group)


def inflight(*counts: float, queued: float = 0.0) -> dict[str, LoadView]:
    """Requests in flight per replica r0.. (decoding: no prefill queued unless `queued`, tokens each)."""
    return {f"r{i}": LoadView(queued_prefill_tokens=queued, inflight=n) for i, n in enumerate(counts)}


def decide(matches, loads, params=P, infos=INFOS):
    r = req()
    cands = build_candidates(r, infos, matches, loads, TtftCorrector().get, 256)
    return prefix_sla_cost.PrefixSlaCost(params, PolicyContext(chunk_tokens=256))(r, cands)


def test_the_bound_is_on_by_default_at_factor_2():
    assert prefix_sla_cost.Params().load_bound_factor == 2.0
    assert Routing.model_validate({}).policy.load_bound_factor == 2.0  # type: ignore[union-attr]


@pytest.mark.parametrize("loads", [
    inflight(0, 0, 0, 0),  # nothing in flight anywhere: a conversation's next turn
    inflight(0, 1, 0, 0),  # its own previous request still streaming
    inflight(0, 3, 0, 0),  # three on the warm replica, none elsewhere: fewer in flight than replicas
    inflight(1, 2, 0, 0),
])
def test_light_load_keeps_the_warm_choice(loads):
    """While the fleet holds fewer requests in flight than it has replicas, however they sit, affinity decides."""
    d = decide({"r1@0": 7}, loads)
    assert d.branch == "prefix_hit" and d.chosen.name == "r1"


@pytest.mark.parametrize("n", [2, 3, 6, 20])
def test_two_replicas_never_bound_a_conversation_at_factor_2(n):
    """The engine tier's shape (two servers): one replica cannot hold more than twice the mean, so every turn stays
    where its context is, however many are in flight there."""
    d = decide({"r1@0": 7}, inflight(0, n), infos=INFOS[:2])
    assert d.branch == "prefix_hit" and d.chosen.name == "r1"


def test_a_warm_replica_within_twice_the_mean_keeps_its_group():
    """Under load, unevenly but within the bound: 5 in flight on r1 against a mean of 3.5 (bound 2 x 15/4 = 7.5)."""
    d = decide({"r1@0": 7}, inflight(3, 5, 3, 3))
    assert d.branch == "prefix_hit" and d.chosen.name == "r1"


def test_one_replica_far_above_its_peers_diverts_to_a_warm_one_under_the_bound():
    """r1 holds 16 in flight, its peers 1 each (bound max(2 x 20/4, a quarter of 48 slots) = 12): the group, warm on r1
    and r3, goes to r3; the decision says why."""
    d = decide({"r1@0": 7, "r3@0": 7}, inflight(1, 16, 1, 1))
    assert d.branch == "load_bound" and d.chosen.name == "r3"


def test_the_piled_peer_of_a_replica_out_of_routing_passes_groups_on():
    """Three replicas left (the fourth out): r1 took the displaced groups and holds 14 in flight, its peers 0 and 1
    (bound max(2 x 16/3, 12) = 12): the group, warm only on r1, is placed on the ring among those under the bound,
    the same replica on every instance with this view."""
    infos = INFOS[:3]
    d = decide({"r1@0": 7}, inflight(0, 14, 1), infos=infos)
    assert d.branch == "load_bound" and d.chosen.name in ("r0", "r2")
    assert decide({"r1@0": 7}, inflight(0, 14, 1), infos=infos).chosen.name == d.chosen.name


def test_queued_prefill_does_not_count_as_requests():
    """The bound counts requests in flight; the prefill queued behind them is the TTFT model's (and the SLA's): the
    warm replica with 8k tokens queued is still at the bound (3 with this one, 2 x 6/4), not past it."""
    loads = inflight(1, 2, 1, 1)
    loads["r1"] = LoadView(queued_prefill_tokens=8_000, inflight=2)
    assert decide({"r1@0": 7}, loads).branch == "prefix_hit"


def test_the_bound_counts_only_feasible_self_hosted_replicas():
    """A replica predicted past the SLA is no alternative: with the only one under the bound infeasible, the warm
    choice keeps the request."""
    one = prefix_sla_cost.Params(load_bound_factor=1)
    assert decide({"r1@0": 7}, inflight(16, 16, 16, 0), one).chosen.name == "r3"  # bound 49/4: r3 alone under it
    loads = inflight(16, 16, 16, 0)
    loads["r3"] = LoadView(queued_prefill_tokens=40_000, inflight=0)  # ~2.8 s predicted, limit 2.0 s
    assert decide({"r1@0": 7}, loads, one).chosen.name == "r1"  # among the feasible three, bound 49/3: none under


def test_a_quarter_of_the_running_slots_is_never_past_the_bound():
    """The floor: r1 holds 8 in flight against peers at 1 (twice the mean is 6), but with this request 9 of its 48
    running slots: a batch that small decodes about as fast as an empty one, and moving the request recomputes its
    context, so affinity keeps it. Past a quarter of the slots (12) the bound binds as before; floor 0 is the bound
    without it; the floor is a share of the slots."""
    assert prefix_sla_cost.Params().load_bound_floor == 0.25
    assert decide({"r1@0": 7}, inflight(1, 8, 1, 1)).branch == "prefix_hit"
    assert decide({"r1@0": 7}, inflight(1, 11, 1, 1)).branch == "prefix_hit"  # 12 with this one: at the floor
    assert decide({"r1@0": 7}, inflight(1, 12, 1, 1)).branch == "load_bound"  # 13: past it (and past 2 x 16/4)
    no_floor = prefix_sla_cost.Params(load_bound_floor=0)
    d = decide({"r1@0": 7, "r3@0": 7}, inflight(1, 8, 1, 1), no_floor)
    assert d.branch == "load_bound" and d.chosen.name == "r3"
    for bad in (-0.1, 1.5):
        with pytest.raises(ValidationError, match="load_bound_floor"):
            Routing.model_validate({"policy": {"type": "prefix_sla_cost", "load_bound_floor": bad}})


def test_factor_0_turns_it_off_and_under_1_is_refused():
    assert decide({"r1@0": 7}, inflight(1, 16, 1, 1), prefix_sla_cost.Params(load_bound_factor=0)).branch == "prefix_hit"
    for bad in (0.5, -1, 101):
        with pytest.raises(ValidationError, match="load_bound_factor"):
            Routing.model_validate({"policy": {"type": "prefix_sla_cost", "load_bound_factor": bad}})


def test_the_engine_reads_the_tracked_load_and_explain_shows_it():
    """The bound reads the loads the engine is given (the load tracker's, with reservations): the same request is
    kept or passed on by them alone."""
    policy = prefix_sla_cost.PrefixSlaCost(P, PolicyContext(chunk_tokens=256))
    eng = RoutingEngine(policy, uses_prefix=True, chunk_tokens=256, corrector=TtftCorrector(),
                        speculative_ttl_s=10, residency_ttl_s=900)
    assert eng.decide(req(1), INFOS, {"r2@0": 7}, inflight(0, 0, 1, 0)).chosen.name == "r2"
    d = eng.decide(req(2), INFOS, {"r2@0": 7}, inflight(1, 1, 16, 1))
    assert d.branch == "load_bound" and d.chosen is not None and d.chosen.name != "r2"
    assert {c["replica"]: c["inflight"] for c in d.explain()["candidates"]}["r2"] == 16
