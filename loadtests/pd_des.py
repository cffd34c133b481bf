"""Prefill/decode disaggregation on the Wafer workload, on the virtual clock (no HTTP): unified vs PD with a fixed
split vs PD with the per-request decision, on equal GPU counts (gateway_lab/replay/pd.py; the trace version is
`gateway replay TRACE --pd P:D`).

    .venv/bin/python -m loadtests.pd_des --pd 2:2 --rps 2.0,3.5 [--duration 300] [--seed 0]

20k-token prompts (a group's 12k shared prefix + 8k new, 8 groups per rank, cold at the start), 1k output tokens,
Poisson arrivals at `rps` requests per second over the whole fleet. Prints one table per rate.
"""

from __future__ import annotations

import argparse
import time

from gateway.config import Routing
from gateway_lab.replay.pd import compare, markdown, wafer_arrivals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pd", default="2:2", metavar="P:D")
    p.add_argument("--rps", default="2.0,3.5", help="request rates over the whole fleet, comma-separated")
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--itl-sla-ms", type=float, default=30.0)
    a = p.parse_args()
    pre, dec = (int(x) for x in a.pd.split(":"))
    routing = Routing()
    for rps in (float(x) for x in a.rps.split(",")):
        t0 = time.perf_counter()
        rows = compare(wafer_arrivals(pre + dec, rps, a.duration, routing, a.seed), a.duration, pre, dec, routing,
                       a.itl_sla_ms / 1000)
        print(f"\nWafer workload, {rps:g} req/s for {a.duration:g} s on {pre + dec} MI355X TP4 ranks (seed {a.seed}); "
              f"TTFT SLA {routing.ttft_sla_ms / 1000:.2f} s, ITL target {a.itl_sla_ms:g} ms; "
              f"{time.perf_counter() - t0:.0f} s wall")
        print(markdown(rows))


if __name__ == "__main__":
    main()
