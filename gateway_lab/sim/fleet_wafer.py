"""The Wafer workload in token space on the virtual-clock fleet (sim/fleet.py): shared-prefix groups arriving as a
Poisson stream, and the figures loadtests/fleet_des.py and tests/lab/sim/test_fleet_des.py read (hit rate, TTFT, SLA,
spill share, $/Mtok)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.config import Routing
from gateway.prediction.ttft import TtftCorrector
from gateway.prefix.hashing import chain, group_key
from gateway.routing.request import RoutingRequest
from gateway_lab.sim.fleet import CHUNK, DEFAULT_Z, Fleet, Job, cost_usd, mi355x_targets
from gateway_lab.sim.stats import nearest_rank, window_throughput


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
              shortest_prefill_first: bool | None = None, replica_correction: bool = True) -> FleetResult:
    params: dict[str, Any] = {"type": policy}
    if recompute_weight is not None:
        params["recompute_weight"] = recompute_weight
    routing = Routing.model_validate({"policy": params, "ttft_quantile_z": quantile_z, "chunk_tokens": CHUNK})
    if shortest_prefill_first is not None:
        routing = routing.model_copy(update={"shortest_prefill_first": shortest_prefill_first})
    targets = mi355x_targets(nodes * 2, b200_replicas)
    fleet = Fleet(targets, routing, gateways, shared, seed,
                  corrector=lambda: TtftCorrector(z=quantile_z, split_regimes=split_regimes,
                                                  per_replica=replica_correction))
    infos = {i.name: i for i in fleet.infos}
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    n_groups = groups_per_node * nodes
    prefixes = [nrng.integers(0, 150_000, 12_000, dtype=np.uint32) for _ in range(n_groups)]
    seed_bytes = b"glm-5.2\x00tenant"
    group_hashes = [chain(seed_bytes, [p[k * CHUNK:(k + 1) * CHUNK].tobytes() for k in range(12_000 // CHUNK)]) for p in prefixes]
    page_keys = fleet.ranks[targets[0][0].name].rank.cache.page_keys  # rank-independent chain keys
    if warm:  # every group's prefix already cached somewhere, as in a fleet that has been running
        for g, p in enumerate(prefixes):
            fleet.warm(targets[g % (nodes * 2)][0].name, page_keys(p, "tenant"), group_hashes[g])

    def arrivals() -> Iterator[tuple[float, Callable[[], Job]]]:
        total_rate = rate_per_node * nodes
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(total_rate)
            if t > duration:
                return
            g = rng.randrange(n_groups)

            def make(g: int = g, i: int = i) -> Job:
                tokens = np.concatenate([prefixes[g], nrng.integers(0, 150_000, 8_000, dtype=np.uint32)])
                hashes = tuple(group_hashes[g]) + tuple(
                    int(x) for x in nrng.integers(-2**63, 2**63 - 1, 78 - len(group_hashes[g]), dtype=np.int64))
                req = RoutingRequest(f"r{i}", "tenant", "glm-5.2", "chat/completions", True, 20_000, 1000, hashes,
                                     sla_s, "cost", "spill", group_key(hashes, i))
                return Job(req, page_keys(tokens, "tenant"), 20_000, 1000)

            yield t, make
            i += 1

    fleet.feed(arrivals())
    recs = fleet.run()
    done = [r for r in recs if r.ttft is not None]
    ttft = sorted(r.ttft for r in done if r.ttft is not None)
    branches: dict[str, int] = {}
    for r in recs:
        branches[r.branch] = branches.get(r.branch, 0) + 1
    tok_s = window_throughput((r.arrival for r in recs), ((r.end, 1000) for r in done if r.end is not None))
    cost = sum(cost_usd(infos[r.name], r) for r in done)
    return FleetResult(
        policy if gateways == 1 else f"{policy} x{gateways} {'shared' if shared else 'unshared'}", nodes, rate_per_node,
        len(recs), sum(r.cached for r in done) / (20_000 * len(done)), nearest_rank(ttft, 0.5),
        nearest_rank(ttft, 0.95), sum(x <= sla_s for x in ttft) / len(ttft),
        sum(not r.self_hosted for r in recs) / len(recs), cost / (1000 * len(done)) * 1e6, tok_s, branches)


__all__ = ["FleetResult", "run_fleet"]
