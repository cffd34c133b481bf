"""The Wafer single-node experiment on the virtual clock (spec 6.4), with the real scheduler and prefix cache.

Two ranks, Poisson arrivals split round-robin, 20k-token prompts = a warm 12k-token group prefix + 8k new
tokens, 1k output tokens. Used by the unit tests and printed next to the HTTP runs in loadtests/.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from gateway_lab.sim.des import EventLoop, VirtualRank
from gateway_lab.sim.engine import Rank
from gateway_lab.sim.profiles import ReplicaConfig, profile
from gateway_lab.sim.sim_request import Event, EventKind, SimRequest
from gateway_lab.sim.stats import nearest_rank, window_throughput

WAFER_TABLE = {  # rps: (output tok/s, TTFT p50, TTFT p95) — Wafer, one MI355X node, TP4xDP2
    0.5: (449, 0.59, 0.60),
    1.0: (974, 0.60, 0.81),
    1.5: (1913, 0.62, 1.03),
    2.0: (1944, 0.62, 1.05),
    2.25: (2089, 0.63, 1.23),
    2.4: (2626, 0.81, 2.22),
}


@dataclass
class NodeRun:
    tok_s: float
    ttft_p50: float
    ttft_p95: float
    cache_hit: float


def run_node(rps: float, duration: float = 300.0, seed: int = 0, groups: int = 16,
             cfg: ReplicaConfig | None = None, ranks: int = 2) -> NodeRun:
    cfg = cfg or profile("mi355x-glm52-tp4")
    loop = EventLoop()
    vrs = [VirtualRank(Rank(cfg, i, seed), loop) for i in range(ranks)]
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    prefixes = [nrng.integers(0, 150_000, 12_000, dtype=np.uint32) for _ in range(groups)]
    for vr in vrs:
        for p in prefixes:
            vr.rank.cache.insert(vr.rank.cache.page_keys(p), 0.0)  # warm, as the load generator's warm-up does
    recs: list[dict[str, float]] = []
    reqs: list[SimRequest] = []
    t, i = 0.0, 0
    while True:
        t += rng.expovariate(rps)
        if t > duration:
            break
        tokens = np.concatenate([prefixes[rng.randrange(groups)], nrng.integers(0, 150_000, 8_000, dtype=np.uint32)])
        rec: dict[str, float] = {"arrival": t}

        def sink(ev: Event, rec: dict[str, float] = rec) -> None:
            if ev.kind is EventKind.FIRST:
                rec["ttft"] = ev.time + cfg.timing.t_api - rec["arrival"]
            elif ev.kind is EventKind.FINISH:
                rec["end"] = ev.time + cfg.timing.t_api

        vr = vrs[i % ranks]
        req = SimRequest(f"w{i}", vr.rank.cache.page_keys(tokens), 20_000, 1000, "length", t, sink)

        def arrive(vr: VirtualRank = vr, req: SimRequest = req) -> None:
            vr.rank.submit(req)
            vr.kick()

        loop.at(t, arrive)
        recs.append(rec)
        reqs.append(req)
        i += 1
    loop.run()
    tok_s = window_throughput((r["arrival"] for r in recs), ((r["end"], 1000) for r in recs if "end" in r))
    ttft = sorted(r["ttft"] for r in recs)
    hit = sum(r.cached for r in reqs) / sum(r.prompt_len for r in reqs)
    return NodeRun(tok_s, nearest_rank(ttft, 0.5), nearest_rank(ttft, 0.95), hit)
