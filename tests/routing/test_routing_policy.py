"""The default policy as a pure function: table-driven, no I/O, fixed inputs."""

import pytest

from gateway.config import GpuHourPricing, PerTokenPricing, PoolTiming
from gateway.prediction.ttft import FREE, SLOT_WAIT, LoadView, TtftCorrector, predict_ttft, regime, slot_interval
from gateway.routing.features import TargetInfo, build_candidates
from gateway.routing.policies import least_loaded, prefix_sla_cost, round_robin
from gateway.routing.policy import PolicyContext
from gateway.routing.request import RoutingRequest
from gateway.routing.ring import place

GPU = GpuHourPricing(gpus_per_replica=4, usd_per_gpu_hour=2.1, prefill_tokens_per_s=16_700, decode_tokens_per_s=3_600)
TOKEN = PerTokenPricing(input_per_mtok=1.0, cached_input_per_mtok=0.2, output_per_mtok=3.2)
T = PoolTiming()
P = prefix_sla_cost.Params()


def infos(n_self=3, hosted=True):
    out = [TargetInfo(f"r{i}", f"r{i}@0", "mi355x", T, GPU, None) for i in range(n_self)]
    if hosted:
        out.append(TargetInfo("b200", "b200@0", "b200", PoolTiming(base_s=0.12, prefill_tokens_per_s=20_000), TOKEN, None))
    return out


def req(**kw):
    base = dict(request_id="x", tenant="t", model="glm", endpoint="chat/completions", stream=True, prompt_tokens=20_000,
                max_output_tokens=1000, hashes=tuple(range(78)), ttft_sla_s=2.22, group_key=12345)
    base.update(kw)
    return RoutingRequest(**base)


def decide(matches, loads=None, params=P, hosted=True, **kw):
    r = req(**kw)
    cands = build_candidates(r, infos(hosted=hosted), matches, loads or {}, TtftCorrector().get, 256)
    return prefix_sla_cost.PrefixSlaCost(params, PolicyContext(chunk_tokens=256))(r, cands)


def test_warm_replica_wins_while_it_meets_the_sla():
    d = decide({"r1@0": 46})
    assert d.branch == "prefix_hit" and d.chosen.name == "r1"
    assert [t.name for t in d.ranked][-1] == "b200"  # the per-token pool is the last resort


def test_stickiness_breaks_per_request_when_the_warm_replica_is_much_slower():
    """Warm r1 (1.83 s predicted) vs cold self-hosted replicas (1.34 s) and the per-token pool (1.12 s): under a
    0.3 s penalty the cheapest faster one (a cold self-hosted replica) takes it; under 0.8 s r1 keeps it. The load
    bound is off here: r1 alone holds requests in flight, past it (tests/routing/test_load_bound.py)."""
    busy = {"r1": LoadView(queued_prefill_tokens=20_000, inflight=10)}
    d = decide({"r1@0": 46}, busy, params=prefix_sla_cost.Params(stickiness_penalty_ms=300, load_bound_factor=0))
    assert d.branch == "sticky_break" and d.chosen.name != "r1"
    assert d.chosen.self_hosted
    kept = decide({"r1@0": 46}, busy, params=prefix_sla_cost.Params(stickiness_penalty_ms=800, load_bound_factor=0))
    assert kept.chosen.name == "r1"


PLAIN = prefix_sla_cost.Params(recompute_weight=0)  # the SLA alone decides


def test_warm_replica_past_the_sla_is_left_for_a_feasible_one_when_recompute_is_free():
    over = {"r1": LoadView(queued_prefill_tokens=30_000, inflight=10)}  # 2.43 s predicted > 2.0 s limit
    d = decide({"r1@0": 46}, over, params=PLAIN)
    assert d.chosen.name not in ("r1", "b200") and d.branch == "cold_ring"


def test_warm_replica_a_little_past_the_sla_beats_recomputing_its_context():
    """A fleet with no per-token pool: r1 holds 11.8k of the 20k tokens and is predicted 2.43 s (limit 2.0 s) behind
    a few long prefills; a cold replica would take 1.34 s but recompute 0.7 s of prefill that every request queued
    behind it waits for: at weight 14 that is 9.8 s of others' waiting, so the warm replica wins; the feasible replicas
    stay as fallbacks. Loaded with many requests instead, r1 is left: moving its prefix spreads that load."""
    over = {"r1": LoadView(queued_prefill_tokens=30_000, inflight=3)}
    many = {"r1": LoadView(queued_prefill_tokens=30_000, inflight=T.max_running / 8 + 1)}
    assert decide({"r1@0": 46}, many, hosted=False).branch == "cold_ring"
    d = decide({"r1@0": 46}, over, hosted=False)
    assert d.branch == "warm_over_sla" and d.chosen.name == "r1"
    assert {t.name for t in d.ranked[1:]} == {"r0", "r2"}
    # at weight 1 the cold replica's 1.34 + 0.7 s is below 2.43 s: the SLA keeps it
    assert decide({"r1@0": 46}, over, params=prefix_sla_cost.Params(recompute_weight=1), hosted=False).chosen.name != "r1"
    # a tenant that sheds on SLA misses is never sent to a replica predicted past its SLA
    assert decide({"r1@0": 46}, over, on_sla_miss="shed", hosted=False).branch == "cold_ring"
    # with a per-token pool to spill to, the SLA decides as before (the cold feasible replica)
    assert decide({"r1@0": 46}, over).branch == "cold_ring"


def test_recompute_weight_never_keeps_a_replica_from_the_per_token_spill():
    """With a per-token pool among the candidates the SLA decides: when no self-hosted replica meets it the spill
    still happens, however warm the replica past it and however high the weight."""
    full = {f"r{i}": LoadView(queued_prefill_tokens=60_000, inflight=60) for i in range(3)}
    d = decide({"r0@0": 77}, full, params=prefix_sla_cost.Params(recompute_weight=1000))
    assert d.branch == "sla_spill" and d.chosen.name == "b200"


def test_cold_prefix_goes_where_the_ring_says_and_every_instance_agrees():
    a = decide({})
    b = decide({})
    assert a.branch == "cold_ring" and a.chosen.name == b.chosen.name
    assert a.chosen.name == place(12345, ["r0", "r1", "r2"], {})[0]


def test_spill_to_per_token_pool_only_when_self_hosted_cannot_meet_the_sla():
    full = {f"r{i}": LoadView(queued_prefill_tokens=60_000, inflight=60) for i in range(3)}
    d = decide({"r0@0": 46}, full)
    assert d.branch == "sla_spill" and d.chosen.name == "b200"


def test_no_feasible_replica_least_ttft_or_shed():
    every = {n: LoadView(queued_prefill_tokens=200_000, inflight=80) for n in ("r0", "r1", "r2", "b200")}
    every["r2"] = LoadView(queued_prefill_tokens=150_000, inflight=80)
    d = decide({}, every)
    assert d.branch == "sla_miss_least_ttft" and d.chosen.name == "r2"
    # r0 holds most of the prompt: its fleet delay (TTFT + weight x recomputed prefill) is the least, though r2 is
    # 3 s faster; with recompute free the least TTFT wins again
    # (in a fleet with no per-token pool; with one, the least TTFT as before)
    warm = decide({"r0@0": 70}, every, hosted=False)
    assert warm.branch == "sla_miss_warm" and warm.chosen.name == "r0" and warm.ranked[1].name == "r2"
    assert decide({"r0@0": 70}, every, params=PLAIN, hosted=False).chosen.name == "r2"
    assert decide({"r0@0": 70}, every).branch == "sla_miss_least_ttft"
    shed = decide({}, every, on_sla_miss="shed")
    assert shed.branch == "shed" and shed.ranked == () and shed.inputs.retry_after_s >= 1


def test_latency_objective_takes_the_fastest():
    r = req(objective="latency")
    cands = build_candidates(r, infos(), {"r1@0": 46}, {"r1": LoadView(queued_prefill_tokens=5_000, inflight=2)}, TtftCorrector().get, 256)
    d = prefix_sla_cost.PrefixSlaCost(P, PolicyContext(chunk_tokens=256))(r, cands)
    fastest = min(cands, key=lambda c: c.ttft)
    assert d.branch == "latency" and d.chosen.name == fastest.name
    assert [t.name for t in d.ranked] == [c.name for c in sorted(cands, key=lambda c: c.ttft)]


def test_features_cap_cached_below_prompt_and_price_cached_input():
    r = req(prompt_tokens=1000)
    c = build_candidates(r, infos(1, hosted=True), {"r0@0": 10, "b200@0": 0}, {}, TtftCorrector().get, 256)
    assert c[0].cached_tokens == 999 and c[0].uncached_tokens == 1
    assert c[1].cost > c[0].cost


@pytest.mark.parametrize("inflight,extra", [(0, 0.0), (47, 0.0), (48, 1.0), (57, 10.0)])
def test_ttft_prediction_has_the_48_request_knee(inflight, extra):
    base = predict_ttft(T, LoadView(0, 0), 8000)
    got = predict_ttft(T, LoadView(0, inflight), 8000)
    assert got - base == pytest.approx(extra * slot_interval(T))
    assert base == pytest.approx(0.14 + 8000 / 16_700)


def test_corrector_learns_and_clamps():
    c = TtftCorrector(alpha=0.5)
    for _ in range(20):
        c.observe("p", 1.0, 1.5)
    assert c.get("p") == pytest.approx(1.5, rel=0.01)
    for _ in range(20):
        c.observe("p", 1.0, 100.0)
    assert c.get("p") == pytest.approx(3.0)


def test_quantile_correction_plans_against_the_spread_not_the_mean():
    """z > 0: a pool whose TTFT scatters around the prediction is planned at mean + z std (a steady one is not), so
    a p95 SLA is met by the request's p95 rather than its mean; z = 0 is the plain EWMA."""
    plain, p95 = TtftCorrector(alpha=0.05), TtftCorrector(alpha=0.05, z=1.65)
    for i in range(400):
        ratio = 1.0 + (0.5 if i % 2 else -0.5)  # mean 1.0, std 0.5
        for c in (plain, p95):
            c.observe("scattered", 1.0, ratio)
            c.observe("steady", 1.0, 1.2)
    assert plain.get("scattered") == pytest.approx(1.0, abs=0.05)
    assert p95.get("scattered") == pytest.approx(1.0 + 1.65 * 0.5, abs=0.08)
    assert p95.get("steady") == pytest.approx(plain.get("steady"), abs=1e-3) == pytest.approx(1.2, abs=1e-3)


def test_full_batch_regime_learns_apart_and_starts_pessimistic():
    """With a free running slot the model is close; with a full batch the wait depends on when running requests end,
    so that regime has its own correction, pessimistic (the clamp) until it has been observed."""
    c = TtftCorrector(alpha=0.5)
    assert c.get("p", FREE) == 1.0 and c.get("p", SLOT_WAIT) == pytest.approx(3.0)
    for _ in range(20):
        c.observe("p", 1.0, 0.9, FREE)
        c.observe("p", 1.0, 1.8, SLOT_WAIT)
    assert c.get("p", FREE) == pytest.approx(0.9, rel=0.01) and c.get("p", SLOT_WAIT) == pytest.approx(1.8, rel=0.01)
    shared = TtftCorrector(alpha=0.5, split_regimes=False)
    assert shared.get("p", SLOT_WAIT) == 1.0
    for _ in range(20):
        shared.observe("p", 1.0, 0.9, FREE)
        shared.observe("p", 1.0, 1.8, SLOT_WAIT)
    assert shared.get("p", FREE) == shared.get("p", SLOT_WAIT) < 1.8


def test_regime_follows_the_running_slots():
    assert regime(T, LoadView(0, T.max_running - 1)) == FREE  # this request takes the last slot
    assert regime(T, LoadView(0, T.max_running)) == SLOT_WAIT  # it would be the 49th
    cands = build_candidates(req(), infos(2, hosted=False), {}, {"r0": LoadView(0, T.max_running)}, TtftCorrector().get, 256)
    full, free = cands
    assert (full.regime, free.regime) == (SLOT_WAIT, FREE) and full.ttft == pytest.approx(3.0 * full.ttft_raw)


def test_bounded_load_ring_skips_overloaded_and_is_stable():
    names = [f"r{i}" for i in range(8)]
    first = place(99, names, {})[0]
    assert place(99, list(reversed(names)), {}) [0] == first
    assert place(99, names, {first: 5})[0] == first  # small absolute loads never push a prefix away
    over = place(99, names, {first: 50})
    assert over[0] != first and over[-1] == first
    spread = {place(k * 0x9E3779B97F4A7C15, names, {})[0] for k in range(200)}
    assert len(spread) == 8


def test_baselines():
    cands = build_candidates(req(), infos(), {}, {"r0": LoadView(0, 5), "r1": LoadView(0, 1), "r2": LoadView(0, 3)}, TtftCorrector().get, 256)
    assert least_loaded.policy.LeastLoaded()(req(), cands).chosen.name == "r1"
    rr = round_robin.policy.RoundRobin()
    assert [rr(req(), cands).chosen.name for _ in range(4)] == ["r0", "r1", "r2", "r0"]
