"""Prefix hits with data-parallel SGLang servers (issue #11): one server with `--dp-size 2` behind the gateway,
configured with nothing but its URL, against two single-rank servers on the same workload; and the same DP server
with rank pinning switched off (`dp_pinning: off`, the gateway's behaviour before it knew about ranks).

Workload: Wafer-like (many groups, each a long shared system prefix + a fresh user turn), sent one request at a
time in a seeded random group order, so the figure measures placement, not load. Hit rate = cached / prompt
tokens summed over every rank of every simulator (`/_sim/state` counters: what the engines really reused).

    .venv/bin/python -m loadtests.dp_ranks                       # 8 groups x 10 requests per setup, ~1-2 min
    .venv/bin/python -m loadtests.dp_ranks --groups 4 --per-group 6
    .venv/bin/python -m loadtests.dp_ranks --kv-capacity 16384   # each rank holds about half the groups' prefixes

Runs everything in-process on loopback (simulators at a high time scale, the gateway with in-memory state).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until


@dataclass
class Setup:
    name: str
    servers: int
    sim: dict[str, Any]
    pool: dict[str, Any]


SETUPS = [
    Setup("2 servers x 1 rank", 2, {}, {}),
    Setup("1 server x dp 2, pinned", 1, {"dp_size": 2}, {}),
    Setup("1 server x dp 2 + DP attention, pinned", 1, {"dp_size": 2, "enable_dp_attention": True}, {}),
    Setup("1 server x dp 2, no pinning", 1, {"dp_size": 2}, {"dp_pinning": "off"}),
]


def prompt(group: int, i: int, prefix_words: int) -> list[dict[str, str]]:
    rng = random.Random(f"g{group}")
    shared = " ".join(f"w{rng.randrange(10**6)}" for _ in range(prefix_words))
    return [{"role": "system", "content": f"[group {group}] {shared}"}, {"role": "user", "content": f"turn {i} of group {group}"}]


def hit_rate(urls: list[str]) -> tuple[int, int]:
    cached = prompt_tokens = 0
    for u in urls:
        for r in httpx.get(f"{u}/_sim/state", timeout=10).json()["ranks"]:
            cached += r["counters"]["cached_tokens"]
            prompt_tokens += r["counters"]["prompt_tokens"]
    return cached, prompt_tokens


def run_setup(s: Setup, groups: int, per_group: int, prefix_words: int, seed: int = 0,
              kv_capacity: int | None = None, progress: Callable[[], None] | None = None) -> dict[str, Any]:
    """`progress`: called as each request is answered (a progress bar's update)."""
    kv = {"max_total_num_tokens": kv_capacity} if kv_capacity else {}
    sims, _ = start_sims(s.servers, time_scale=50.0, **kv, **s.sim)
    pool = {**sglang_pool("p", sims.urls), **s.pool}
    gw = start_gateway(config([pool], health={"interval_s": 0.5}, routing={"load_poll_s": 0.2},
                              observability={"log_requests": False}))
    try:
        want = 2 if s.servers == 2 or s.pool.get("dp_pinning") != "off" else 1
        wait_until(lambda: gw.call(lambda: len(gw.app.state.gateway.registry.by_pool["p"])) == want, timeout=20,
                   what="the DP ranks discovered")
        targets = gw.call(lambda: [t.name for t in gw.app.state.gateway.registry.by_pool["p"]])
        order = [g for g in range(groups) for _ in range(per_group)]
        random.Random(seed).shuffle(order)
        seen: dict[int, int] = {}
        with httpx.Client(timeout=60) as c:
            for g in order:
                seen[g] = seen.get(g, 0) + 1
                r = c.post(f"{gw.urls[0]}/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                           json={"model": "glm-5.2", "messages": prompt(g, seen[g], prefix_words), "max_tokens": 2})
                r.raise_for_status()
                if progress:
                    progress()
        cached, total = hit_rate(sims.urls)
        return {"setup": s.name, "targets": targets, "cached": cached, "prompt": total,
                "hit_rate": cached / total if total else 0.0}
    finally:
        gw.stop()
        sims.stop()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=10)
    p.add_argument("--prefix-words", type=int, default=1500, help="shared system prefix per group (~2 tokens a word)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-capacity", type=int, default=None, help="KV tokens per rank (default the profile's 2.4M); "
                   "below the groups' total prefixes, duplicated prefixes evict each other")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    a = p.parse_args(argv)
    # per answered request over every setup (hit rates are measured, not time)
    bar = tqdm(total=len(SETUPS) * a.groups * a.per_group, unit="req", file=sys.stderr, leave=False,
               disable=a.no_progress)
    rows = []
    for s in SETUPS:
        bar.set_description(s.name)
        rows.append(run_setup(s, a.groups, a.per_group, a.prefix_words, a.seed, a.kv_capacity,
                              progress=None if a.no_progress else bar.update))
    bar.close()
    print(f"{'setup':42} {'targets':34} {'hit rate':>8}")
    for r in rows:
        print(f"{r['setup']:42} {','.join(r['targets']):34} {100 * r['hit_rate']:7.1f}%")
    base = rows[0]["hit_rate"]
    for r in rows[1:]:
        print(f"{r['setup']}: {100 * (r['hit_rate'] - base):+.1f} points vs two single-rank servers")
    return rows


if __name__ == "__main__":
    main()
