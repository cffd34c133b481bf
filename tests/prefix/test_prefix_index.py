"""Both prefix index implementations against the same contract; the Redis one against a real Redis."""

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.prefix.memory import MemoryPrefixIndex
from gateway.prefix.redis import RedisPrefixIndex
from tests.support import RedisServer, wait_until


class FakeClock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.fixture(params=["memory", "redis"])
def index(request, redis_server):
    clock = FakeClock()
    if request.param == "memory":
        yield MemoryPrefixIndex(clock=clock), clock
        return
    client = aioredis.from_url(redis_server.url)
    prefix = f"t{time.monotonic_ns()}:"  # a private namespace per test in our own redis-server
    yield RedisPrefixIndex(client, prefix=prefix, clock=clock, timeout=1.0), clock


async def _contract(idx, clock):
    H = list(range(101, 111))
    await idx.insert("a@1", H[:6], ttl=60)
    await idx.insert("b@1", H[:3] + [999], ttl=60)
    assert await idx.match(H, ["a@1", "b@1"]) == {"a@1": 6, "b@1": 3}
    assert await idx.match(H, ["b@1"]) == {"b@1": 3}
    assert await idx.match([5, 6], ["a@1"]) == {}
    # the tail beyond the engine's real hit is invalidated
    await idx.invalidate("a@1", H[4:6])
    assert (await idx.match(H, ["a@1"]))["a@1"] == 4
    # entries expire
    await idx.insert("c@1", H[:2], ttl=5)
    clock.t += 6
    assert "c@1" not in await idx.match(H, ["c@1", "a@1"])
    # a restarted replica is another key and inherits nothing; dropping removes everything
    assert await idx.match(H, ["a@2"]) == {}
    await idx.drop_replica("a@1")
    assert await idx.match(H, ["a@1"]) == {}


def test_contract(index):
    idx, clock = index
    asyncio.run(_contract(idx, clock))


async def _capacity(idx):
    idx.set_capacity("a@1", 3)
    await idx.insert("a@1", [1, 2, 3, 4, 5], ttl=60)
    assert (await idx.match([1, 2, 3, 4, 5], ["a@1"]))["a@1"] == 3  # trimmed to capacity, deepest chunks first
    await idx.insert("a@1", [7, 8], ttl=60)
    assert await idx.match([7, 8], ["a@1"]) == {"a@1": 2}
    assert (await idx.match([1, 2, 3], ["a@1"])).get("a@1", 0) == 1


def test_capacity_trimming(index):
    idx, _ = index
    asyncio.run(_capacity(idx))


def test_two_instances_share_one_redis(redis_server):
    async def go():
        c1, c2 = aioredis.from_url(redis_server.url), aioredis.from_url(redis_server.url)
        a = RedisPrefixIndex(c1, prefix="shared:")
        b = RedisPrefixIndex(c2, prefix="shared:")
        await a.insert("r@1", [11, 12, 13], ttl=60)
        assert await b.match([11, 12, 13, 14], ["r@1"]) == {"r@1": 3}
        assert await b.size() >= 3
        await c1.aclose()
        await c2.aclose()

    asyncio.run(go())


def test_redis_outage_falls_back_then_resyncs():
    """Killed Redis: lookups answer from the local mirror at once; writes made meanwhile reach Redis after it
    returns (it restarts empty, like a Redis without persistence)."""
    srv = RedisServer()
    try:
        async def go():
            client = aioredis.from_url(srv.url, socket_connect_timeout=0.2)
            idx = RedisPrefixIndex(client, prefix="o:", timeout=0.3, retry_after=0.2)
            await idx.insert("r@1", [1, 2, 3], ttl=60)
            srv.kill()
            assert await idx.match([1, 2, 3], ["r@1"]) == {"r@1": 3}  # from the mirror
            assert not idx.available
            await idx.insert("r@1", [7, 8], ttl=60)  # queued for replay
            srv.start()
            # the guard retries Redis once its retry_after window has passed; the next lookup then replays the
            # queued writes before answering (a clock check, so polling it from the loop's thread is fine)
            wait_until(lambda: idx.available, timeout=5, what="the index to retry Redis")
            assert await idx.match([7, 8], ["r@1"]) == {"r@1": 2}  # resync happened before this lookup
            other = RedisPrefixIndex(aioredis.from_url(srv.url), prefix="o:")
            assert await other.match([7, 8], ["r@1"]) == {"r@1": 2}
            await client.aclose()

        asyncio.run(go())
    finally:
        srv.stop()


def test_redis_layout_is_the_shared_one(redis_server):
    """What an insert leaves in Redis is what every instance reads, whatever version wrote it: `pfx:<hash>` hashes
    of replica -> expiry ms (signed decimal hashes, as the chunk hashes are), the replica's `lru` set of the same
    decimal members, deeper chunks scored older; an invalidate removes both."""
    async def go():
        client = aioredis.from_url(redis_server.url)
        clock = FakeClock()
        idx = RedisPrefixIndex(client, prefix="lay:", clock=clock)
        chain = [-9_000_000_000_000_000_001, 42, -7]
        await idx.insert("r@1", chain, ttl=60)
        for h in chain:
            assert await client.hget(f"lay:pfx:{h}", "r@1") == str(int(clock.t * 1000) + 60_000).encode()
            assert 0 < await client.pttl(f"lay:pfx:{h}") <= 60_000
        members = await client.zrange("lay:lru:r@1", 0, -1, withscores=True)
        assert [m for m, _ in members] == [str(h).encode() for h in reversed(chain)]  # deepest is oldest
        assert members[-1][1] == int(clock.t * 1000)
        await idx.invalidate("r@1", chain[1:])
        assert await client.hget("lay:pfx:42", "r@1") is None
        assert await client.zrange("lay:lru:r@1", 0, -1) == [str(chain[0]).encode()]
        # a chain written as another instance would, read by this one
        await client.hset("lay:pfx:5", "r@2", int(clock.t * 1000) + 1000)
        await client.hset("lay:pfx:6", "r@2", int(clock.t * 1000) + 1000)
        assert await idx.match([5, 6, 7], ["r@2"]) == {"r@2": 2}
        await client.aclose()

    asyncio.run(go())


def test_writes_no_one_waits_for_go_together_in_order(redis_server):
    """`insert_soon`/`invalidate_soon`: in this instance's mirror at once; in Redis, in the order made, as one
    pipeline per exchange (a first token's confirmation and a usage correction of many requests); a script the
    server lost is loaded again and the write not lost."""
    async def go():
        c1, c2 = aioredis.from_url(redis_server.url), aioredis.from_url(redis_server.url)
        prefix = f"wb{time.monotonic_ns()}:"
        a, b = RedisPrefixIndex(c1, prefix=prefix), RedisPrefixIndex(c2, prefix=prefix)
        await a.insert("r9@1", [999], ttl=60)  # the scripts loaded, as after a gateway's first requests
        await a.invalidate("r9@1", [999])
        exchanges: list[float] = []
        a.on_rtt = exchanges.append
        for i in range(20):
            a.insert_soon(f"r{i % 2}@1", [i, i + 100], ttl=60)
        a.invalidate_soon("r0@1", [100])  # after the insert of [0, 100] on r0: the order holds
        assert a.local.match_sync([0, 100], ["r0@1"]) == {"r0@1": 1}  # the mirror at once
        await a.settle()
        assert len(exchanges) == 1  # 21 writes, one exchange
        assert await b.match([0, 100], ["r0@1"]) == {"r0@1": 1}
        assert await b.match([19, 119], ["r1@1", "r0@1"]) == {"r1@1": 2}
        await c1.script_flush()  # the server forgets the scripts (a restart): the writes reload them
        a.insert_soon("r5@1", [7, 8, 9], ttl=60)
        await a.settle()
        assert await b.match([7, 8, 9], ["r5@1"]) == {"r5@1": 3}
        await c1.aclose()
        await c2.aclose()

    asyncio.run(go())


def test_writes_no_one_waits_for_survive_an_outage():
    srv = RedisServer()
    try:
        async def go():
            client = aioredis.from_url(srv.url, socket_connect_timeout=0.2)
            idx = RedisPrefixIndex(client, prefix="wo:", timeout=0.3, retry_after=0.2)
            idx.insert_soon("r@1", [1, 2], ttl=60)
            await idx.settle()
            srv.kill()
            idx.insert_soon("r@1", [3, 4], ttl=60)  # the exchange fails: queued for replay
            await idx.settle()
            assert await idx.match([3, 4], ["r@1"]) == {"r@1": 2}  # from the mirror meanwhile
            srv.start()
            wait_until(lambda: idx.available, timeout=5, what="the index to retry Redis")
            assert await idx.match([3, 4], ["r@1"]) == {"r@1": 2}  # replayed before this lookup
            other = RedisPrefixIndex(aioredis.from_url(srv.url), prefix="wo:")
            assert await other.match([3, 4], ["r@1"]) == {"r@1": 2}
            await client.aclose()

        asyncio.run(go())
    finally:
        srv.stop()
