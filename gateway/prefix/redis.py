"""Redis prefix index, shared by every gateway instance; falls back to an in-memory mirror when Redis is away.

Data model (prefix `gw:` by default):
- `gw:pfx:<hash>`: Redis hash, field replica -> expiry (ms since epoch); key TTL = the longest entry's.
- `gw:lru:<replica>`: sorted set of the replica's hashes by last touch, trimmed to the replica's capacity; trimming
  removes the replica from those `pfx` keys.
Lookup is one EVALSHA that walks the chain and returns each replica's longest leading run; a write is one EVALSHA,
and a request's writes (a dispatch's speculative entry, a first token's confirmation, corrections) are staged with
every other write made since the last exchange and go as one pipeline (`gateway/write_behind.py`).
A chain goes to Redis as one argument, its hashes in decimal joined by commas, and the scripts name the `pfx` keys
from it (as DROP_LUA always did): a 13k-token prompt is ~50 hashes, and as ~50 KEYS each call cost the client ~50
key strings, encodings and protocol chunks, three calls a request (docs/results/2026-11-28-request-cpu.md).

Redis unavailable: every write also goes to the local mirror, reads use the mirror while Redis is down (no
request fails because of Redis), and writes made meanwhile are replayed when it returns (bounded; every write is
idempotent). A single slow call (a timeout, a saturated pool) is answered from the mirror but does not put the
index into fallback: only an outage or calls failing for a second with no success do (`gateway/shared_redis.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from gateway.prefix.memory import MemoryPrefixIndex
from gateway.shared_redis import REDIS_ERRORS, RedisGuard
from gateway.write_behind import Flusher, exchange_bound

log = logging.getLogger("gateway.prefix")

# ARGV: now_ms, pfx prefix, the chain's hashes (decimal, comma-separated, leading chunk first)
MATCH_LUA = """
local now, pfx = tonumber(ARGV[1]), ARGV[2]
local best, order, alive = {}, {}, nil
local i = 0
for h in string.gmatch(ARGV[3], '[^,]+') do
  i = i + 1
  local flat = redis.call('HGETALL', pfx .. h)
  if #flat == 0 then break end
  local cur, any = {}, false
  for j = 1, #flat, 2 do
    local r = flat[j]
    if tonumber(flat[j + 1]) > now and (alive == nil or alive[r]) then
      cur[r] = true
      any = true
      if best[r] == nil then table.insert(order, r) end
      best[r] = i
    end
  end
  if not any then break end
  alive = cur
end
local out = {}
for _, r in ipairs(order) do
  table.insert(out, r)
  table.insert(out, best[r])
end
return out
"""

# KEYS[1] = lru key; ARGV: replica, expiry_ms, ttl_ms, now_ms, capacity, pfx prefix, the hashes (as MATCH_LUA's)
INSERT_LUA = """
local replica, expiry, ttl, now, cap = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local i = 0
for h in string.gmatch(ARGV[7], '[^,]+') do
  local key = ARGV[6] .. h
  redis.call('HSET', key, replica, expiry)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  -- deeper chunks count as slightly older, so trimming removes the leaves of a path first
  redis.call('ZADD', KEYS[1], now - i * 0.001, h)
  i = i + 1
end
local size = redis.call('ZCARD', KEYS[1])
if size > cap then
  local old = redis.call('ZPOPMIN', KEYS[1], size - cap)
  for j = 1, #old, 2 do redis.call('HDEL', ARGV[6] .. old[j], replica) end
end
redis.call('PEXPIRE', KEYS[1], ttl * 4)
return size
"""

# KEYS[1] = lru key; ARGV: replica, pfx prefix, the hashes (as MATCH_LUA's)
INVALIDATE_LUA = """
for h in string.gmatch(ARGV[3], '[^,]+') do
  redis.call('HDEL', ARGV[2] .. h, ARGV[1])
  redis.call('ZREM', KEYS[1], h)
end
return 1
"""

DROP_LUA = """
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
for _, h in ipairs(members) do redis.call('HDEL', ARGV[2] .. h, ARGV[1]) end
redis.call('DEL', KEYS[1])
return #members
"""


def chain_arg(hashes: Sequence[int]) -> str:
    """A chain as the scripts take it: one argument, the hashes in decimal (as the `pfx` keys end), comma-joined."""
    return ",".join(map(str, hashes))


class RedisPrefixIndex:
    def __init__(self, client: aioredis.Redis, *, prefix: str = "gw:", timeout: float = 0.1, retry_after: float = 1.0,
                 clock: Callable[[], float] = time.time, local: MemoryPrefixIndex | None = None,
                 on_rtt: Callable[[float], None] | None = None, guard: RedisGuard | None = None) -> None:
        self.r = client
        self.pfx = f"{prefix}pfx:"
        self.lru = f"{prefix}lru:"
        self.timeout = timeout
        self.retry_after = retry_after
        self.clock = clock
        self.local = local or MemoryPrefixIndex(clock=clock)
        self.on_rtt = on_rtt
        self._capacity: dict[str, int] = {}
        self.guard = guard or RedisGuard("prefix index", retry_after=retry_after)
        self._resync_lock = asyncio.Lock()
        self._pending: deque[tuple[str, str, list[int], float]] = deque(maxlen=10_000)  # writes made while Redis was away
        self._staged: list[tuple[str, str, list[int], float]] = []  # writes no one waits for, sent together
        self._writes = Flusher(self._send, "prefix-index-writes")
        self._scripts = {
            "match": client.register_script(MATCH_LUA),
            "insert": client.register_script(INSERT_LUA),
            "invalidate": client.register_script(INVALIDATE_LUA),
            "drop": client.register_script(DROP_LUA),
        }

    @property
    def available(self) -> bool:
        return self.guard.available

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        start = time.perf_counter()
        async with asyncio.timeout(self.timeout):
            out = await self._scripts[name](keys=keys, args=args)
        if self.on_rtt:
            self.on_rtt(time.perf_counter() - start)
        self.guard.succeeded()
        return out

    async def _resync(self) -> None:
        """Replay writes made while Redis was away (oldest first); one coroutine at a time, the others go on."""
        if self._resync_lock.locked():
            return
        async with self._resync_lock:
            while self._pending:
                op = self._pending[0]
                await self._write(*op, replaying=True)
                if self._pending and self._pending[0] is op:
                    self._pending.popleft()

    # -- PrefixIndex -----------------------------------------------------------------------------------------
    async def match(self, hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        if not hashes:
            return {}
        if not self.available:
            self.guard.fallback("away")
            return self.local.match_sync(hashes, replicas)
        start = time.monotonic()
        try:
            if self._pending:
                await self._resync()
            flat = await self._call("match", [], [int(self.clock() * 1000), self.pfx, chain_arg(hashes)])
        except REDIS_ERRORS as e:
            self.guard.fallback(self.guard.failed(e, start))
            return self.local.match_sync(hashes, replicas)
        allowed = set(replicas)
        out = {}
        for i in range(0, len(flat), 2):
            name = flat[i].decode() if isinstance(flat[i], bytes) else flat[i]
            if name in allowed:
                out[name] = int(flat[i + 1])
        return out

    async def insert(self, replica: str, hashes: Sequence[int], ttl: float) -> None:
        self.local.insert_sync(replica, hashes, ttl)
        if hashes:
            await self._write("insert", replica, list(hashes), ttl)

    async def invalidate(self, replica: str, hashes: Sequence[int]) -> None:
        self.local.invalidate_sync(replica, hashes)
        if hashes:
            await self._write("invalidate", replica, list(hashes), 0.0)

    def insert_soon(self, replica: str, hashes: Sequence[int], ttl: float) -> None:
        self.local.insert_sync(replica, hashes, ttl)
        if hashes:
            self._stage("insert", replica, list(hashes), ttl)

    def invalidate_soon(self, replica: str, hashes: Sequence[int]) -> None:
        self.local.invalidate_sync(replica, hashes)
        if hashes:
            self._stage("invalidate", replica, list(hashes), 0.0)

    async def settle(self) -> None:
        await self._writes.settle()

    async def drop_replica(self, replica: str) -> None:
        self.local.drop_replica_sync(replica)
        await self._write("drop", replica, [], 0.0)

    def _stage(self, op: str, replica: str, hashes: list[int], ttl: float) -> None:
        if not self.available:
            self._pending.append((op, replica, hashes, ttl))
            return
        self._staged.append((op, replica, hashes, ttl))
        self._writes.kick()

    def _script_args(self, op: str, replica: str, hashes: list[int], ttl: float) -> tuple[str, list[str], list[Any]]:
        lru = f"{self.lru}{replica}"
        if op == "insert":
            now_ms = int(self.clock() * 1000)
            ttl_ms = int(ttl * 1000)
            cap = self._capacity.get(replica, self.local.default_capacity)
            return op, [lru], [replica, now_ms + ttl_ms, ttl_ms, now_ms, cap, self.pfx, chain_arg(hashes)]
        if op == "invalidate":
            return op, [lru], [replica, self.pfx, chain_arg(hashes)]
        return op, [lru], [replica, self.pfx]

    async def _send(self) -> None:
        """The writes staged since the last exchange, as one pipeline of the same scripts, in the order made. A
        script the server lost (a restart, SCRIPT FLUSH) is sent again on its own, which loads it; an outage queues
        the batch for replay, as a failed write always was."""
        batch, self._staged = self._staged, []
        if not batch:
            return
        start = time.monotonic()
        try:
            async with asyncio.timeout(exchange_bound(self.timeout, len(batch))):
                pipe = self.r.pipeline(transaction=False)
                for op in batch:
                    name, keys, args = self._script_args(*op)
                    pipe.evalsha(self._scripts[name].sha, len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
            if self.on_rtt:
                self.on_rtt(time.monotonic() - start)
            self.guard.succeeded()
        except REDIS_ERRORS as e:
            self.guard.failed(e, start)
            self._pending.extend(batch)
            return
        for op, res in zip(batch, results):
            if isinstance(res, NoScriptError):
                await self._write(*op)
            elif isinstance(res, Exception):
                log.warning("prefix index write failed: %s", res)

    async def _write(self, op: str, replica: str, hashes: list[int], ttl: float, replaying: bool = False) -> None:
        if not self.available and not replaying:
            self._pending.append((op, replica, hashes, ttl))
            return
        start = time.monotonic()
        try:
            await self._call(*self._script_args(op, replica, hashes, ttl))
        except REDIS_ERRORS as e:
            self.guard.failed(e, start)
            if not replaying:
                self._pending.append((op, replica, hashes, ttl))
            else:
                raise

    def set_capacity(self, replica: str, chunks: int) -> None:
        self._capacity[replica] = max(1, chunks)
        self.local.set_capacity(replica, chunks)

    async def size(self) -> int:
        """Entries in the shared index (the admin's figure): a SCAN of the `lru` keys, each page's sizes in one
        pipeline, every round trip bounded by `timeout`; this instance's own count when Redis does not answer."""
        if self.available:
            start = time.monotonic()
            try:
                total, cursor = 0, None
                while cursor != 0:
                    async with asyncio.timeout(self.timeout):
                        cursor, keys = await self.r.scan(cursor or 0, match=f"{self.lru}*", count=500)
                    if keys:
                        async with asyncio.timeout(self.timeout):
                            pipe = self.r.pipeline(transaction=False)
                            for key in keys:
                                pipe.zcard(key)
                            total += sum(await pipe.execute())
                self.guard.succeeded()
                return total
            except REDIS_ERRORS as e:
                self.guard.failed(e, start)
        return self.local.size_sync()
