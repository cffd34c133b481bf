"""The routing core on the virtual clock (same policy, features, index and feedback code as the gateway, no I/O):
a 4-node MI355X fleet with a B200 overflow pool, Wafer workload, fixed seed — deterministic."""

from gateway_lab.sim.fleet_wafer import run_fleet


def test_default_policy_keeps_the_sla_and_the_cache_below_capacity():
    """Over three seeds: one seed's hit rate moves by about a point with any change to the queue's order (seeds 0-3
    ran 55.0-56.5% with shortest_prefill_first, 55.4-55.9% without), so one seed alone says little."""
    runs = [run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, seed, b200_replicas=4) for seed in range(3)]
    assert all(r.within_sla >= 0.98 and r.spill_share <= 0.05 for r in runs)
    assert sum(r.hit_rate for r in runs) / len(runs) >= 0.55


def test_full_batch_correction_keeps_the_sla_past_the_knee():
    """At 1.5x capacity with a B200 pool for spill, over seeds 0-2: learning the full-batch regime apart (pessimistic
    until seen) keeps ~97% within the SLA (94.7-98.8% per seed); one correction for both regimes (the ablation) lets
    requests queue behind full batches on the free-slot estimate and misses more (90.6-96.6%), with a longer tail."""
    split = [run_fleet("prefix_sla_cost", 4, 1.5 * 2.4, 120, s, b200_replicas=8) for s in range(3)]
    shared = [run_fleet("prefix_sla_cost", 4, 1.5 * 2.4, 120, s, b200_replicas=8, split_regimes=False) for s in range(3)]

    def mean(rs: list, attr: str) -> float:
        return sum(getattr(r, attr) for r in rs) / len(rs)

    assert mean(split, "within_sla") >= 0.965 > mean(shared, "within_sla") + 0.02
    assert mean(split, "ttft_p95") < mean(shared, "ttft_p95")


def test_quantile_planning_spills_earlier_at_normal_load():
    """z > 0 plans against mean + z std of the correction: lower TTFT p95, paid for with more spill."""
    mean = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, b200_replicas=8, quantile_z=0)
    p95 = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, b200_replicas=8, quantile_z=1.65)
    assert p95.ttft_p95 < mean.ttft_p95 and p95.spill_share > mean.spill_share


def test_no_spill_fleet_near_capacity_stays_out_of_overload():
    """4 nodes at 0.95x with nothing to spill to, on engines that prefill first come, first served: with the SLA alone
    deciding (recompute_weight 0), requests that cannot meet it take the replica fastest for them and recompute
    contexts others hold, and seed 0 tips into a full-batch overload (69% within SLA); pricing the recompute keeps it
    out (docs/routing.md: the sweep over seeds 0-7). Measured without the load bound (`load_bound_factor: 0`): at
    1.25 and without its floor the bound alone also keeps this seed out (99.7% within SLA with the SLA alone deciding;
    at its default of 2, 58%; at 1.25 with the default floor of a quarter of the running slots, 75%): it moves
    requests off a replica holding far more in flight than its peers before its queue tips, so the ablation isolates
    the recompute pricing."""
    priced = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, shortest_prefill_first=False, load_bound_factor=0)
    plain = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, recompute_weight=0, shortest_prefill_first=False,
                      load_bound_factor=0)
    assert priced.within_sla >= 0.97 > 0.8 > plain.within_sla
    assert priced.hit_rate > plain.hit_rate
    bounded = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 0, recompute_weight=0, shortest_prefill_first=False,
                        load_bound_factor=1.25, load_bound_floor=0)
    assert bounded.within_sla >= 0.97


def test_shortest_prefill_first_keeps_the_seed_that_tipped_out_of_overload():
    """Seed 3 tipped even with the recompute priced (93.4% within SLA) while turns waited behind cold 20k-token
    prefills queued first; with the gateway's prefill levels (the default) the engines take the cached turns first and
    it holds (99.7%; over seeds 0-7 every seed >= 99.3%, docs/routing.md). Measured without the per-replica TTFT
    correction, which alone also keeps this seed out of overload (99.7% first come, first served): each replica's own
    factor sees its queue of cold prefills and moves turns off it, so the ablation isolates the prefill levels; and
    without the load bound (at 1.25 it does too: 99.5% first come, first served; at its default of 2, 92%)."""
    fcfs = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 3, shortest_prefill_first=False, replica_correction=False,
                     load_bound_factor=0)
    sjf = run_fleet("prefix_sla_cost", 4, 0.95 * 2.4, 120, 3, replica_correction=False, load_bound_factor=0)
    assert sjf.within_sla >= 0.99 > 0.95 > fcfs.within_sla
    assert sjf.hit_rate > fcfs.hit_rate
