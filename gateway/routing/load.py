"""Load per replica as the gateways see it: queued prefill tokens (dispatched, no first token yet) and in-flight
requests. `MemoryLoadTracker` is one instance's view; `RedisLoadTracker` sums every live instance's.

Redis layout: `gw:load:<replica>` hash with fields `<gateway id>:p` (prefill tokens) and `<gateway id>:n`
(requests), changed with HINCRBYFLOAT, the deltas applied since the last exchange sent together as one
(`gateway/write_behind.py`: nothing on a request's path waits for them); `gw:gateways` sorted set of gateway ids by
last heartbeat. Readers sum only gateways whose heartbeat is fresh, so a crashed instance's load disappears after
`dead_after` seconds instead of leaking forever. Snapshots are cached for `snapshot_ttl` and local changes are
applied on top at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Protocol

import redis.asyncio as aioredis

from gateway.background import BackgroundTask
from gateway.prediction.ttft import LoadView
from gateway.shared_redis import REDIS_ERRORS, RedisGuard
from gateway.write_behind import Flusher, exchange_bound

log = logging.getLogger("gateway.load")


class LoadTracker(Protocol):
    async def snapshot(self, names: Sequence[str]) -> dict[str, LoadView]: ...

    def apply(self, name: str, prefill_tokens: float, requests: float) -> None:
        """A delta (the routing engine's LoadDelta), in this instance's view at once; shared when convenient."""

    async def settle(self) -> None:
        """Every delta applied so far is shared (shutdown, tests)."""


class MemoryLoadTracker:
    def __init__(self) -> None:
        self.prefill: dict[str, float] = {}
        self.requests: dict[str, float] = {}

    def view(self, name: str) -> LoadView:
        return LoadView(max(0.0, self.prefill.get(name, 0.0)), max(0.0, self.requests.get(name, 0.0)))

    def apply(self, name: str, prefill_tokens: float, requests: float) -> None:
        """A delta (the routing engine's LoadDelta; the virtual-clock fleet's too)."""
        self.prefill[name] = self.prefill.get(name, 0.0) + prefill_tokens
        self.requests[name] = self.requests.get(name, 0.0) + requests

    async def snapshot(self, names: Sequence[str]) -> dict[str, LoadView]:
        return {n: self.view(n) for n in names}

    async def settle(self) -> None:
        return None


class RedisLoadTracker:
    def __init__(self, client: aioredis.Redis, *, prefix: str = "gw:", gateway_id: str | None = None,
                 timeout: float = 0.1, snapshot_ttl: float = 0.05, heartbeat_s: float = 1.0, dead_after: float = 3.0,
                 guard: RedisGuard | None = None) -> None:
        self.r = client
        self.prefix = prefix
        self.id = gateway_id or uuid.uuid4().hex[:12]
        self.timeout = timeout
        self.snapshot_ttl = snapshot_ttl
        self.heartbeat_s = heartbeat_s
        self.dead_after = dead_after
        self.local = MemoryLoadTracker()  # this instance's own load: the fallback view and the source of truth for writes
        self._cache: dict[str, LoadView] = {}
        self._cache_at = 0.0
        self._pending: dict[str, tuple[float, float]] = {}  # deltas since the cached snapshot
        # deltas not yet in Redis: staged, and in the exchange under way (write_behind.py)
        self._unsent: dict[str, list[float]] = {}
        self._sending: dict[str, list[float]] = {}
        self._acked: list[dict[str, list[float]]] = []  # exchanges done while a snapshot was being read
        self._reading = 0  # snapshots being read
        self._writes = Flusher(self._send, "load-writes")
        # a single slow call reads this instance's view once; only an outage (or a hung Redis) switches to it
        self.guard = guard or RedisGuard("load")
        self._bg = BackgroundTask(self._heartbeat, "load-heartbeat")

    def _key(self, name: str) -> str:
        return f"{self.prefix}load:{name}"

    def start(self) -> None:
        self._bg.start()

    async def stop(self) -> None:
        await self.settle()
        await self._bg.stop()
        try:  # leave nothing behind
            async with asyncio.timeout(self.timeout):
                await self.r.zrem(f"{self.prefix}gateways", self.id)
        except REDIS_ERRORS:
            pass

    async def _heartbeat(self) -> None:
        while True:
            start = time.monotonic()
            try:
                async with asyncio.timeout(self.timeout * 5):
                    await self.r.zadd(f"{self.prefix}gateways", {self.id: time.time()})
                    if self.guard.available:
                        await self._publish_all()
                self.guard.succeeded()
            except REDIS_ERRORS as e:
                self.guard.failed(e, start)
            await asyncio.sleep(self.heartbeat_s)

    async def _publish_all(self) -> None:
        """Write this instance's absolute load (repairs whatever was lost while Redis was away, or raced)."""
        self._unsent = {}  # the absolute values below include them
        pipe = self.r.pipeline(transaction=False)
        for name in set(self.local.prefill) | set(self.local.requests):
            v = self.local.view(name)
            pipe.hset(self._key(name), mapping={f"{self.id}:p": v.queued_prefill_tokens, f"{self.id}:n": v.inflight})
        await pipe.execute()

    async def snapshot(self, names: Sequence[str]) -> dict[str, LoadView]:
        now = time.monotonic()
        if not self.guard.available:
            self.guard.fallback("away")
            return await self.local.snapshot(names)
        if now - self._cache_at > self.snapshot_ttl or any(n not in self._cache for n in names):
            self._reading += 1
            try:
                async with asyncio.timeout(self.timeout):
                    pipe = self.r.pipeline(transaction=False)
                    pipe.zrangebyscore(f"{self.prefix}gateways", time.time() - self.dead_after, "+inf")
                    for n in names:
                        pipe.hgetall(self._key(n))
                    res = await pipe.execute()
                self.guard.succeeded()
            except REDIS_ERRORS as e:
                self.guard.fallback(self.guard.failed(e, now))
                return await self.local.snapshot(names)
            finally:
                self._reading -= 1
            live = {g.decode() if isinstance(g, bytes) else g for g in res[0]} | {self.id}
            cache = {}
            for n, fields in zip(names, res[1:]):
                p = q = 0.0
                for k, v in fields.items():
                    k = k.decode() if isinstance(k, bytes) else k
                    gid, _, kind = k.rpartition(":")
                    if gid in live:
                        if kind == "p":
                            p += float(v)
                        else:
                            q += float(v)
                cache[n] = LoadView(max(0.0, p), max(0.0, q))
            # what this instance applied that Redis may not have had when it answered stays on top of it: deltas
            # not sent, under way, or acknowledged while this read was (replies on two connections come in either
            # order). One that made it may count twice until the next snapshot: briefly too much, never too little.
            pending: dict[str, tuple[float, float]] = {}
            for deltas in (*self._acked, self._sending, self._unsent):
                for n, (dp, dq) in deltas.items():
                    p0, q0 = pending.get(n, (0.0, 0.0))
                    pending[n] = (p0 + dp, q0 + dq)
            if not self._reading:
                self._acked = []
            self._cache, self._cache_at, self._pending = cache, now, pending
        out = {}
        for n in names:
            v = self._cache.get(n, LoadView())
            dp, dq = self._pending.get(n, (0.0, 0.0))
            out[n] = LoadView(max(0.0, v.queued_prefill_tokens + dp), max(0.0, v.inflight + dq))
        return out

    def apply(self, name: str, prefill_tokens: float, requests: float) -> None:
        self.local.apply(name, prefill_tokens, requests)
        p0, q0 = self._pending.get(name, (0.0, 0.0))
        self._pending[name] = (p0 + prefill_tokens, q0 + requests)
        if not self.guard.available:
            return  # the heartbeat republishes this instance's absolute load once Redis answers
        d = self._unsent.get(name)
        if d is None:
            d = self._unsent[name] = [0.0, 0.0]
        d[0] += prefill_tokens
        d[1] += requests
        self._writes.kick()

    async def _send(self) -> None:
        """One exchange for every delta staged since the last (a request's add and its first token's release, if
        both are staged, cancel out and send nothing)."""
        batch, self._unsent = self._unsent, {}
        fields = [(self._key(n), f"{self.id}:{kind}", v) for n, (dp, dq) in batch.items()
                  for kind, v in (("p", dp), ("n", dq)) if v]
        if not fields:
            return
        self._sending = batch
        start = time.monotonic()
        try:
            async with asyncio.timeout(exchange_bound(self.timeout, len(fields))):
                if len(fields) == 1:  # no pipeline object for one command (a quiet instance's usual)
                    await self.r.hincrbyfloat(*fields[0])
                else:
                    pipe = self.r.pipeline(transaction=False)
                    for key, field, v in fields:
                        pipe.hincrbyfloat(key, field, v)
                    await pipe.execute()
            if self._reading:
                self._acked.append(batch)
        except REDIS_ERRORS as e:  # lost deltas are repaired by the next heartbeat's absolute publish
            self.guard.failed(e, start)
        finally:
            self._sending = {}

    async def settle(self) -> None:
        await self._writes.settle()


class Reservations:
    """Load a decision has claimed and its dispatch has not yet added, read into every decision after it.

    A decision awaits its load snapshot, decides, then awaits more (budget, the dispatch) before the tracker counts
    the request. Requests that arrive together interleave there: each decides on loads that miss the others, and all
    pick the same replica. The Mooncake conversation trace delivers ~10 requests in the same millisecond every 3 s
    (90% of its requests); over HTTP that herding cost this router a third of its requests within the SLA
    (docs/results/2026-11-27-loadtests.md, "On a 20-minute slice"). A reservation is made in the same synchronous step as the
    decision and dropped once the dispatch's own load is counted; one that is never dropped (refused after the
    decision, a dry run) expires after `ttl_s`.
    """

    def __init__(self, ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._by_id: dict[str, tuple[str, float, float]] = {}  # request id -> (target, prefill tokens, at)

    def __len__(self) -> int:
        return len(self._by_id)

    def reserve(self, request_id: str, name: str, prefill_tokens: float) -> None:
        self._by_id[request_id] = (name, prefill_tokens, self.clock())

    def release(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def overlay(self, views: dict[str, LoadView]) -> dict[str, LoadView]:
        """`views` with every live reservation added (expired ones dropped)."""
        if not self._by_id:
            return views
        cutoff = self.clock() - self.ttl_s
        extra: dict[str, tuple[float, float]] = {}
        for rid, (name, tokens, at) in list(self._by_id.items()):
            if at < cutoff:
                del self._by_id[rid]
                continue
            p, n = extra.get(name, (0.0, 0.0))
            extra[name] = (p + tokens, n + 1)
        out = dict(views)
        for name, (p, n) in extra.items():
            v = out.get(name, LoadView())
            out[name] = LoadView(v.queued_prefill_tokens + p, v.inflight + n)
        return out

