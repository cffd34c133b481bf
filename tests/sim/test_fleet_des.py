"""The routing core on the virtual clock (same policy, features, index and feedback code as the gateway, no I/O):
a 4-node MI355X fleet with a B200 overflow pool, Wafer workload, fixed seed — deterministic."""

from gateway.sim.fleet import run_fleet


def test_default_policy_keeps_the_sla_and_the_cache_below_capacity():
    r = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, b200_replicas=4)
    assert r.within_sla >= 0.98 and r.hit_rate >= 0.55 and r.spill_share <= 0.05


def test_full_batch_correction_keeps_the_sla_past_the_knee():
    """At 1.5x capacity with a B200 pool for spill: learning the full-batch regime apart (pessimistic until seen)
    keeps >= 99% within the SLA; one correction for both regimes (the ablation) lets requests queue behind full
    batches on the free-slot estimate and misses more."""
    split = run_fleet("prefix_sla_cost", 4, 1.5 * 2.4, 120, 0, b200_replicas=8)
    shared = run_fleet("prefix_sla_cost", 4, 1.5 * 2.4, 120, 0, b200_replicas=8, split_regimes=False)
    assert split.within_sla >= 0.99 > shared.within_sla
    assert split.ttft_p95 < shared.ttft_p95 <= 2.5


def test_quantile_planning_spills_earlier_at_normal_load():
    """z > 0 plans against mean + z std of the correction: lower TTFT p95, paid for with more spill."""
    mean = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, b200_replicas=8, quantile_z=0)
    p95 = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, b200_replicas=8, quantile_z=1.65)
    assert p95.ttft_p95 < mean.ttft_p95 and p95.spill_share > mean.spill_share


def test_no_spill_fleet_near_capacity_stays_out_of_overload():
    """4 nodes at 0.95x with nothing to spill to: with the SLA alone deciding (recompute_weight 0), requests that cannot
    meet it take the replica fastest for them and recompute contexts others hold, and seed 0 tips into a full-batch
    overload (69% within SLA); pricing the recompute keeps it out (docs/routing.md: the sweep over seeds 0-7)."""
    priced = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0)
    plain = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, recompute_weight=0)
    assert priced.within_sla >= 0.97 > 0.8 > plain.within_sla
    assert priced.hit_rate > plain.hit_rate
