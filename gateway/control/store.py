"""Where the control state and the audit log live: Redis (shared by every instance, changes announced on a pub/sub
channel) or memory (one instance). Same interface, one implementation per class.

Redis keys (prefix `gw:` by default): `ctl:drained` (set of replica names), `ctl:pools` (hash pool -> JSON),
`ctl:tenants` (hash tenant -> JSON), `ctl:policy` (hash tenant -> live policy change JSON, written only by
compare-and-set on its version), `audit` (list of JSON entries, newest first, capped), `audit:seq` (the entries'
ids), `audit:claim:*` (which instance audits a change every instance sees, such as a policy file edit), channel
`ctl:events`.
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
from redis.exceptions import RedisError, WatchError

from gateway.control.state import ControlState, LivePolicy, PoolOverride, TenantOverride

log = logging.getLogger("gateway.control")
AUDIT_MAX = 10_000


class ControlStore(Protocol):
    async def load(self) -> ControlState: ...
    async def set_drained(self, replica: str, drained: bool) -> bool:
        """Set the flag; returns whether it was set before (read and written in one step)."""
    async def cas_pool(self, pool: str, expected: PoolOverride | None, new: PoolOverride | None) -> bool:
        """Write a pool's override iff it is still `expected`; False when another writer changed it first."""
    async def cas_tenant(self, tenant: str, expected: TenantOverride | None, new: TenantOverride | None) -> bool:
        """As cas_pool, for a tenant's override (a lapsed override counts as none)."""
    async def cas_policy(self, tenant: str, expected_version: int, fields: dict[str, Any]) -> LivePolicy | None:
        """Write a tenant's live policy change iff its stored version is still `expected_version` (0: none yet);
        the stored value, or None when another writer got there first."""
    async def publish(self, event: dict[str, Any]) -> None: ...
    def events(self) -> AsyncIterator[dict[str, Any]]: ...
    async def audit(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Append an entry; returns it with its `id` (unique, increasing, shared by every instance)."""
    async def audit_log(self, limit: int) -> list[dict[str, Any]]: ...
    async def claim(self, key: str, ttl_s: float) -> bool:
        """True for the first caller of `key` within `ttl_s` across every instance (one audit entry for a change
        all of them notice)."""


class StoreUnavailable(Exception):
    """The shared store cannot be reached; admin writes are refused rather than applied to one instance only."""


class MemoryControlStore:
    def __init__(self) -> None:
        self._drained: set[str] = set()
        self._pools: dict[str, PoolOverride] = {}
        self._tenants: dict[str, TenantOverride] = {}
        self._policies: dict[str, LivePolicy] = {}
        self._audit: deque[dict[str, Any]] = deque(maxlen=AUDIT_MAX)
        self._seq = 0
        self._claims: dict[str, float] = {}
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def load(self) -> ControlState:
        return ControlState(drained=frozenset(self._drained), pools=dict(self._pools), tenants=dict(self._tenants),
                            policies=dict(self._policies))

    async def set_drained(self, replica: str, drained: bool) -> bool:
        was = replica in self._drained
        (self._drained.add if drained else self._drained.discard)(replica)
        return was

    async def cas_pool(self, pool: str, expected: PoolOverride | None, new: PoolOverride | None) -> bool:
        if self._pools.get(pool) != expected:  # no await between the check and the write
            return False
        _put(self._pools, pool, new)
        return True

    async def cas_tenant(self, tenant: str, expected: TenantOverride | None, new: TenantOverride | None) -> bool:
        cur = self._tenants.get(tenant)
        if (cur if cur is not None and cur.active() else None) != expected:
            return False
        _put(self._tenants, tenant, new)
        return True

    async def cas_policy(self, tenant: str, expected_version: int, fields: dict[str, Any]) -> LivePolicy | None:
        cur = self._policies.get(tenant)
        if (cur.version if cur else 0) != expected_version:  # no await between the check and the write
            return None
        new = LivePolicy(fields=fields, version=expected_version + 1)
        self._policies[tenant] = new
        return new

    async def publish(self, event: dict[str, Any]) -> None:
        self._queue.put_nowait(event)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            yield await self._queue.get()

    async def audit(self, entry: dict[str, Any]) -> dict[str, Any]:
        self._seq += 1
        entry = {"id": self._seq, **entry}
        self._audit.appendleft(entry)
        return entry

    async def audit_log(self, limit: int) -> list[dict[str, Any]]:
        return list(self._audit)[:limit]

    async def claim(self, key: str, ttl_s: float) -> bool:
        now = time.monotonic()
        if self._claims.get(key, 0.0) > now:
            return False
        self._claims[key] = now + ttl_s
        return True


def _put(d: dict[str, Any], k: str, v: Any) -> None:
    if v is None:
        d.pop(k, None)
    else:
        d[k] = v


# compare-and-set of one hash field holding JSON with a "version": KEYS[1] hash, ARGV[1] field, ARGV[2] the expected
# version, ARGV[3] the new JSON (already carrying version expected + 1). Returns 1 if written, 0 if the version moved.
_CAS = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local v = 0
if cur then v = tonumber(cjson.decode(cur)['version']) or 0 end
if v ~= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


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
        async def read() -> tuple[Any, ...]:
            pipe = self.r.pipeline(transaction=False)
            pipe.smembers(f"{self.p}ctl:drained")
            pipe.hgetall(f"{self.p}ctl:pools")
            pipe.hgetall(f"{self.p}ctl:tenants")
            pipe.hgetall(f"{self.p}ctl:policy")
            return tuple(await pipe.execute())

        drained, pools, tenants, policies = await self._do(read())
        now = time.time()
        live = {k.decode(): TenantOverride.model_validate_json(v) for k, v in tenants.items()}
        return ControlState(drained=frozenset(x.decode() for x in drained),
                            pools={k.decode(): PoolOverride.model_validate_json(v) for k, v in pools.items()},
                            tenants={k: v for k, v in live.items() if v.active(now)},
                            policies={k.decode(): LivePolicy.model_validate_json(v) for k, v in policies.items()})

    async def set_drained(self, replica: str, drained: bool) -> bool:
        key = f"{self.p}ctl:drained"
        changed = await self._do(self.r.sadd(key, replica) if drained else self.r.srem(key, replica))
        return (not drained) if int(changed) else drained  # SADD/SREM count only what they changed

    async def cas_pool(self, pool: str, expected: PoolOverride | None, new: PoolOverride | None) -> bool:
        return await self._cas(f"{self.p}ctl:pools", pool, PoolOverride, expected, new)

    async def cas_tenant(self, tenant: str, expected: TenantOverride | None, new: TenantOverride | None) -> bool:
        return await self._cas(f"{self.p}ctl:tenants", tenant, TenantOverride, expected, new)

    async def _cas(self, key: str, field: str, model: type[PoolOverride] | type[TenantOverride],
                   expected: PoolOverride | TenantOverride | None, new: PoolOverride | TenantOverride | None) -> bool:
        """WATCH the hash, compare the field's value (parsed, so the comparison is by value), write in MULTI; a write
        by anyone else in between aborts the transaction (WatchError) and the caller re-reads."""
        async def attempt() -> bool:
            async with self.r.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                raw = await pipe.hget(key, field)
                cur = model.model_validate_json(raw) if raw else None
                if isinstance(cur, TenantOverride) and not cur.active():
                    cur = None
                if cur != expected:
                    await pipe.unwatch()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                    return False
                pipe.multi()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                if new is None:
                    pipe.hdel(key, field)
                else:
                    pipe.hset(key, field, new.model_dump_json())
                try:
                    await pipe.execute()
                except WatchError:
                    return False
                return True

        return await self._do(attempt())  # type: ignore[no-any-return]

    async def cas_policy(self, tenant: str, expected_version: int, fields: dict[str, Any]) -> LivePolicy | None:
        new = LivePolicy(fields=fields, version=expected_version + 1)
        ok = await self._do(self.r.eval(_CAS, 1, f"{self.p}ctl:policy", tenant, str(expected_version),
                                        new.model_dump_json()))
        return new if int(ok) == 1 else None

    async def publish(self, event: dict[str, Any]) -> None:
        await self._do(self.r.publish(self.channel, json.dumps(event)))

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Messages on the channel; reconnects after an outage (the plane re-reads the whole state then, since
        pub/sub does not replay what was missed). The channel waits for messages a second at a time, in the
        listener's own task (which shutdown cancels); the subscribe, and each wait with the reconnect redis-py may
        make in it, are bounded by `timeout` more (a hung Redis: the channel is dropped and subscribed again a
        second later)."""
        while True:
            pubsub = self.r.pubsub()
            try:
                async with asyncio.timeout(self.timeout):
                    await pubsub.subscribe(self.channel)
                yield {"kind": "resync"}
                while True:
                    async with asyncio.timeout(1.0 + self.timeout):
                        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None and msg.get("type") == "message":
                        try:
                            yield json.loads(msg["data"])
                        except (ValueError, TypeError):
                            log.warning("ignoring a malformed control event")
            except (RedisError, OSError) as e:  # (TimeoutError is an OSError)
                log.warning("control channel lost (%s); retrying", type(e).__name__)
                await asyncio.sleep(1.0)
            finally:
                try:
                    await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
                except (RedisError, OSError):
                    pass

    async def audit(self, entry: dict[str, Any]) -> dict[str, Any]:
        async def write() -> dict[str, Any]:
            out = {"id": int(await self.r.incr(f"{self.p}audit:seq")), **entry}
            pipe = self.r.pipeline(transaction=True)
            pipe.lpush(f"{self.p}audit", json.dumps(out))
            pipe.ltrim(f"{self.p}audit", 0, AUDIT_MAX - 1)
            await pipe.execute()
            return out

        return await self._do(write())  # type: ignore[no-any-return]

    async def audit_log(self, limit: int) -> list[dict[str, Any]]:
        rows = await self._do(self.r.lrange(f"{self.p}audit", 0, max(0, limit - 1)))
        return [json.loads(x) for x in rows]

    async def claim(self, key: str, ttl_s: float) -> bool:
        ok = await self._do(self.r.set(f"{self.p}audit:claim:{key}", "1", nx=True, px=max(1, int(ttl_s * 1000))))
        return bool(ok)
