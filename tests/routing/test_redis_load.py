"""The shared load in Redis: what one instance applies, another reads, however its writes were batched."""

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
        a.apply("r1", 1000, 2)  # prefill and requests: both fields
        await a.settle()
        view = (await b.snapshot(["r1"]))["r1"]
        assert (view.queued_prefill_tokens, view.inflight) == (1000, 2)
        a.apply("r1", -400, 0)  # prefill only
        await a.settle()
        view = (await b.snapshot(["r1"]))["r1"]
        assert (view.queued_prefill_tokens, view.inflight) == (600, 2)
        a.apply("r1", 0, -1)  # requests only
        await a.settle()
        view = (await b.snapshot(["r1"]))["r1"]
        assert (view.queued_prefill_tokens, view.inflight) == (600, 1)
        assert await c2.hgetall(f"{prefix}load:r1") == {f"{a.id}:p".encode(): b"600", f"{a.id}:n".encode(): b"1"}
        await c1.aclose()
        await c2.aclose()

    asyncio.run(go())


def test_deltas_go_together_and_this_instance_sees_them_at_once(redis_server):
    """Deltas applied in one turn of the loop are one exchange; a delta that cancels out sends nothing; this
    instance's snapshot shows a delta before Redis has it, and still after a snapshot taken meanwhile."""
    async def go():
        prefix = f"lw{time.monotonic_ns()}:"
        c1, c2 = aioredis.from_url(redis_server.url), aioredis.from_url(redis_server.url)
        a = RedisLoadTracker(c1, prefix=prefix, snapshot_ttl=0.0)
        b = RedisLoadTracker(c2, prefix=prefix, snapshot_ttl=0.0)
        await c1.zadd(f"{prefix}gateways", {a.id: time.time()})
        for name in ("r1", "r2", "r3"):
            a.apply(name, 500, 1)
        a.apply("r3", -500, -1)  # dispatched and finished before the exchange: nothing to send for r3
        view = await a.snapshot(["r1", "r2", "r3"])  # a fresh snapshot, Redis not yet written: on top of it
        assert (view["r1"].queued_prefill_tokens, view["r1"].inflight) == (500, 1)
        assert (view["r3"].queued_prefill_tokens, view["r3"].inflight) == (0, 0)
        await a.settle()
        view = await b.snapshot(["r1", "r2", "r3"])
        assert [(v.queued_prefill_tokens, v.inflight) for v in view.values()] == [(500, 1), (500, 1), (0, 0)]
        assert not await c2.exists(f"{prefix}load:r3")
        await c1.aclose()
        await c2.aclose()

    asyncio.run(go())
