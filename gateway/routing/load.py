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

    def apply(self, name: str, prefill_tokens: float, requests: float, rank: int | None = None,
              square: float = 0.0) -> None:
        """A delta (the routing engine's LoadDelta), in this instance's view at once; shared when convenient."""

    async def settle(self) -> None:
        """Every delta applied so far is shared (shutdown, tests)."""


class LoadSum:
    """One replica's load summed from deltas or fields: queued prefill tokens (all of them), requests in flight, and
    the queued prefill per rank (its tokens, and each request's tokens squared, summed) where it was sent with a
    priority the replica schedules by (`prediction/ttft.py: ahead_of`)."""

    __slots__ = ("n", "p", "ranked")

    def __init__(self) -> None:
        self.p = 0.0
        self.n = 0.0
        self.ranked: dict[int, list[float]] = {}  # rank -> [tokens, sum of tokens squared]

    def add(self, prefill_tokens: float, requests: float, rank: int | None = None, square: float = 0.0) -> None:
        self.p += prefill_tokens
        self.n += requests
        if rank is not None:
            b = self.ranked.get(rank)
            if b is None:
                b = self.ranked[rank] = [0.0, 0.0]
            b[0] += prefill_tokens
            b[1] += square

    def merge(self, other: LoadSum) -> None:
        self.p += other.p
        self.n += other.n
        for r, (tokens, n) in other.ranked.items():
            self.add(0.0, 0.0, r, 0.0)
            b = self.ranked[r]
            b[0] += tokens
            b[1] += n

    def view(self, base: LoadView | None = None) -> LoadView:
        """This sum as a view (`base`: a view it is a delta on)."""
        p, n = self.p, self.n
        ranked = self.ranked
        if base is not None:
            p += base.queued_prefill_tokens
            n += base.inflight
            if base.ranked:
                ranked = {r: [tokens, c] for r, tokens, c in base.ranked}
                for r, (tokens, c) in self.ranked.items():
                    b = ranked.setdefault(r, [0.0, 0.0])
                    b[0] += tokens
                    b[1] += c
        parts = tuple(sorted(((r, b[0], max(0.0, b[1])) for r, b in ranked.items() if b[0] > 0.5),
                             reverse=True)) if ranked else ()
        return LoadView(max(0.0, p), max(0.0, n), parts)


class MemoryLoadTracker:
    def __init__(self) -> None:
        self.sums: dict[str, LoadSum] = {}

    def view(self, name: str) -> LoadView:
        s = self.sums.get(name)
        return s.view() if s is not None else LoadView()

    def apply(self, name: str, prefill_tokens: float, requests: float, rank: int | None = None,
              square: float = 0.0) -> None:
        """A delta (the routing engine's LoadDelta; the virtual-clock fleet's too)."""
        s = self.sums.get(name)
        if s is None:
            s = self.sums[name] = LoadSum()
        s.add(prefill_tokens, requests, rank, square)

    async def snapshot(self, names: Sequence[str]) -> dict[str, LoadView]:
        return {n: self.view(n) for n in names}

    async def settle(self) -> None:
        return None


def _fields(gid: str, s: LoadSum) -> list[tuple[str, float]]:
    """A sum as this instance's fields of the replica's hash: `<id>:p` (queued prefill tokens, all of them), `<id>:n`
    (requests), and per rank `<id>:r<rank>:p` / `<id>:r<rank>:s` (its tokens, their squares summed). An older
    gateway reading the hash takes `<id>:r<rank>` for a gateway id it does not know and skips those fields."""
    out = [(f"{gid}:p", s.p), (f"{gid}:n", s.n)]
    for r, (tokens, c) in s.ranked.items():
        out.append((f"{gid}:r{r}:p", tokens))
        out.append((f"{gid}:r{r}:s", c))
    return out


def parse_fields(fields: dict[bytes | str, bytes | str], live: set[str]) -> LoadView:
    """A replica's hash summed over the live gateways' fields (`_fields`)."""
    s = LoadSum()
    for k, v in fields.items():
        k = k.decode() if isinstance(k, bytes) else k
        head, _, kind = k.rpartition(":")
        if head in live:
            if kind == "p":
                s.p += float(v)
            elif kind == "n":
                s.n += float(v)
            continue
        gid, _, tag = head.rpartition(":")
        if gid not in live or not tag.startswith("r"):
            continue
        try:
            rank = int(tag[1:])
        except ValueError:
            continue
        if kind == "p":
            s.add(0.0, 0.0, rank, 0.0)
            s.ranked[rank][0] += float(v)
        elif kind == "s":
            s.add(0.0, 0.0, rank, float(v))
    return s.view()


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
        self._pending: dict[str, LoadSum] = {}  # deltas since the cached snapshot
        # deltas not yet in Redis: staged, and in the exchange under way (write_behind.py)
        self._unsent: dict[str, LoadSum] = {}
        self._sending: dict[str, LoadSum] = {}
        self._acked: list[dict[str, LoadSum]] = []  # exchanges done while a snapshot was being read
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
        for name, s in self.local.sums.items():
            pipe.hset(self._key(name), mapping=dict(_fields(self.id, s)))
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
            cache = {n: parse_fields(fields, live) for n, fields in zip(names, res[1:])}
            # what this instance applied that Redis may not have had when it answered stays on top of it: deltas
            # not sent, under way, or acknowledged while this read was (replies on two connections come in either
            # order). One that made it may count twice until the next snapshot: briefly too much, never too little.
            pending: dict[str, LoadSum] = {}
            for deltas in (*self._acked, self._sending, self._unsent):
                for n, d in deltas.items():
                    acc = pending.get(n)
                    if acc is None:
                        acc = pending[n] = LoadSum()
                    acc.merge(d)
            if not self._reading:
                self._acked = []
            self._cache, self._cache_at, self._pending = cache, now, pending
        out = {}
        for n in names:
            v = self._cache.get(n, LoadView())
            delta = self._pending.get(n)
            out[n] = delta.view(v) if delta is not None else v
        return out

    def apply(self, name: str, prefill_tokens: float, requests: float, rank: int | None = None,
              square: float = 0.0) -> None:
        self.local.apply(name, prefill_tokens, requests, rank, square)
        d = self._pending.get(name)
        if d is None:
            d = self._pending[name] = LoadSum()
        d.add(prefill_tokens, requests, rank, square)
        if not self.guard.available:
            return  # the heartbeat republishes this instance's absolute load once Redis answers
        u = self._unsent.get(name)
        if u is None:
            u = self._unsent[name] = LoadSum()
        u.add(prefill_tokens, requests, rank, square)
        self._writes.kick()

    async def _send(self) -> None:
        """One exchange for every delta staged since the last (a request's add and its first token's release, if
        both are staged, cancel out and send nothing)."""
        batch, self._unsent = self._unsent, {}
        fields = [(self._key(n), f, v) for n, s in batch.items() for f, v in _fields(self.id, s) if v]
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
        # request id -> (target, prefill tokens, at, its rank there)
        self._by_id: dict[str, tuple[str, float, float, int | None]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def reserve(self, request_id: str, name: str, prefill_tokens: float, rank: int | None = None) -> None:
        self._by_id[request_id] = (name, prefill_tokens, self.clock(), rank)

    def release(self, request_id: str) -> None:
        self._by_id.pop(request_id, None)

    def overlay(self, views: dict[str, LoadView]) -> dict[str, LoadView]:
        """`views` with every live reservation added (expired ones dropped)."""
        if not self._by_id:
            return views
        cutoff = self.clock() - self.ttl_s
        extra: dict[str, LoadSum] = {}
        for rid, (name, tokens, at, rank) in list(self._by_id.items()):
            if at < cutoff:
                del self._by_id[rid]
                continue
            s = extra.get(name)
            if s is None:
                s = extra[name] = LoadSum()
            s.add(tokens, 1, rank, tokens * tokens if rank is not None else 0)
        out = dict(views)
        for name, s in extra.items():
            out[name] = s.view(out.get(name, LoadView()))
        return out

