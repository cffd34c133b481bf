"""Where a tenant's late requests lost their time in a noisy-neighbour run over HTTP (`loadtests/flow_http.py --dump`).

    .venv/bin/python -m loadtests.flow_tail loadtests/out/flow.jsonl [--run "flow control"] [--tenant B] [--rows]

Each request that could meet the SLA (its TTFT alone on an idle rank holding what it had cached is within it) and
did not is split into the time flow control held it in the gateway (the `x-gateway-flow-wait-ms` header) and the
rest (the engine's queue and its own prefill, plus the gateway's and the network's own latency), and counted by the
routing branch it left on and by whether most of its lateness was the gateway's wait. With `--rows`, one line each.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

import orjson

from loadtests.report import table


def load(path: Path, run: str, tenant: str) -> list[dict[str, Any]]:
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return [r for r in rows if r["run"] == run and r["tenant"] == tenant]


def late(rows: list[dict[str, Any]], sla: float) -> list[dict[str, Any]]:
    return [r for r in rows if r["ok"] and r["idle_ttft"] <= sla and r["ttft"] is not None and r["ttft"] > sla]


def summary(rows: list[dict[str, Any]], sla: float) -> list[list[Any]]:
    lt = late(rows, sla)
    possible = [r for r in rows if not r["ok"] or r["idle_ttft"] <= sla]
    held = [r for r in lt if (r["wait"] or 0.0) > (r["ttft"] - r["idle_ttft"]) / 2]
    return [[len(rows), len(possible), len(lt), len(held), len(lt) - len(held),
             ", ".join(f"{k or '-'} {v}" for k, v in Counter(r["route"] for r in lt).most_common()),
             ", ".join(f"{k or '-'} {v}" for k, v in Counter(r["route"] for r in rows).most_common(6))]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dump", type=Path)
    p.add_argument("--run", default="flow control")
    p.add_argument("--tenant", default="B")
    p.add_argument("--sla", type=float, default=2.22)
    p.add_argument("--rows", action="store_true")
    a = p.parse_args()
    rows = load(a.dump, a.run, a.tenant)
    late_rows = late(rows, a.sla)
    print(f"{a.run}, tenant {a.tenant}: requests that could meet the {a.sla} s SLA and did not")
    print(table(["requests", "possible", "late", "mostly the gateway's wait", "mostly after dispatch",
                 "late, by branch", "all, by branch"], summary(rows, a.sla)))
    late_ids = {id(r) for r in late_rows}
    ratios = [(id(r) in late_ids, (r["ttft"] - (r["wait"] or 0)) / r["predicted"]) for r in rows
              if r["ok"] and r.get("predicted") and r["ttft"] is not None and r["idle_ttft"] <= a.sla]
    if ratios:  # how far the replica's TTFT was from what routing predicted for it (x-gateway-ttft-predicted-ms)
        for what, mine in (("late", True), ("on time", False)):
            xs = sorted(x for is_late, x in ratios if is_late is mine)
            if xs:
                print(f"after dispatch / predicted, {what} ({len(xs)}): median {xs[len(xs) // 2]:.2f}, "
                      f"p90 {xs[int(len(xs) * 0.9)]:.2f}")
    if a.rows:
        print(table(["at", "instance", "input", "cached", "idle TTFT", "TTFT", "flow wait", "after dispatch",
                     "predicted", "replica", "branch"],
                    [[f"{r['at']:.2f}", r["instance"], r["input"], r["cached"], f"{r['idle_ttft']:.2f}",
                      f"{r['ttft']:.2f}", f"{r['wait'] or 0:.2f}", f"{r['ttft'] - (r['wait'] or 0):.2f}",
                      "" if r.get("predicted") is None else f"{r['predicted']:.2f}",
                      r["replica"], r["route"]] for r in sorted(late_rows, key=lambda r: r["at"])]))


if __name__ == "__main__":
    main()
