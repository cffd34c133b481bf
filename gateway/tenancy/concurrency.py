"""A tenant's `max_concurrent`: requests in flight, per instance or across the fleet.

Per instance (always): a counter checked and taken in one synchronous call — no await between the check and the
take, so a burst of requests on one event loop cannot all pass the check before any of them counts.

Fleet-wide (`max_concurrent_scope: fleet`, needs Redis): also a slot in `<prefix>conc:<tenant>`, a sorted set of
slot ids scored by lease expiry (ms, Redis's own clock). Taking is one Lua script (drop expired, count, add);
releasing removes the id. Each instance renews the leases of its own slots every `lease_s / 3`, so the slots of an
instance that crashed expire within `lease_s` instead of holding the tenant's cap forever. A slow answer (a busy
Redis or machine) is waited on and asked again — a take is idempotent per slot id; when Redis is away (refused,
reset, or no answer to anyone for `routing.redis_hung_after_s`) the request is admitted on the local cap alone
(logged and counted, shared_redis.RedisGuard; Redis is retried a second later).

A slot is released exactly once (`release` is idempotent). Its id is minted here, never taken from the client: a
client reusing one x-request-id across concurrent requests would otherwise hold one set member for all of them (so
pass the cap), and release every one of them at its first end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from gateway.background import BackgroundTask
from gateway.shared_redis import RedisGuard

log = logging.getLogger("gateway.concurrency")

# KEYS[1]: the tenant's set. ARGV: request id, cap, lease (ms). Returns 1 if taken, 0 if the cap is reached.
TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  return 1
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[3]))
return 1
"""

# KEYS[1]: the tenant's set. ARGV: lease (ms), then the ids this instance still holds (only existing ones renewed).
RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + lease, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 2 * lease)
return 1
"""


@dataclass(eq=False)
class Slot:
    tenant: str
    request_id: str  # the request's correlation id (logs only)
    fleet: bool = False  # also holds an entry in the shared set
    released: bool = False
    id: str = field(default_factory=lambda: os.urandom(16).hex())  # the gateway's own: the shared set's member


class ConcurrencyLimiter:
    def __init__(self, client: Any = None, prefix: str = "gw:", lease_s: float = 30.0, timeout: float = 1.0,
                 guard: RedisGuard | None = None) -> None:
        self.r = client
        self.prefix = prefix
        self.lease_ms = int(lease_s * 1000)
        self.timeout = timeout
        # a slow answer (a busy Redis, a saturated pool, a busy machine) is waited on; only an outage, or no answer
        # to anyone for the guard's hung_after, sends the cap to this instance alone (shared_redis.RedisGuard)
        self.guard = guard or RedisGuard("concurrency caps")
        self.local: dict[str, int] = {}
        self._held: dict[str, set[str]] = {}  # tenant -> request ids holding a fleet slot from this instance
        self._tasks: set[asyncio.Task[Any]] = set()
        self._take = client.register_script(TAKE_LUA) if client is not None else None
        self._renew = client.register_script(RENEW_LUA) if client is not None else None
        self._bg = BackgroundTask(self._renew_loop, "concurrency-lease") if client is not None else None

    def _key(self, tenant: str) -> str:
        return f"{self.prefix}conc:{tenant}"

    def start(self) -> None:
        if self._bg is not None:
            self._bg.start()

    async def stop(self) -> None:
        if self._bg is not None:
            await self._bg.stop()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def inflight(self, tenant: str) -> int:
        return self.local.get(tenant, 0)

    def try_take(self, tenant: str, request_id: str, cap: int) -> Slot | None:
        """This instance's slot, or None at the cap. Synchronous on purpose: check and take are one step."""
        n = self.local.get(tenant, 0)
        if n >= cap:
            return None
        self.local[tenant] = n + 1
        return Slot(tenant, request_id)

    async def take_fleet(self, slot: Slot, cap: int) -> bool:
        """Also take a fleet-wide slot. False: the fleet is at the cap (the caller releases `slot`). Redis away:
        True — the local cap already holds."""
        if self._take is None or not self.guard.available:
            return True
        while True:  # a take is idempotent per slot id (the script): a slow one is simply asked again
            start = time.monotonic()
            try:
                async with asyncio.timeout(self.timeout):
                    got = await self._take(keys=[self._key(slot.tenant)], args=[slot.id, cap, self.lease_ms])
                self.guard.succeeded()
                break
            except (RedisError, OSError, TimeoutError) as e:
                reason = self.guard.failed(e, start)
                if reason in ("timeout", "saturated") and self.guard.available:
                    await asyncio.sleep(0.01)
                    continue
                self.guard.fallback(reason)
                return True
        if not int(got):
            return False
        slot.fleet = True
        self._held.setdefault(slot.tenant, set()).add(slot.id)
        return True

    def release(self, slot: Slot) -> None:
        if slot.released:
            return
        slot.released = True
        left = self.local.get(slot.tenant, 0) - 1
        if left > 0:
            self.local[slot.tenant] = left
        else:
            self.local.pop(slot.tenant, None)
        if slot.fleet:
            held = self._held.get(slot.tenant)
            if held is not None:
                held.discard(slot.id)
                if not held:
                    del self._held[slot.tenant]
            self._background(self._remove(slot))

    async def _remove(self, slot: Slot) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await self.r.zrem(self._key(slot.tenant), slot.id)
        except (RedisError, OSError, TimeoutError) as e:  # the lease expires it
            self._mark_down(e)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _mark_down(self, err: BaseException) -> None:
        """A background call (release, lease renewal) failed: the guard judges whether Redis is away."""
        self.guard.failed(err, time.monotonic())

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            if not self._held or self._renew is None:
                continue
            try:
                async with asyncio.timeout(self.timeout):
                    for tenant, ids in list(self._held.items()):
                        if ids:
                            await self._renew(keys=[self._key(tenant)], args=[self.lease_ms, *ids])
            except (RedisError, OSError, TimeoutError) as e:
                self._mark_down(e)
