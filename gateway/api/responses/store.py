"""Stored responses (`store: true`), per tenant, with a TTL and size caps (`responses:` in the config).

Callers put and get one record per turn — `{"response", "input_items", "served_by"}`, its `input_items` being the
whole conversation so far — so `previous_response_id` is one call. What is kept is each turn's **delta**: a turn
that continues a stored one (its response's `previous_response_id`, or the record's `parent`) keeps only the items
after its parent's, a link to the parent and the chain of ancestor ids; a read fetches the turn and its ancestors
(two round trips on Redis) and puts the conversation back together. A 60-turn chain of 20 KB turns therefore holds
~1.2 MB, not the 36 MB that storing every turn's whole history took (O(turns^2)). The parent's items must be the
prefix of the child's (checked by a digest); otherwise, and for a turn without a parent, the record is kept whole.
Writing a turn renews its ancestors' TTL and recency (each a little more recent than its descendants), so a
conversation is evicted from its newest turn back, never from its middle, and its remaining turns stay usable; a
chain whose ancestor is gone nonetheless is refused with a 404 that says so (`ChainBroken`), never continued from a
partial history.

Keys carry the tenant: another tenant's id is simply absent (404), nothing leaks. Redis when `routing.redis_url` is
set (every instance sees every response; the write, its accounting and its evictions are one Lua script), else
memory.

Caps: a record over `max_record_bytes` is not stored (the response is still returned; a later retrieve is 404); each
tenant keeps at most `max_per_tenant` records and `max_tenant_bytes`; all tenants together at most
`max_memory_bytes` — past a cap the least recently written or continued turns go first (the tenant's own for its
caps). A delete makes the turn unretrievable at once; its items stay only as the history of its descendants, until
they go. Reads (retrieve, input items, a chain's continuation) are limited to `retrieves_per_minute` per tenant on
each instance (429 with Retry-After). A Redis that does not answer within `routing.limits_redis_timeout_s` makes
reads fail with 503 (a chain cannot be continued from a guess) and writes be skipped (logged).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from gateway.config import ResponsesConfig
from gateway.errors import GatewayError, NoCapacity, RateLimited

log = logging.getLogger("gateway.responses")
VERSION = 2  # the stored form of a record (an opaque value otherwise)


class ChainBroken(GatewayError):
    """404: an earlier turn of the chain is gone, so the conversation cannot be put back together."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ResponseStore(Protocol):
    async def put(self, tenant: str, resp_id: str, record: bytes) -> bool: ...

    async def get(self, tenant: str, resp_id: str) -> bytes | None: ...

    async def delete(self, tenant: str, resp_id: str) -> bool: ...


# -- the stored form ---------------------------------------------------------------------------------------------
def _digest(items: list[Any]) -> str:
    return hashlib.blake2b(orjson.dumps(items), digest_size=16).hexdigest()


def _parent_id(rec: dict[str, Any]) -> str | None:
    parent = rec.get("parent")
    if parent is None and isinstance(rec.get("response"), dict):
        parent = rec["response"].get("previous_response_id")
    return parent if isinstance(parent, str) and parent else None


def _as_record(raw: bytes) -> dict[str, Any] | None:
    """The caller's record, when it is one (else the value is kept opaque)."""
    try:
        rec = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    ok = isinstance(rec, dict) and isinstance(rec.get("response"), dict) and isinstance(rec.get("input_items"), list)
    return rec if ok else None


def _output(stored: dict[str, Any]) -> list[Any]:
    out = stored["response"].get("output")
    return list(out) if isinstance(out, list) else []


def encode(rec: dict[str, Any], parent_id: str | None, parent: dict[str, Any] | None) -> tuple[bytes, list[str]]:
    """(the value to keep, the ancestor ids it links to, root first)."""
    items = rec["input_items"]
    chain: list[str] = []
    delta = items
    if parent_id is not None and parent is not None and parent.get("v") == VERSION:
        n = int(parent["n"])
        if len(items) >= n and _digest(items[:n]) == parent["h"]:
            delta, chain = items[n:], [*parent["chain"], parent_id]
    full = items + _output(rec)
    out = {"v": VERSION, "response": rec["response"], "items": delta, "chain": chain, "n": len(full),
           "h": _digest(full), "served_by": rec.get("served_by"), "deleted": False}
    return orjson.dumps(out), chain


def decode(tenant: str, resp_id: str, stored: dict[str, Any], ancestors: list[bytes | None]) -> bytes:
    """The caller's record: the turn with the whole conversation's items, put back together from its chain."""
    items: list[Any] = []
    for anc_id, raw in zip(stored["chain"], ancestors):
        if raw is None:
            raise ChainBroken(f"Response '{resp_id}' continues '{anc_id}', which has expired or was evicted; its "
                              "conversation cannot be restored. Start a new one without previous_response_id.")
        anc = orjson.loads(raw)
        items += anc["items"] + _output(anc)
    items += stored["items"]
    return orjson.dumps({"response": stored["response"], "input_items": items, "served_by": stored.get("served_by")})


def tombstone(stored: dict[str, Any]) -> bytes:
    """A deleted turn: unretrievable; only what its descendants need (its items and output) stays."""
    return orjson.dumps({**stored, "response": {"output": _output(stored)}, "served_by": None, "deleted": True})


class _ReadLimit:
    """Reads per tenant per minute on this instance: a token bucket holding a minute's allowance."""

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self.per_s = per_minute / 60.0
        self.cap = float(per_minute)
        self.clock = clock
        self._levels: dict[str, tuple[float, float]] = {}

    def take(self, tenant: str) -> None:
        now = self.clock()
        level, at = self._levels.get(tenant, (self.cap, now))
        level = min(self.cap, level + (now - at) * self.per_s)
        if level < 1.0:
            self._levels[tenant] = (level, now)
            raise RateLimited("Too many reads of stored responses for this key; retry after the time in Retry-After.",
                              retry_after=(1.0 - level) / self.per_s)
        if len(self._levels) > 100_000:
            self._levels.clear()
        self._levels[tenant] = (level - 1.0, now)


# -- memory -------------------------------------------------------------------------------------------------------
class MemoryResponseStore:
    def __init__(self, cfg: ResponsesConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self._all: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()  # least recently written first
        self._count: dict[str, int] = {}
        self._tenant_bytes: dict[str, int] = {}
        self._bytes = 0
        self._reads = _ReadLimit(cfg.retrieves_per_minute, clock)

    def _drop(self, key: tuple[str, str]) -> None:
        _, rec = self._all.pop(key)
        self._bytes -= len(rec)
        self._count[key[0]] -= 1
        self._tenant_bytes[key[0]] -= len(rec)

    def _live(self, key: tuple[str, str]) -> bytes | None:
        entry = self._all.get(key)
        if entry is None:
            return None
        if entry[0] <= self.clock():
            self._drop(key)
            return None
        return entry[1]

    def _keep(self, key: tuple[str, str], value: bytes) -> None:
        if key in self._all:
            self._drop(key)
        self._all[key] = (self.clock() + self.cfg.ttl_s, value)
        self._count[key[0]] = self._count.get(key[0], 0) + 1
        self._tenant_bytes[key[0]] = self._tenant_bytes.get(key[0], 0) + len(value)
        self._bytes += len(value)

    async def put(self, tenant: str, resp_id: str, record: bytes) -> bool:
        now = self.clock()
        while self._all:  # expired first (least recently written first, so stop at the first live one)
            oldest = next(iter(self._all))
            if self._all[oldest][0] > now:
                break
            self._drop(oldest)
        rec = _as_record(record)
        value, chain = record, list[str]()
        if rec is not None:
            parent_id = _parent_id(rec)
            raw_parent = self._live((tenant, parent_id)) if parent_id is not None else None
            value, chain = encode(rec, parent_id, orjson.loads(raw_parent) if raw_parent is not None else None)
        if len(value) > self.cfg.max_record_bytes:
            return False
        key = (tenant, resp_id)
        self._keep(key, value)
        for anc in reversed(chain):  # a conversation in use: renewed, each turn more recent than its descendants
            raw = self._live((tenant, anc))
            if raw is not None:
                self._keep((tenant, anc), raw)
        while self._count[tenant] > self.cfg.max_per_tenant or (
                self._tenant_bytes[tenant] > min(self.cfg.max_tenant_bytes, self.cfg.max_memory_bytes)
                and self._count[tenant] > 1):
            self._drop(next(k for k in self._all if k[0] == tenant and k != key))
        while self._bytes > self.cfg.max_memory_bytes and len(self._all) > 1:
            self._drop(next(k for k in self._all if k != key))
        return True

    async def get(self, tenant: str, resp_id: str) -> bytes | None:
        self._reads.take(tenant)
        raw = self._live((tenant, resp_id))
        if raw is None:
            return None
        stored = _stored(raw)
        if stored is None:
            return raw
        if stored["deleted"]:
            return None
        return decode(tenant, resp_id, stored, [self._live((tenant, a)) for a in stored["chain"]])

    async def delete(self, tenant: str, resp_id: str) -> bool:
        raw = self._live((tenant, resp_id))
        if raw is None:
            return False
        stored = _stored(raw)
        if stored is None:
            self._drop((tenant, resp_id))
            return True
        if stored["deleted"]:
            return False
        self._keep((tenant, resp_id), tombstone(stored))
        return True


def _stored(raw: bytes) -> dict[str, Any] | None:
    if not raw.startswith(b'{"v":'):
        return None
    try:
        out = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return out if isinstance(out, dict) and out.get("v") == VERSION else None


# -- Redis --------------------------------------------------------------------------------------------------------
# One write with its bookkeeping and evictions. KEYS: the record, the tenant's index (id -> last written, s), the
# global index ("<tenant>\x1f<id>" -> last written), sizes (member -> bytes), bytes (tenant -> bytes, "\x1f" -> all).
# ARGV: value, ttl, now, tenant, id, max per tenant, max tenant bytes, max bytes, key prefix, then ancestor ids.
_DROP_FN = """
local SEP = string.char(31)
local function drop(member)
  local size = tonumber(redis.call('HGET', sizes, member) or '0')
  local at = string.find(member, SEP, 1, true)
  local t, i = string.sub(member, 1, at - 1), string.sub(member, at + 1)
  redis.call('DEL', p .. 'resp:' .. t .. ':' .. i)
  redis.call('ZREM', p .. 'respidx:' .. t, i)
  redis.call('ZREM', gidx, member)
  redis.call('HDEL', sizes, member)
  redis.call('HINCRBY', bytes, t, -size)
  redis.call('HINCRBY', bytes, SEP, -size)
end
"""
PUT_LUA = """
local rec, tidx, gidx, sizes, bytes = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local value, ttl, now, tenant, id = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local max_n, max_t, max_all, p = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
""" + _DROP_FN + """
for _, m in ipairs(redis.call('ZRANGEBYSCORE', gidx, '-inf', now - ttl)) do drop(m) end  -- expired
local me = tenant .. SEP .. id
if redis.call('HEXISTS', sizes, me) == 1 then drop(me) end  -- written again
redis.call('SET', rec, value, 'EX', ttl)
redis.call('ZADD', tidx, now, id)
redis.call('ZADD', gidx, now, me)
redis.call('HSET', sizes, me, #value)
redis.call('HINCRBY', bytes, tenant, #value)
redis.call('HINCRBY', bytes, SEP, #value)
for k = 10, #ARGV do  -- the ancestors, root first: renewed, each more recent than its descendants (leaves go first)
  local a, at = ARGV[k], now + (#ARGV - k + 1) * 1e-6
  if redis.call('EXPIRE', p .. 'resp:' .. tenant .. ':' .. a, ttl) == 1 then
    redis.call('ZADD', tidx, 'XX', at, a)
    redis.call('ZADD', gidx, 'XX', at, tenant .. SEP .. a)
  end
end
local function oldest_other(idx)
  for _, m in ipairs(redis.call('ZRANGE', idx, 0, 1)) do
    if m ~= id and m ~= me then return m end
  end
  return nil
end
while redis.call('ZCARD', tidx) > max_n or tonumber(redis.call('HGET', bytes, tenant) or '0') > max_t do
  local i = oldest_other(tidx)
  if not i then break end
  drop(tenant .. SEP .. i)
end
while tonumber(redis.call('HGET', bytes, SEP) or '0') > max_all do
  local m = oldest_other(gidx)
  if not m then break end
  drop(m)
end
for _, k in ipairs({tidx, gidx, sizes, bytes}) do redis.call('EXPIRE', k, ttl) end
return 1
"""
# One turn removed with its bookkeeping. KEYS: the global index, sizes, bytes. ARGV: "<tenant>\x1f<id>", key prefix.
DROP_LUA = """
local gidx, sizes, bytes, p = KEYS[1], KEYS[2], KEYS[3], ARGV[2]
""" + _DROP_FN + """
drop(ARGV[1])
return 1
"""


class RedisResponseStore:
    """`<prefix>resp:<tenant>:<id>` holds a turn (EX ttl); `<prefix>respidx:<tenant>` and `<prefix>respall` (sorted
    sets by last write) order the evictions; `<prefix>respsize` and `<prefix>respbytes` count the bytes held."""

    def __init__(self, client: Any, cfg: ResponsesConfig, prefix: str, timeout: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.r = client
        self.cfg = cfg
        self.prefix = prefix
        self.timeout = timeout
        self.clock = clock
        self._put = client.register_script(PUT_LUA)
        self._drop = client.register_script(DROP_LUA)
        self._reads = _ReadLimit(cfg.retrieves_per_minute, time.monotonic)

    def _key(self, tenant: str, resp_id: str) -> str:
        return f"{self.prefix}resp:{tenant}:{resp_id}"

    async def _call(self, coro: Any) -> Any:
        import redis.exceptions

        try:
            return await asyncio.wait_for(coro, self.timeout)
        except (TimeoutError, redis.exceptions.RedisError, OSError) as e:
            raise NoCapacity("The response store is unavailable; retry shortly.", retry_after=1) from e

    async def _write(self, tenant: str, resp_id: str, value: bytes, chain: list[str]) -> None:
        p = self.prefix
        await self._put(keys=[self._key(tenant, resp_id), f"{p}respidx:{tenant}", f"{p}respall", f"{p}respsize",
                              f"{p}respbytes"],
                        args=[value, max(1, int(self.cfg.ttl_s)), self.clock(), tenant, resp_id,
                              self.cfg.max_per_tenant, min(self.cfg.max_tenant_bytes, self.cfg.max_memory_bytes),
                              self.cfg.max_memory_bytes, p, *chain])

    async def put(self, tenant: str, resp_id: str, record: bytes) -> bool:
        async def write() -> bool:
            rec = _as_record(record)
            value, chain = record, list[str]()
            if rec is not None:
                parent_id = _parent_id(rec)
                raw_parent = await self.r.get(self._key(tenant, parent_id)) if parent_id is not None else None
                value, chain = encode(rec, parent_id, orjson.loads(raw_parent) if raw_parent is not None else None)
            if len(value) > self.cfg.max_record_bytes:
                return False
            await self._write(tenant, resp_id, value, chain)
            return True

        try:
            return bool(await self._call(write()))
        except NoCapacity:
            log.warning("response %s not stored: the response store is unavailable", resp_id)
            return False

    async def get(self, tenant: str, resp_id: str) -> bytes | None:
        self._reads.take(tenant)
        raw = await self._call(self.r.get(self._key(tenant, resp_id)))
        if raw is None:
            return None
        stored = _stored(bytes(raw))
        if stored is None:
            return bytes(raw)
        if stored["deleted"]:
            return None
        ancestors = await self._call(self.r.mget([self._key(tenant, a) for a in stored["chain"]])) \
            if stored["chain"] else []
        return decode(tenant, resp_id, stored, [bytes(a) if a is not None else None for a in ancestors])

    async def delete(self, tenant: str, resp_id: str) -> bool:
        raw = await self._call(self.r.get(self._key(tenant, resp_id)))
        if raw is None:
            return False
        stored = _stored(bytes(raw))
        if stored is not None and stored["deleted"]:
            return False
        if stored is None:  # an opaque value: simply gone
            p = self.prefix
            await self._call(self._drop(keys=[f"{p}respall", f"{p}respsize", f"{p}respbytes"],
                                        args=[f"{tenant}\x1f{resp_id}", p]))
            return True
        await self._call(self._write(tenant, resp_id, tombstone(stored), []))
        return True


def build_store(cfg: ResponsesConfig, redis_client: Any, prefix: str, timeout: float) -> ResponseStore:
    if redis_client is not None:
        return RedisResponseStore(redis_client, cfg, prefix, timeout)
    return MemoryResponseStore(cfg)
