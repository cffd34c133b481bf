"""Redis memory per million prefix-index entries (and per replica-chain), measured on a private redis-server with the
gateway's own RedisPrefixIndex: Wafer-shaped chains (20k-token prompts = 78 chunks of 256 tokens, the first 47 shared
by a session group) written for a fleet of replicas until the index holds --entries (chunk hash, replica) pairs.

    .venv/bin/python -m loadtests.redis_memory --entries 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time

import redis.asyncio as aioredis
from tqdm import tqdm

from gateway.prefix.redis import RedisPrefixIndex
from loadtests.procs import Proc
from loadtests.report import save_json, table


async def fill(url: str, entries: int, replicas: int, seed: int, progress: bool = True) -> dict[str, float]:
    r = aioredis.from_url(url)
    idx = RedisPrefixIndex(r, prefix="mem:", timeout=5.0)
    for i in range(replicas):
        idx.set_capacity(f"r{i}@0", 10_000_000)  # measure storage, not trimming
    base = await r.info("memory")
    rng = random.Random(seed)
    # stepped every 64 chains, not per timed insert (the monitor thread off)
    tqdm.monitor_interval = 0
    bar = tqdm(total=entries, unit="entry", unit_scale=True, file=sys.stderr, leave=False, disable=not progress)
    written, chains, t0 = 0, 0, time.perf_counter()
    while written < entries:
        group = rng.getrandbits(62)
        shared = [hash((group, k)) for k in range(47)]
        tail = [rng.getrandbits(62) for _ in range(31)]
        await idx.insert(f"r{chains % replicas}@0", shared + tail, ttl=900)
        chains += 1
        written += 78  # a fresh group per chain: every (chunk, replica) pair is new; the exact count is read below
        if chains % 64 == 0:
            bar.update(min(written, entries) - bar.n)
    bar.close()
    written = sum([await r.zcard(f"mem:lru:r{i}@0") for i in range(replicas)])
    keys = await r.dbsize()
    used = (await r.info("memory"))["used_memory"] - base["used_memory"]
    await r.aclose()
    return {"entries": written, "chains": chains, "keys": keys, "bytes": used, "seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1_000_000)
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--port", type=int, default=19490)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="gw-redis-mem-")
    redis = Proc("redis", ["redis-server", "--port", str(a.port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                           "no", "--dir", work], "http://127.0.0.1:1/")
    try:
        time.sleep(0.5)
        res = asyncio.run(fill(f"redis://127.0.0.1:{a.port}/0", a.entries, a.replicas, a.seed,
                              progress=not a.no_progress))
    finally:
        redis.stop()
    per_m = res["bytes"] / res["entries"] * 1e6
    print(f"Prefix index in Redis: {a.replicas} replicas, Wafer-shaped chains (78 chunks, 47 shared per group)")
    print(table(["entries", "chains", "keys", "used_memory MiB", "MiB per 1M entries", "bytes/entry", "write s"],
                [[res["entries"], res["chains"], res["keys"], f"{res['bytes'] / 2**20:.1f}", f"{per_m / 2**20:.1f}",
                  f"{res['bytes'] / res['entries']:.0f}", f"{res['seconds']:.1f}"]]))
    save_json("redis_memory", {"args": vars(a), **res, "mib_per_million": per_m / 2**20})


if __name__ == "__main__":
    main()
