"""Poison containment: a request body that timed out or broke the connection on two replicas is refused for a while.

The fingerprint is a hash of the client's body without the fields that change between retries of the same request
(stream flags, user, metadata, seed...): what makes a body poison is its content. It is computed lazily — only when a
request fails, or when a cheap probe of the body's shape matches a quarantined one — so other traffic pays nothing.

Shared across instances through Redis when one is configured: a sorted set `<prefix>quarantine` of `probe:fingerprint`
scored by their wall-clock expiry. Each instance checks a local mirror (no Redis round trip per request) and pulls the
set at most every `sync_s`; an add is written through at once. Redis away: the local mirror alone (this instance).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
from redis.exceptions import RedisError

log = logging.getLogger("gateway.quarantine")

# Fields that do not change what the engine does with the body (or change on every retry): left out of the fingerprint.
VOLATILE_FIELDS = frozenset({"stream", "stream_options", "user", "metadata", "seed", "rid", "request_id", "store",
                             "service_tier", "cache_salt", "priority"})


class BodyPrint:
    """A request body, its cheap probe and its fingerprint, each computed on first use.

    The probe (top-level field names, scalar values, sizes of the rest: microseconds, no serialisation) screens a body
    against the quarantine; the fingerprint (a hash of the whole canonical body: ~0.1-0.3 ms for a 20k-token prompt)
    is computed only when the probe matches a quarantined one, or when the request failed."""

    __slots__ = ("_key", "_probe", "body")

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self._key: str | None = None
        self._probe: str | None = None

    @property
    def key(self) -> str:
        if self._key is None:
            self._key = fingerprint(self.body)
        return self._key

    @property
    def probe(self) -> str:
        if self._probe is None:
            self._probe = probe(self.body)
        return self._probe


def probe(body: dict[str, Any]) -> str:
    parts = []
    for k in sorted(k for k in body if k not in VOLATILE_FIELDS):
        v = body[k]
        shape = repr(v) if v is None or isinstance(v, (bool, int, float)) else \
            f"{type(v).__name__}{len(v)}" if isinstance(v, (str, list, dict)) else type(v).__name__
        parts.append(f"{k}={shape}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=6).hexdigest()


def fingerprint(body: dict[str, Any]) -> str:
    canon = {k: v for k, v in body.items() if k not in VOLATILE_FIELDS}
    try:
        raw = orjson.dumps(canon, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except (orjson.JSONEncodeError, TypeError):
        # deeper than orjson serialises (the edge bounds depth, so not expected): the top-level shape stands in
        raw = repr(sorted((k, type(v).__name__) for k, v in canon.items())).encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class Quarantine:
    def __init__(self, ttl_s: float, redis: Any = None, prefix: str = "gw:", timeout: float = 0.1,
                 sync_s: float = 1.0, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.redis = redis
        self.key = f"{prefix}quarantine"
        self.timeout = timeout
        self.sync_s = sync_s
        self.clock = clock
        self._local: dict[str, float] = {}  # "probe:fingerprint" -> expiry (wall clock: comparable across instances)
        self._probes: dict[str, int] = {}  # probe -> quarantined fingerprints with it
        self._last_sync = float("-inf")
        self._tasks: set[asyncio.Task[None]] = set()
        self._redis_ok = True

    async def blocked(self, p: BodyPrint) -> bool:
        """Is this body quarantined? The local mirror, refreshed from Redis at most every `sync_s` (one request a
        second pays that round trip, bounded by `timeout`); an empty quarantine costs no fingerprint."""
        if self.redis is not None and self.clock() - self._last_sync >= self.sync_s:
            self._last_sync = self.clock()
            await self._sync(self._last_sync)
        if not self._probes or p.probe not in self._probes:
            return False
        member = f"{p.probe}:{p.key}"
        expiry = self._local.get(member)
        if expiry is None:
            return False
        if expiry <= self.clock():
            self._forget(member)
            return False
        return True

    def remaining_s(self, p: BodyPrint) -> float:
        return max(0.0, self._local.get(f"{p.probe}:{p.key}", 0.0) - self.clock())

    def add_soon(self, p: BodyPrint) -> None:
        """Quarantine now in this instance; the shared write runs in the background."""
        expiry = self._remember(p)
        if self.redis is not None:
            self._spawn(self._write(p, expiry))

    async def add(self, p: BodyPrint) -> None:
        expiry = self._remember(p)
        if self.redis is not None:
            await self._write(p, expiry)

    def _remember(self, p: BodyPrint) -> float:
        expiry = self.clock() + self.ttl_s
        self._set(f"{p.probe}:{p.key}", expiry)
        if len(self._local) > 10_000:  # bounded: drop the expired, then the soonest to expire
            now = self.clock()
            for k in [k for k, e in self._local.items() if e <= now] or sorted(self._local, key=self._local.__getitem__)[:1000]:
                self._forget(k)
        return expiry

    def _set(self, member: str, expiry: float) -> None:
        if member not in self._local:
            pr = member.partition(":")[0]
            self._probes[pr] = self._probes.get(pr, 0) + 1
        self._local[member] = max(self._local.get(member, 0.0), expiry)

    def _forget(self, member: str) -> None:
        if self._local.pop(member, None) is not None:
            pr = member.partition(":")[0]
            left = self._probes.get(pr, 1) - 1
            if left > 0:
                self._probes[pr] = left
            else:
                self._probes.pop(pr, None)

    async def _write(self, p: BodyPrint, expiry: float) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                await self.redis.zadd(self.key, {f"{p.probe}:{p.key}": expiry})
            self._ok()
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(e)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sync(self, now: float) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                async with self.redis.pipeline(transaction=False) as pipe:
                    pipe.zremrangebyscore(self.key, "-inf", now)
                    pipe.zrangebyscore(self.key, now, "+inf", withscores=True)
                    _, items = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(e)
            return
        self._ok()
        for member, score in items:
            k = member.decode() if isinstance(member, bytes) else str(member)
            if ":" in k:
                self._set(k, float(score))

    def _failed(self, e: BaseException) -> None:
        if self._redis_ok:
            log.warning("quarantine: Redis unreachable (%s); this instance's quarantine only until it answers",
                        type(e).__name__)
        self._redis_ok = False

    def _ok(self) -> None:
        if not self._redis_ok:
            log.info("quarantine: Redis answers again; shared quarantine restored")
        self._redis_ok = True

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
