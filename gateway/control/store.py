"""Where the control state and the audit log live: Redis (shared by every instance, changes announced on a pub/sub
channel) or memory (one instance). Same interface, one implementation per class.

Redis keys (prefix `gw:` by default): `ctl:drained` (set of replica names), `ctl:pools` (hash pool -> JSON),
`ctl:tenants` (hash tenant -> JSON), `audit` (list of JSON entries, newest first, capped), channel `ctl:events`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.control.state import ControlState, PoolOverride, TenantOverride

log = logging.getLogger("gateway.control")
AUDIT_MAX = 10_000


class ControlStore(Protocol):
    async def load(self) -> ControlState: ...
    async def set_drained(self, replica: str, drained: bool) -> None: ...
    async def set_pool(self, pool: str, override: PoolOverride | None) -> None: ...
    async def set_tenant(self, tenant: str, override: TenantOverride | None) -> None: ...
    async def publish(self, event: dict[str, Any]) -> None: ...
    def events(self) -> AsyncIterator[dict[str, Any]]: ...
    async def audit(self, entry: dict[str, Any]) -> None: ...
    async def audit_log(self, limit: int) -> list[dict[str, Any]]: ...


class StoreUnavailable(Exception):
    """The shared store cannot be reached; admin writes are refused rather than applied to one instance only."""


class MemoryControlStore:
    def __init__(self) -> None:
        self._drained: set[str] = set()
        self._pools: dict[str, PoolOverride] = {}
        self._tenants: dict[str, TenantOverride] = {}
        self._audit: deque[dict[str, Any]] = deque(maxlen=AUDIT_MAX)
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def load(self) -> ControlState:
        return ControlState(drained=frozenset(self._drained), pools=dict(self._pools), tenants=dict(self._tenants))

    async def set_drained(self, replica: str, drained: bool) -> None:
        (self._drained.add if drained else self._drained.discard)(replica)

    async def set_pool(self, pool: str, override: PoolOverride | None) -> None:
        _put(self._pools, pool, override)

    async def set_tenant(self, tenant: str, override: TenantOverride | None) -> None:
        _put(self._tenants, tenant, override)

    async def publish(self, event: dict[str, Any]) -> None:
        self._queue.put_nowait(event)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            yield await self._queue.get()

    async def audit(self, entry: dict[str, Any]) -> None:
        self._audit.appendleft(entry)

    async def audit_log(self, limit: int) -> list[dict[str, Any]]:
        return list(self._audit)[:limit]


def _put(d: dict[str, Any], k: str, v: Any) -> None:
    if v is None:
        d.pop(k, None)
    else:
        d[k] = v


class RedisControlStore:
    def __init__(self, client: aioredis.Redis, prefix: str = "gw:", timeout: float = 1.0) -> None:
        self.r = client
        self.p = prefix
        self.timeout = timeout
        self.channel = f"{prefix}ctl:events"

    async def _do(self, coro: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                return await coro
        except (RedisError, OSError, TimeoutError) as e:
            raise StoreUnavailable(f"shared control state unavailable: {type(e).__name__}") from e

    async def load(self) -> ControlState:
        async def read() -> tuple[Any, Any, Any]:
            pipe = self.r.pipeline(transaction=False)
            pipe.smembers(f"{self.p}ctl:drained")
            pipe.hgetall(f"{self.p}ctl:pools")
            pipe.hgetall(f"{self.p}ctl:tenants")
            return tuple(await pipe.execute())

        drained, pools, tenants = await self._do(read())
        now = time.time()
        live = {k.decode(): TenantOverride.model_validate_json(v) for k, v in tenants.items()}
        return ControlState(drained=frozenset(x.decode() for x in drained),
                            pools={k.decode(): PoolOverride.model_validate_json(v) for k, v in pools.items()},
                            tenants={k: v for k, v in live.items() if v.active(now)})

    async def set_drained(self, replica: str, drained: bool) -> None:
        key = f"{self.p}ctl:drained"
        await self._do(self.r.sadd(key, replica) if drained else self.r.srem(key, replica))

    async def set_pool(self, pool: str, override: PoolOverride | None) -> None:
        await self._hput(f"{self.p}ctl:pools", pool, override)

    async def set_tenant(self, tenant: str, override: TenantOverride | None) -> None:
        await self._hput(f"{self.p}ctl:tenants", tenant, override)

    async def _hput(self, key: str, field: str, v: PoolOverride | TenantOverride | None) -> None:
        await self._do(self.r.hdel(key, field) if v is None else self.r.hset(key, field, v.model_dump_json()))

    async def publish(self, event: dict[str, Any]) -> None:
        await self._do(self.r.publish(self.channel, json.dumps(event)))

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Messages on the channel; reconnects after an outage (the plane re-reads the whole state then, since
        pub/sub does not replay what was missed)."""
        while True:
            pubsub = self.r.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                yield {"kind": "resync"}
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg.get("type") == "message":
                        try:
                            yield json.loads(msg["data"])
                        except (ValueError, TypeError):
                            log.warning("ignoring a malformed control event")
            except (RedisError, OSError) as e:
                log.warning("control channel lost (%s); retrying", type(e).__name__)
                await asyncio.sleep(1.0)
            finally:
                try:
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                except (RedisError, OSError):
                    pass

    async def audit(self, entry: dict[str, Any]) -> None:
        async def write() -> None:
            pipe = self.r.pipeline(transaction=True)
            pipe.lpush(f"{self.p}audit", json.dumps(entry))
            pipe.ltrim(f"{self.p}audit", 0, AUDIT_MAX - 1)
            await pipe.execute()

        await self._do(write())

    async def audit_log(self, limit: int) -> list[dict[str, Any]]:
        rows = await self._do(self.r.lrange(f"{self.p}audit", 0, max(0, limit - 1)))
        return [json.loads(x) for x in rows]
