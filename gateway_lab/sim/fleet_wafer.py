"""The Wafer workload in token space on the virtual-clock fleet (sim/fleet.py): shared-prefix groups arriving as a
Poisson stream, and the figures loadtests/fleet_des.py and tests/lab/sim/test_fleet_des.py read (hit rate, TTFT, SLA,
spill share, $/Mtok)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.config import Routing
from gateway.prediction.ttft import TtftCorrector
from gateway_lab.sim.fleet import CHUNK, DEFAULT_Z, Fleet, cost_usd, mi355x_targets
from gateway_lab.sim.stats import nearest_rank, window_throughput
from gateway_lab.sim.wafer_groups import OUTPUT_TOKENS, PROMPT_TOKENS, WaferGroups


@dataclass
class FleetResult:
    policy: str
    nodes: int
    rate: float
    requests: int
    hit_rate: float
    ttft_p50: float
    ttft_p95: float
    within_sla: float
    spill_share: float
    usd_per_mtok_out: float
    tok_s: float
    branches: dict[str, int] = field(default_factory=dict)

    def row(self) -> list[Any]:
        return [self.policy, self.nodes, self.rate, self.requests, f"{self.hit_rate * 100:.1f}%", f"{self.ttft_p50:.2f}",
                f"{self.ttft_p95:.2f}", f"{self.within_sla * 100:.1f}%", f"{self.spill_share * 100:.1f}%",
                f"{self.usd_per_mtok_out:.3f}"]


def run_fleet(policy: str, nodes: int, rate_per_node: float, duration: float = 120.0, seed: int = 0,
              groups_per_node: int = 16, b200_replicas: int = 0, gateways: int = 1, shared: bool = True,
              sla_s: float = 2.22, warm: bool = True, quantile_z: float = DEFAULT_Z,
              split_regimes: bool = True, recompute_weight: float | None = None,
              shortest_prefill_first: bool | None = None, replica_correction: bool = True,
              load_bound_factor: float | None = None, load_bound_floor: float | None = None) -> FleetResult:
    params: dict[str, Any] = {"type": policy}
    if recompute_weight is not None:
        params["recompute_weight"] = recompute_weight
    if load_bound_factor is not None:
        params["load_bound_factor"] = load_bound_factor
    if load_bound_floor is not None:
        params["load_bound_floor"] = load_bound_floor
    routing = Routing.model_validate({"policy": params, "ttft_quantile_z": quantile_z, "chunk_tokens": CHUNK})
    if shortest_prefill_first is not None:
        routing = routing.model_copy(update={"shortest_prefill_first": shortest_prefill_first})
    targets = mi355x_targets(nodes * 2, b200_replicas)
    fleet = Fleet(targets, routing, gateways, shared, seed,
                  corrector=lambda: TtftCorrector(z=quantile_z, split_regimes=split_regimes,
                                                  per_replica=replica_correction))
    infos = {i.name: i for i in fleet.infos}
    workload = WaferGroups(groups_per_node * nodes, CHUNK, seed)
    page_keys = fleet.ranks[targets[0][0].name].rank.cache.page_keys  # rank-independent chain keys
    if warm:  # every group's prefix already cached somewhere, as in a fleet that has been running
        for g, p in enumerate(workload.prefixes):
            fleet.warm(targets[g % (nodes * 2)][0].name, page_keys(p, "tenant"), workload.hashes[g])
    fleet.feed(workload.arrivals(rate_per_node * nodes, duration, page_keys, sla_s, "r"))
    recs = fleet.run()
    done = [r for r in recs if r.ttft is not None]
    ttft = sorted(r.ttft for r in done if r.ttft is not None)
    branches: dict[str, int] = {}
    for r in recs:
        branches[r.branch] = branches.get(r.branch, 0) + 1
    tok_s = window_throughput((r.arrival for r in recs), ((r.end, OUTPUT_TOKENS) for r in done if r.end is not None))
    cost = sum(cost_usd(infos[r.name], r) for r in done)
    return FleetResult(
        policy if gateways == 1 else f"{policy} x{gateways} {'shared' if shared else 'unshared'}", nodes, rate_per_node,
        len(recs), sum(r.cached for r in done) / (PROMPT_TOKENS * len(done)), nearest_rank(ttft, 0.5),
        nearest_rank(ttft, 0.95), sum(x <= sla_s for x in ttft) / len(ttft),
        sum(not r.self_hosted for r in recs) / len(recs), cost / (OUTPUT_TOKENS * len(done)) * 1e6, tok_s, branches)


__all__ = ["FleetResult", "run_fleet"]
