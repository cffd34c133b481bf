"""Idempotency keys: a client's explicit `Idempotency-Key`, per tenant, kept `ttl_s`.

The first request with a key takes it (`begin` -> NEW) and is served; when it ends with a 200 its outcome is kept
(`complete`), otherwise the key is let go (`abandon`) so a retry runs. A later request with the same key and the
same body gets that outcome back (DONE) instead of being served and billed again; while the first still runs it is
refused (RUNNING: 409), and with another body too (MISMATCH: 422). Keys are scoped by tenant and stored as digests:
two tenants' equal keys never meet, and no key is kept in clear.

Redis (every instance sees every key: `<prefix>idem:<tenant>:<digest>`, SET NX with a TTL) or memory.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import orjson


class Begin(Enum):
    NEW = "new"
    RUNNING = "running"
    DONE = "done"
    MISMATCH = "mismatch"


@dataclass(frozen=True)
class Outcome:
    """What a replay sends: the status, the headers to repeat and the body (JSON, or the stream's events)."""

    status: int
    headers: dict[str, str]
    body: bytes
    stream: bool


class IdempotencyStore(Protocol):
    async def begin(self, tenant: str, key: str, fingerprint: str) -> tuple[Begin, Outcome | None]: ...
    async def complete(self, tenant: str, key: str, fingerprint: str, outcome: Outcome) -> None: ...
    async def abandon(self, tenant: str, key: str) -> None: ...


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _pack(state: str, fingerprint: str, outcome: Outcome | None = None) -> bytes:
    out: dict[str, Any] = {"state": state, "fp": fingerprint}
    if outcome is not None:
        out.update(status=outcome.status, headers=outcome.headers, body=outcome.body.decode("latin-1"),
                   stream=outcome.stream)
    return orjson.dumps(out)


def _unpack(raw: bytes, fingerprint: str) -> tuple[Begin, Outcome | None]:
    v = orjson.loads(raw)
    if v.get("fp") != fingerprint:
        return Begin.MISMATCH, None
    if v.get("state") != "done":
        return Begin.RUNNING, None
    return Begin.DONE, Outcome(int(v["status"]), dict(v["headers"]), v["body"].encode("latin-1"), bool(v["stream"]))


class MemoryIdempotencyStore:
    def __init__(self, ttl_s: float, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_keys, self.clock = ttl_s, max_keys, clock
        self._keys: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()

    def _get(self, k: tuple[str, str]) -> bytes | None:
        hit = self._keys.get(k)
        if hit is None or hit[0] <= self.clock():
            self._keys.pop(k, None)
            return None
        return hit[1]

    def _set(self, k: tuple[str, str], value: bytes) -> None:
        self._keys[k] = (self.clock() + self.ttl_s, value)
        self._keys.move_to_end(k)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    async def begin(self, tenant: str, key: str, fingerprint: str) -> tuple[Begin, Outcome | None]:
        k = (tenant, digest(key))
        raw = self._get(k)
        if raw is not None:
            return _unpack(raw, fingerprint)
        self._set(k, _pack("running", fingerprint))
        return Begin.NEW, None

    async def complete(self, tenant: str, key: str, fingerprint: str, outcome: Outcome) -> None:
        self._set((tenant, digest(key)), _pack("done", fingerprint, outcome))

    async def abandon(self, tenant: str, key: str) -> None:
        self._keys.pop((tenant, digest(key)), None)


class RedisIdempotencyStore:
    def __init__(self, client: Any, prefix: str, ttl_s: float) -> None:
        self.r, self.prefix, self.ttl = client, prefix, max(1, int(ttl_s))

    def _key(self, tenant: str, key: str) -> str:
        return f"{self.prefix}idem:{tenant}:{digest(key)}"

    async def begin(self, tenant: str, key: str, fingerprint: str) -> tuple[Begin, Outcome | None]:
        k = self._key(tenant, key)
        if await self.r.set(k, _pack("running", fingerprint), nx=True, ex=self.ttl):
            return Begin.NEW, None
        raw = await self.r.get(k)
        if raw is None:  # let go in between: take it now
            return await self.begin(tenant, key, fingerprint)
        return _unpack(bytes(raw), fingerprint)

    async def complete(self, tenant: str, key: str, fingerprint: str, outcome: Outcome) -> None:
        await self.r.set(self._key(tenant, key), _pack("done", fingerprint, outcome), ex=self.ttl)

    async def abandon(self, tenant: str, key: str) -> None:
        await self.r.delete(self._key(tenant, key))
