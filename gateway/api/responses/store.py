"""Stored responses (`store: true`), per tenant, with a TTL and size caps (`responses:` in the config).

A record is one JSON blob: the Response object and every input item of its turn (the chain's history included),
so `previous_response_id` is one read, never a walk. Keys carry the tenant: another tenant's id is simply absent
(404), nothing leaks. Redis when `routing.redis_url` is set (every instance sees every response), else memory.

Caps: a record over `max_record_bytes` is not stored (the response is still returned; a later retrieve is 404);
each tenant keeps at most `max_per_tenant` records (oldest dropped first); the memory store also holds at most
`max_memory_bytes` in all. A Redis that does not answer within `routing.limits_redis_timeout_s` makes reads fail
with 503 (a chain cannot be continued from a guess) and writes be skipped (logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from gateway.config import ResponsesConfig
from gateway.errors import NoCapacity

log = logging.getLogger("gateway.responses")


class ResponseStore(Protocol):
    async def put(self, tenant: str, resp_id: str, record: bytes) -> bool: ...

    async def get(self, tenant: str, resp_id: str) -> bytes | None: ...

    async def delete(self, tenant: str, resp_id: str) -> bool: ...


class MemoryResponseStore:
    def __init__(self, cfg: ResponsesConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self._all: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()  # oldest first
        self._count: dict[str, int] = {}
        self._bytes = 0

    def _drop(self, key: tuple[str, str]) -> None:
        _, rec = self._all.pop(key)
        self._bytes -= len(rec)
        self._count[key[0]] -= 1

    async def put(self, tenant: str, resp_id: str, record: bytes) -> bool:
        if len(record) > self.cfg.max_record_bytes:
            return False
        key = (tenant, resp_id)
        if key in self._all:
            self._drop(key)
        now = self.clock()
        while self._all:  # expired first (oldest first, so stop at the first live one)
            oldest = next(iter(self._all))
            if self._all[oldest][0] > now:
                break
            self._drop(oldest)
        if self._count.get(tenant, 0) >= self.cfg.max_per_tenant:
            self._drop(next(k for k in self._all if k[0] == tenant))
        while self._all and self._bytes + len(record) > self.cfg.max_memory_bytes:
            self._drop(next(iter(self._all)))
        self._all[key] = (now + self.cfg.ttl_s, record)
        self._count[tenant] = self._count.get(tenant, 0) + 1
        self._bytes += len(record)
        return True

    async def get(self, tenant: str, resp_id: str) -> bytes | None:
        entry = self._all.get((tenant, resp_id))
        if entry is None:
            return None
        if entry[0] <= self.clock():
            self._drop((tenant, resp_id))
            return None
        return entry[1]

    async def delete(self, tenant: str, resp_id: str) -> bool:
        if await self.get(tenant, resp_id) is None:
            return False
        self._drop((tenant, resp_id))
        return True


class RedisResponseStore:
    """`<prefix>resp:<tenant>:<id>` holds the record (EX ttl); `<prefix>respidx:<tenant>` (a sorted set by time)
    bounds each tenant's count."""

    def __init__(self, client: Any, cfg: ResponsesConfig, prefix: str, timeout: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.r = client
        self.cfg = cfg
        self.prefix = prefix
        self.timeout = timeout
        self.clock = clock

    def _key(self, tenant: str, resp_id: str) -> str:
        return f"{self.prefix}resp:{tenant}:{resp_id}"

    async def _call(self, coro: Any) -> Any:
        import redis.exceptions

        try:
            return await asyncio.wait_for(coro, self.timeout)
        except (TimeoutError, redis.exceptions.RedisError, OSError) as e:
            raise NoCapacity("The response store is unavailable; retry shortly.", retry_after=1) from e

    async def put(self, tenant: str, resp_id: str, record: bytes) -> bool:
        if len(record) > self.cfg.max_record_bytes:
            return False
        idx = f"{self.prefix}respidx:{tenant}"
        now = self.clock()
        ttl = max(1, int(self.cfg.ttl_s))

        async def write() -> None:
            pipe = self.r.pipeline(transaction=True)
            pipe.set(self._key(tenant, resp_id), record, ex=ttl)
            pipe.zadd(idx, {resp_id: now})
            pipe.zremrangebyscore(idx, "-inf", now - ttl)
            pipe.expire(idx, ttl)
            pipe.zcard(idx)
            *_, count = await pipe.execute()
            extra = int(count) - self.cfg.max_per_tenant
            if extra > 0:
                old = await self.r.zpopmin(idx, extra)
                if old:
                    await self.r.delete(*[self._key(tenant, (m.decode() if isinstance(m, bytes) else m)) for m, _ in old])

        try:
            await self._call(write())
        except NoCapacity:
            log.warning("response %s not stored: the response store is unavailable", resp_id)
            return False
        return True

    async def get(self, tenant: str, resp_id: str) -> bytes | None:
        raw = await self._call(self.r.get(self._key(tenant, resp_id)))
        return bytes(raw) if raw is not None else None

    async def delete(self, tenant: str, resp_id: str) -> bool:
        async def drop() -> int:
            pipe = self.r.pipeline(transaction=True)
            pipe.delete(self._key(tenant, resp_id))
            pipe.zrem(f"{self.prefix}respidx:{tenant}", resp_id)
            n, _ = await pipe.execute()
            return int(n)

        return bool(await self._call(drop()))


def build_store(cfg: ResponsesConfig, redis_client: Any, prefix: str, timeout: float) -> ResponseStore:
    if redis_client is not None:
        return RedisResponseStore(redis_client, cfg, prefix, timeout)
    return MemoryResponseStore(cfg)
