"""routing.mode approximate vs precise vs hybrid on the virtual clock, at a chosen KV size per rank (which
`gateway replay --nodes` does not expose): the Mooncake conversation trace through the shipped routing engine, with
one (or a Redis-shared) index and with instances that each keep their own.

    .venv/bin/python -m loadtests.kv_events_replay --kv-per-rank 1200000          # ~90 s

Precise and hybrid read the simulated engines' caches as lag-free events (gateway/kvevents/fleet.py).
"""

from __future__ import annotations

import argparse
import time

from gateway.config import Routing
from gateway.kvevents.fleet import install
from gateway.replay.bounds import ideal_hit_rate, lru_hit_rate
from gateway.replay.run import HEADERS, nodes_targets, replay
from gateway.replay.trace import read_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="/work/shared/traces/conversation_trace.jsonl")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--kv-per-rank", type=int, default=1_200_000, help="max_total_num_tokens of each TP4 rank")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--speculative-s", type=float, default=2.0, help="routing.kv_events.speculative_s (simulated s)")
    p.add_argument("--instances", default="1,2", help="gateway instances per run; above 1 each keeps its own index")
    a = p.parse_args()
    trace = read_trace(a.trace, a.limit)
    targets = [(info, cfg.with_overrides(max_total_num_tokens=a.kv_per_rank)) for info, cfg in nodes_targets(a.nodes)]
    kv = sum(cfg.max_total_num_tokens for _, cfg in targets)
    bounds = ideal_hit_rate(trace), lru_hit_rate(trace, kv)
    rows = []
    for n in (int(x) for x in a.instances.split(",")):
        for mode in ("approximate", "precise", "hybrid"):
            routing = Routing(mode=mode, kv_events={"speculative_s": a.speculative_s})
            page = targets[0][1].page_size
            t0 = time.perf_counter()
            r = replay(trace, targets, routing, instances=n, shared=n == 1, bounds=bounds,
                       label=f"x{n} {'shared' if n == 1 else 'unshared'} [{mode}]",
                       fleet_hook=lambda fleet, routing=routing, page=page: install(fleet, routing, page))
            print(f"  {r.label}: {time.perf_counter() - t0:.1f} s wall", flush=True)
            rows.append(r.row())
    print(f"\n{a.trace}: {len(trace)} requests on {a.nodes} nodes ({2 * a.nodes} ranks x {a.kv_per_rank / 1e6:.1f}M KV "
          f"tokens; speculative_s {a.speculative_s:g}); ideal hit {bounds[0] * 100:.1f}%, LRU bound {bounds[1] * 100:.1f}%")
    widths = [max(len(str(x)) for x in col) for col in zip(HEADERS, *rows, strict=False)]
    for i, line in enumerate([HEADERS, *rows]):
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


if __name__ == "__main__":
    main()
