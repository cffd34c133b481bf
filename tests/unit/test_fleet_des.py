"""The routing core on the virtual clock (same policy, features, index and feedback code as the gateway, no I/O):
a 4-node MI355X fleet with a B200 overflow pool, Wafer workload, fixed seed — deterministic."""

from gateway.sim.fleet import run_fleet


def test_default_policy_keeps_the_sla_and_the_cache_below_capacity():
    r = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, b200_replicas=4)
    assert r.within_sla >= 0.98 and r.hit_rate >= 0.55 and r.spill_share <= 0.05


def test_quantile_planning_spills_earlier_past_the_knee():
    """At 1.5x capacity, planning against mean + 1.65 std of the TTFT correction keeps more requests within the
    SLA than planning against the mean, by spilling more to the B200 pool."""
    mean = run_fleet("prefix_sla_cost", 4, 1.5 * 2.4, 120, 0, b200_replicas=8)
    p95 = run_fleet("prefix_sla_cost", 4, 1.5 * 2.4, 120, 0, b200_replicas=8, quantile_z=1.65)
    assert p95.within_sla >= 0.98 > mean.within_sla
    assert p95.ttft_p95 < mean.ttft_p95 and p95.spill_share > mean.spill_share
