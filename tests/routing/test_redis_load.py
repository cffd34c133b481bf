"""The shared load in Redis: what one instance adds, another reads, whichever of the tracker's writes made it."""

import asyncio
import time

import redis.asyncio as aioredis

from gateway.routing.load import RedisLoadTracker


def test_each_write_reaches_the_other_instance(redis_server):
    async def go():
        prefix = f"ld{time.monotonic_ns()}:"
        c1, c2 = aioredis.from_url(redis_server.url), aioredis.from_url(redis_server.url)
        a = RedisLoadTracker(c1, prefix=prefix, snapshot_ttl=0.0)
        b = RedisLoadTracker(c2, prefix=prefix, snapshot_ttl=0.0)
        await c1.zadd(f"{prefix}gateways", {a.id: time.time()})  # a's heartbeat, without its loop
        await a.add("r1", 1000, 2)  # prefill and requests: both fields
        view = (await b.snapshot(["r1"]))["r1"]
        assert (view.queued_prefill_tokens, view.inflight) == (1000, 2)
        await a.prefill_done("r1", 400)  # prefill only
        view = (await b.snapshot(["r1"]))["r1"]
        assert (view.queued_prefill_tokens, view.inflight) == (600, 2)
        await a.finish("r1", 1)  # requests only
        view = (await b.snapshot(["r1"]))["r1"]
        assert (view.queued_prefill_tokens, view.inflight) == (600, 1)
        assert await c2.hgetall(f"{prefix}load:r1") == {f"{a.id}:p".encode(): b"600", f"{a.id}:n".encode(): b"1"}
        await c1.aclose()
        await c2.aclose()

    asyncio.run(go())
