"""The routing core on a virtual clock: a fleet of simulated ranks, the Wafer workload in token space, and the
same policy, features, prefix index and feedback rules the gateway runs — no HTTP, no sleeping.

One "gateway" = one (index, load view, corrector). `gateways > 1` with `shared=False` gives each instance its own
index and load view (what routers with per-process state do); `shared=True` is the Redis-backed design.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.config import GpuHourPricing, PerTokenPricing, PoolTiming, Routing
from gateway.prediction.pricing import request_cost
from gateway.prediction.ttft import LoadView, TtftCorrector
from gateway.prefix.hashing import chain, group_key
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.routing.features import TargetInfo, build_candidates
from gateway.routing.policies import baselines, prefix_sla_cost
from gateway.routing.request import RoutingRequest
from gateway.sim.des import EventLoop, VirtualRank
from gateway.sim.engine import Event, EventKind, Rank, SimRequest
from gateway.sim.profiles import profile
from gateway.sim.stats import nearest_rank, window_throughput

CHUNK = 256
MI355X_PRICE = GpuHourPricing(gpus_per_replica=4, usd_per_gpu_hour=2.10, prefill_tokens_per_s=16_700, decode_tokens_per_s=3_600)
B200_PRICE = PerTokenPricing(input_per_mtok=1.00, cached_input_per_mtok=0.20, output_per_mtok=3.20)
B200_TIMING = PoolTiming(base_s=0.12, prefill_tokens_per_s=20_000, decode_step_s=0.0365)
DEFAULT_Z = Routing().ttft_quantile_z  # the gateway's default, so the DES runs what a deployment runs


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


class _Gateway:
    def __init__(self, clock: Callable[[], float], index: MemoryPrefixIndex | None,
                 loads: dict[str, list[float]] | None, quantile_z: float, split_regimes: bool) -> None:
        self.index = index or MemoryPrefixIndex(clock=clock, default_capacity=2_400_000 // CHUNK)
        self.loads = loads if loads is not None else {}
        self.corrector = TtftCorrector(z=quantile_z, split_regimes=split_regimes)


def run_fleet(policy: str, nodes: int, rate_per_node: float, duration: float = 120.0, seed: int = 0,
              groups_per_node: int = 16, b200_replicas: int = 0, gateways: int = 1, shared: bool = True,
              sla_s: float = 2.22, warm: bool = True, quantile_z: float = DEFAULT_Z,
              split_regimes: bool = True) -> FleetResult:
    cfg = profile("mi355x-glm52-tp4")
    loop = EventLoop()
    clock = lambda: loop.now  # noqa: E731
    ranks: dict[str, VirtualRank] = {}
    infos: list[TargetInfo] = []
    for i in range(nodes * 2):
        name = f"mi355x-{i}"
        ranks[name] = VirtualRank(Rank(cfg, i, seed), loop)
        infos.append(TargetInfo(name, f"{name}@0", "mi355x", PoolTiming(), MI355X_PRICE))
    b_cfg = profile("b200-glm52")
    for i in range(b200_replicas):
        name = f"b200-{i}"
        ranks[name] = VirtualRank(Rank(b_cfg, 1000 + i, seed), loop)
        infos.append(TargetInfo(name, f"{name}@0", "b200", B200_TIMING, B200_PRICE))
    shared_index = MemoryPrefixIndex(clock=clock, default_capacity=2_400_000 // CHUNK)
    shared_loads: dict[str, list[float]] = {}
    gws = [_Gateway(clock, shared_index if shared else None, shared_loads if shared else None, quantile_z,
                    split_regimes)
           for _ in range(gateways)]
    if policy == "prefix_sla_cost":
        decide: Any = prefix_sla_cost.decide
        params: Any = prefix_sla_cost.Params(min_hit_tokens=CHUNK)
    elif policy == "least_loaded":
        decide, params = baselines.least_loaded, None
    else:
        decide, params = baselines.RoundRobin(), None

    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    n_groups = groups_per_node * nodes
    prefixes = [nrng.integers(0, 150_000, 12_000, dtype=np.uint32) for _ in range(n_groups)]
    seed_bytes = b"glm-5.2\x00tenant"
    group_hashes = [chain(seed_bytes, [p[k * CHUNK:(k + 1) * CHUNK].tobytes() for k in range(12_000 // CHUNK)]) for p in prefixes]
    if warm:  # every group's prefix already cached somewhere, as in a fleet that has been running
        for g, p in enumerate(prefixes):
            name = infos[g % (nodes * 2)].name
            rk = ranks[name].rank
            rk.cache.insert(rk.cache.page_keys(p, "tenant"), 0.0)
            for gw in gws:
                gw.index.insert_sync(f"{name}@0", group_hashes[g], 1e9)

    recs: list[dict[str, Any]] = []
    branches: dict[str, int] = {}
    total_rate = rate_per_node * nodes
    t = 0.0
    i = 0
    while True:
        t += rng.expovariate(total_rate)
        if t > duration:
            break
        g = rng.randrange(n_groups)
        loop.at(t, lambda g=g, i=i, t=t: arrive(g, i, t))
        i += 1

    def load_of(gw: _Gateway, name: str) -> LoadView:
        v = gw.loads.get(name, [0.0, 0.0])
        return LoadView(max(0.0, v[0]), max(0.0, v[1]))

    def arrive(g: int, i: int, t: float) -> None:
        gw = gws[i % gateways]
        unique = nrng.integers(0, 150_000, 8_000, dtype=np.uint32)
        tokens = np.concatenate([prefixes[g], unique])
        hashes = tuple(group_hashes[g]) + tuple(int(x) for x in nrng.integers(-2**63, 2**63 - 1, 78 - len(group_hashes[g]), dtype=np.int64))
        req = RoutingRequest(f"r{i}", "tenant", "glm-5.2", "chat/completions", True, 20_000, 1000, hashes, sla_s,
                             "cost", "spill", group_key(hashes, i))
        matches = gw.index.match_sync(hashes, [x.key for x in infos]) if policy == "prefix_sla_cost" else {}
        loads = {x.name: load_of(gw, x.name) for x in infos}
        cands = build_candidates(req, infos, matches, loads, gw.corrector.get, CHUNK)
        dec = decide(req, cands, params)
        branches[dec.branch] = branches.get(dec.branch, 0) + 1
        chosen = dec.ranked[0]
        cand = next(c for c in cands if c.info is chosen)
        name = chosen.name
        rec: dict[str, Any] = {"arrival": t, "pool": chosen.pool, "name": name}
        recs.append(rec)
        gw.index.insert_sync(chosen.key, hashes, 10.0)
        lv = gw.loads.setdefault(name, [0.0, 0.0])
        lv[0] += cand.uncached_tokens
        lv[1] += 1
        vr = ranks[name]
        t_api = vr.rank.cfg.timing.t_api

        def sink(ev: Event) -> None:
            if ev.kind is EventKind.FIRST:
                rec["ttft"] = ev.time + t_api - t
                lv[0] -= cand.uncached_tokens
                gw.index.insert_sync(chosen.key, hashes, 900.0)
                gw.corrector.observe(chosen.pool, cand.ttft_raw, rec["ttft"], cand.regime)
                real = sim_req.cached
                rec["cached"] = real
                if real < cand.cached_tokens - CHUNK:
                    gw.index.invalidate_sync(chosen.key, hashes[real // CHUNK:cand.matched_chunks])
            elif ev.kind is EventKind.FINISH:
                rec["end"] = ev.time + t_api
                lv[1] -= 1

        sim_req = SimRequest(f"r{i}", vr.rank.cache.page_keys(tokens, "tenant"), 20_000, 1000, "length", t, sink)
        vr.rank.submit(sim_req)
        vr.kick()

    loop.run()
    done = [r for r in recs if "ttft" in r]
    ttft = sorted(r["ttft"] for r in done)
    tok_s = window_throughput((r["arrival"] for r in recs), ((r["end"], 1000) for r in done if "end" in r))
    cost = sum(request_cost(MI355X_PRICE if r["pool"] == "mi355x" else B200_PRICE, 20_000, r.get("cached", 0), 1000)
               for r in done)
    return FleetResult(
        policy if gateways == 1 else f"{policy} x{gateways} {'shared' if shared else 'unshared'}", nodes, rate_per_node,
        len(recs), sum(r.get("cached", 0) for r in done) / (20_000 * len(done)), nearest_rank(ttft, 0.5),
        nearest_rank(ttft, 0.95), sum(x <= sla_s for x in ttft) / len(ttft),
        sum(r["pool"] != "mi355x" for r in recs) / len(recs), cost / (1000 * len(done)) * 1e6, tok_s, branches)


def run_many(policies: Sequence[str], **kw: Any) -> list[FleetResult]:
    return [run_fleet(p, **kw) for p in policies]
