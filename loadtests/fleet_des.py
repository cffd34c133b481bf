"""The routing core at fleet scale on a virtual clock (no HTTP): how hit rate and TTFT p95 hold as the fleet grows.

    .venv/bin/python -m loadtests.fleet_des [--nodes 4,16,64] [--rate 2.28] [--duration 120]

Each run: N simulated MI355X nodes (2 TP4 replicas each), 16 session groups per node, the Wafer workload (12k
shared + 8k new tokens, 1k out) at `rate` req/s per node, groups warm on one replica each at the start. Policies:
this router (prefix_sla_cost, one shared index; and two instances with unshared per-process state, the peers'
situation), round_robin, least_loaded. Prints a table, writes loadtests/out/fleet_des.{json,png}.
"""

from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

from gateway_lab.sim.fleet_wafer import FleetResult, run_fleet
from loadtests.report import OUT, save_json, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="4,16,64")
    p.add_argument("--rate", type=float, default=2.28, help="req/s per node (0.95 x 2.4 by default)")
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    a = p.parse_args()
    results: list[FleetResult] = []
    variants = [("prefix_sla_cost", 1, True), ("prefix_sla_cost", 2, False), ("round_robin", 1, True), ("least_loaded", 1, True)]
    sizes = [int(x) for x in a.nodes.split(",")]
    # run_fleet has no per-arrival hook: the bar advances per run, by the run's expected arrivals (its cost grows
    # with the fleet), so the ETA holds when 64 nodes follow 4
    expected = {n: round(n * a.rate * a.duration) for n in sizes}
    bar = tqdm(total=sum(expected.values()) * len(variants), unit="req", file=sys.stderr, leave=False,
               disable=a.no_progress)
    for n in sizes:
        for policy, gws, shared in variants:
            bar.set_description(f"{policy} x{gws} @ {n} nodes")
            t0 = time.time()
            r = run_fleet(policy, n, a.rate, a.duration, a.seed, gateways=gws, shared=shared)
            wall = time.time() - t0
            tqdm.write(f"  {r.policy} @ {n} nodes: hit {r.hit_rate:.3f} p95 {r.ttft_p95:.2f} s ({wall:.0f} s wall)",
                       file=sys.stderr)
            bar.update(expected[n])
            results.append(r)
    bar.close()
    print(f"\nFleet on a virtual clock: Wafer workload at {a.rate} req/s per node, {a.duration:.0f} simulated s per run, "
          "TTFT SLA 2.22 s")
    print(table(["policy", "nodes", "req/s/node", "requests", "hit rate", "TTFT p50", "TTFT p95", "within SLA", "spill",
                 "$/Mtok out"], [r.row() for r in results]))
    save_json("fleet_des", {"args": vars(a), "results": [r.__dict__ for r in results]})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for label in dict.fromkeys(r.policy for r in results):
            rs = [r for r in results if r.policy == label]
            a1.plot([r.nodes for r in rs], [r.hit_rate * 100 for r in rs], marker="o", label=label)
            a2.plot([r.nodes for r in rs], [r.ttft_p95 for r in rs], marker="o", label=label)
        for ax, yl in ((a1, "fleet cache-hit rate (%)"), (a2, "TTFT p95 (s)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("nodes")
            ax.set_ylabel(yl)
            ax.legend(fontsize=8)
        a2.axhline(2.22, color="gray", linestyle="--")
        fig.tight_layout()
        OUT.mkdir(exist_ok=True)
        fig.savefig(OUT / "fleet_des.png", dpi=110)
        print(f"wrote {OUT / 'fleet_des.png'}")
    except ImportError:
        pass


if __name__ == "__main__":
    main()
