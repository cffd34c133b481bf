"""Per-tenant rate limits (requests/min, tokens/min) as token buckets, enforced across every gateway instance.

A bucket holds up to one minute's allowance and refills continuously, so a tenant gets `limit` per minute on
average with bursts up to `limit`. Both buckets of a request are checked and taken in one atomic step (all or
nothing). Tokens are taken at admission from an estimate (prompt + max output), then settled with the real usage.

Redis: one EVAL per admission on Redis's own clock (instances' clocks never matter); retried admissions are
idempotent (an attempt marker kept a minute). Memory: the same arithmetic in
process (the embedded default, and the fallback while Redis is away: limits then hold per instance).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from gateway.policy_schema import Tenant


@dataclass(frozen=True)
class Bucket:
    key: str  # "<tenant>:req" | "<tenant>:tok"
    limit: int  # per minute
    cost: float

    @property
    def per_ms(self) -> float:
        return self.limit / 60_000.0


@dataclass(frozen=True)
class Admission:
    allowed: bool
    remaining: tuple[float, ...]  # per bucket, after this request
    retry_after_s: float  # when refused: until every bucket could pay


class RateLimiter(Protocol):
    async def take(self, buckets: list[Bucket]) -> Admission: ...
    async def adjust(self, bucket: Bucket, delta: float) -> None:
        """Give back (delta > 0) or take more (delta < 0) once the real usage is known; may go below zero."""


def buckets_for(tenant: Tenant, est_tokens: int) -> list[Bucket]:
    rl = tenant.rate_limits
    out = []
    if rl.requests_per_minute:
        out.append(Bucket(f"{tenant.name}:req", rl.requests_per_minute, 1.0))
    if rl.tokens_per_minute:
        # a request larger than the whole allowance would wait forever: it may pass on a full bucket
        out.append(Bucket(f"{tenant.name}:tok", rl.tokens_per_minute, float(min(est_tokens, rl.tokens_per_minute))))
    return out


def _decide(levels: list[float], buckets: list[Bucket]) -> tuple[bool, float]:
    wait_ms = max((b.cost - lv) / b.per_ms for lv, b in zip(levels, buckets))
    return wait_ms <= 0, max(0.0, wait_ms) / 1000.0


class MemoryRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._state: dict[str, tuple[float, float]] = {}  # key -> (level, at_ms)

    def _level(self, b: Bucket, now_ms: float) -> float:
        level, at = self._state.get(b.key, (float(b.limit), now_ms))
        return min(float(b.limit), level + max(0.0, now_ms - at) * b.per_ms)

    async def take(self, buckets: list[Bucket]) -> Admission:
        now = self.clock() * 1000.0
        levels = [self._level(b, now) for b in buckets]
        ok, wait = _decide(levels, buckets)
        if ok:
            levels = [lv - b.cost for lv, b in zip(levels, buckets)]
        for lv, b in zip(levels, buckets):
            self._state[b.key] = (lv, now)
        return Admission(ok, tuple(levels), wait)

    async def adjust(self, bucket: Bucket, delta: float) -> None:
        now = self.clock() * 1000.0
        self._state[bucket.key] = (min(float(bucket.limit), self._level(bucket, now) + delta), now)


# KEYS: bucket keys, then the attempt's marker. ARGV: n, then per bucket: limit, per_ms, cost. Returns {ok, wait_ms,
# level1, level2, ...}; a retry of an attempt that already ran (its reply lost) gets the first answer, taking nothing.
TAKE_LUA = """
local done = redis.call('GET', KEYS[#KEYS])
if done then return cjson.decode(done) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = tonumber(ARGV[1])
local levels, ok, wait = {}, 1, 0
for i = 1, n do
  local limit, per_ms, cost = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  local v = redis.call('HMGET', KEYS[i], 'l', 'at')
  local level = tonumber(v[1]) or limit
  local at = tonumber(v[2]) or now
  level = math.min(limit, level + math.max(0, now - at) * per_ms)
  levels[i] = level
  if level < cost then
    ok = 0
    wait = math.max(wait, (cost - level) / per_ms)
  end
end
local out = {ok, tostring(wait)}
for i = 1, n do
  local limit, per_ms, cost = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  if ok == 1 then levels[i] = levels[i] - cost end
  redis.call('HSET', KEYS[i], 'l', tostring(levels[i]), 'at', now)
  redis.call('PEXPIRE', KEYS[i], 120000)
  table.insert(out, tostring(levels[i]))
end
redis.call('SET', KEYS[#KEYS], cjson.encode(out), 'PX', 60000)
return out
"""

# KEYS[1]: bucket. ARGV: limit, per_ms, delta.
ADJUST_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit, per_ms, delta = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local v = redis.call('HMGET', KEYS[1], 'l', 'at')
local level = tonumber(v[1]) or limit
local at = tonumber(v[2]) or now
level = math.min(limit, math.min(limit, level + math.max(0, now - at) * per_ms) + delta)
redis.call('HSET', KEYS[1], 'l', tostring(level), 'at', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return tostring(level)
"""


class RedisRateLimiter:
    def __init__(self, client: aioredis.Redis, prefix: str = "gw:") -> None:
        self.p = f"{prefix}rl:"
        self._take = client.register_script(TAKE_LUA)
        self._adjust = client.register_script(ADJUST_LUA)

    async def take(self, buckets: list[Bucket], attempt: str | None = None) -> Admission:
        """`attempt`: an id shared by retries of one admission (a retry whose first try did reach Redis takes nothing)."""
        args: list[float | int] = [len(buckets)]
        for b in buckets:
            args += [b.limit, b.per_ms, b.cost]
        marker = f"{self.p}take:{attempt or uuid.uuid4().hex}"
        out = await self._take(keys=[self.p + b.key for b in buckets] + [marker], args=args)
        return Admission(int(out[0]) == 1, tuple(float(x) for x in out[2:]), float(out[1]) / 1000.0)

    async def adjust(self, bucket: Bucket, delta: float) -> None:
        await self._adjust(keys=[self.p + bucket.key], args=[bucket.limit, bucket.per_ms, delta])
