"""The fair tags shared by every gateway instance, in Redis: one hash per band (`<prefix>flow:tags:<band>`) holding
each tenant's finish tag and the band's virtual time (field `__v`; tenant names cannot begin with `_`).

Each instance keeps its own queue and a local copy of the tags (`FairTags`); a grant is charged locally at once
(the order never waits on Redis) and in Redis by one script, whose answer (the flow's new tag and the band's virtual
time) is merged back. Before serving, an instance merges the tags of the flows it has queued, so a tenant's service
on every instance counts against it everywhere. Tags only grow, so merging takes the larger value and the order of
messages does not matter.

Every call is bounded by `routing.redis_timeout_s` (the pump awaits the refresh before it serves: a Redis that
stops answering must not stop the queue). Redis away (`RedisGuard`): charges and reads are skipped and counted as
fallbacks; the instance orders by its local tags alone — a fair share of what this instance serves — and nothing
queued is lost or refused for it. When Redis answers again the tags merge back in (a flow's local tag ahead of
Redis' stays ahead until Redis catches up).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable

import redis.asyncio as aioredis

from gateway.flow.controller import FairTags
from gateway.flow.waits import Wait, WaitBoard
from gateway.shared_redis import REDIS_ERRORS, RedisGuard

VTIME = "__v"
TTL_S = 86_400  # a band idle for a day starts again from zero
WAITS_KEEP_S = 60  # an instance's entry on the waits board not written for this long is gone (a stopped instance)

# KEYS[1] the band's hash; ARGV: tenant, amount, ttl, burst credit. Returns {new finish tag, band virtual time} as
# strings (Lua numbers would be truncated to integers by the reply conversion). The same rule as FairTags.charge.
CHARGE = """
local v = tonumber(redis.call('HGET', KEYS[1], '__v') or '0')
local f = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local s = math.max(f, v - tonumber(ARGV[4]))
local nf = s + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], tostring(nf))
if s > v then
  redis.call('HSET', KEYS[1], '__v', tostring(s))
  v = s
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {tostring(nf), tostring(v)}
"""


class RedisFairTags:
    def __init__(self, client: aioredis.Redis, prefix: str, timeout_s: float, guard: RedisGuard) -> None:
        self.client = client
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.guard = guard
        self._charge = client.register_script(CHARGE)
        self._stale: set[str] = set()  # other instances' entries on the waits board long past their time

    def _key(self, band: int) -> str:
        return f"{self.prefix}flow:tags:{band}"

    async def charge(self, tags: FairTags, band: int, tenant: str, amount: float) -> None:
        if not self.guard.available:
            self.guard.fallback("away")
            return
        started = self.guard.clock()
        try:
            async with asyncio.timeout(self.timeout_s):
                f, v = await self._charge(keys=[self._key(band)], args=[tenant, repr(amount), TTL_S, repr(tags.burst)])
        except REDIS_ERRORS as e:
            self.guard.fallback(self.guard.failed(e, started))
            return
        self.guard.succeeded()
        tags.merge(band, tenant, float(f), float(v))

    async def scan(self, tags: FairTags, bands: int, board: WaitBoard | None = None, me: str = "",
                   now: float = 0.0) -> dict[tuple[int, str], float]:
        """Every flow's tag in every band (merged into `tags`): which tenants other instances are serving; with
        `board`, every other instance's waits too, in the same round trip."""
        if not self.guard.available:
            self.guard.fallback("away")
            return {}
        started = self.guard.clock()
        try:
            async with asyncio.timeout(self.timeout_s):
                pipe = self.client.pipeline(transaction=False)
                for band in range(bands):
                    pipe.hgetall(self._key(band))
                if board is not None:
                    pipe.hgetall(self._waits_key)
                replies = await pipe.execute()
        except REDIS_ERRORS as e:
            self.guard.fallback(self.guard.failed(e, started))
            return {}
        self.guard.succeeded()
        if board is not None:
            self._merge_waits(replies.pop(), board, me, now)
        out: dict[tuple[int, str], float] = {}
        for band, h in enumerate(replies):
            fields = {(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in h.items()}
            v = fields.pop(VTIME, 0.0)
            for tenant, f in fields.items():
                tags.merge(band, tenant, f, v)
                out[(band, tenant)] = f
        return out

    async def refresh(self, tags: FairTags, flows: Iterable[tuple[int, str]], board: WaitBoard | None = None,
                      me: str = "", now: float = 0.0) -> None:
        """Merge the tags of `flows` (those queued here) and, with `board`, every other instance's waits (`waits.py`),
        in one round trip. `now`: the board's clock."""
        by_band: dict[int, list[str]] = {}
        for band, tenant in flows:
            by_band.setdefault(band, []).append(tenant)
        if not by_band and board is None:
            return
        if not self.guard.available:
            self.guard.fallback("away")
            return
        started = self.guard.clock()
        try:
            async with asyncio.timeout(self.timeout_s):
                pipe = self.client.pipeline(transaction=False)
                for band, tenants in by_band.items():
                    pipe.hmget(self._key(band), [VTIME, *tenants])
                if board is not None:
                    pipe.hgetall(self._waits_key)
                replies = await pipe.execute()
        except REDIS_ERRORS as e:
            self.guard.fallback(self.guard.failed(e, started))
            return
        self.guard.succeeded()
        for (band, tenants), vals in zip(by_band.items(), replies):
            v = float(vals[0] or 0.0)
            for tenant, f in zip(tenants, vals[1:]):
                tags.merge(band, tenant, float(f or 0.0), v)
        if board is not None:
            self._merge_waits(replies[-1], board, me, now)

    # -- the waits board (waits.py) ----------------------------------------------------------------------------
    @property
    def _waits_key(self) -> str:
        return f"{self.prefix}flow:waits"

    def _merge_waits(self, raw: dict[bytes | str, bytes | str], board: WaitBoard, me: str, now: float) -> None:
        """Each other instance's entry (target -> [band, start tag, until in wall seconds]) onto `board`, its times
        moved to the board's clock. An entry that does not parse is skipped: another instance's bad write must not
        stop this one's queue."""
        wall = time.time()
        seen = set()
        for k, v in raw.items():
            inst = k.decode() if isinstance(k, bytes) else k
            if inst == me:
                continue
            try:
                entries = json.loads(v)
                waits = {str(t): Wait(int(b), float(st), now + (float(u) - wall)) for t, (b, st, u) in entries.items()}
            except (ValueError, TypeError, AttributeError):
                continue
            if all(w.until < now - WAITS_KEEP_S for w in waits.values()):  # a stopped instance's: removed at the next write
                self._stale.add(inst)
            seen.add(inst)
            board.merge(inst, waits)
        for inst in board.others(me) - seen:
            board.merge(inst, {})

    async def publish_waits(self, me: str, waits: dict[str, Wait], now: float) -> None:
        """This instance's entry: the targets its passed-over requests wait for (none: the entry is removed)."""
        if not self.guard.available:
            self.guard.fallback("away")
            return
        wall = time.time()
        started = self.guard.clock()
        try:
            async with asyncio.timeout(self.timeout_s):
                if waits:
                    value = json.dumps({t: [w.band, w.start, wall + (w.until - now)] for t, w in waits.items()})
                    pipe = self.client.pipeline(transaction=False)
                    pipe.hset(self._waits_key, me, value)
                    if self._stale:
                        pipe.hdel(self._waits_key, *self._stale)
                    pipe.expire(self._waits_key, WAITS_KEEP_S)
                    await pipe.execute()
                    self._stale.clear()
                else:
                    await self.client.hdel(self._waits_key, me)
        except REDIS_ERRORS as e:
            self.guard.fallback(self.guard.failed(e, started))
            return
        self.guard.succeeded()
