"""The Redis client every shared-state user gets (prefix index, load, limits, budgets, control), and how the
errors its calls meet are read.

The pool is bounded and blocking: at most `routing.redis_max_connections` connections per instance (default: half
of `routing.expected_inflight`, at least 32 — a request holds a connection only for a round trip), and a call that
finds them all busy waits up to `routing.redis_pool_timeout_s` for one. Running out of that wait is **saturation**
(this instance is busy) and raises `PoolSaturated`, which no caller takes for "Redis is away". redis-py's default
pool instead raises `MaxConnectionsError` at once, past 100 connections: that was read as an outage under load.

A Redis restart leaves every pooled connection pointing at the old process; the first command on one meets "closed
by server". redis-py's own `Retry` (one retry, no backoff, on `ConnectionError` only) then reconnects and sends the
command once more, so a restart costs that call a reconnect, not an outage. Redis really gone still fails that same
call (the reconnect is refused); a timeout is never retried here (slowness is `RedisGuard`'s to judge). A command
resent after a lost reply may run twice: every write sent here is idempotent or repaired (ledger keys, attempt ids,
the load heartbeat's absolute publish).

`RedisGuard` is one user's view of whether Redis is away, from the outcome of its calls:
- refused / reset / loading (a restart replaying its AOF) / any other Redis error: away at once, for
  `retry_after` seconds, then tried again;
- a timeout or a saturated pool: this call was slow. Redis counts as away only when calls have kept failing with no
  success at all for `hung_after` seconds (a hung server), never because a busy event loop or machine made one
  call late.
Each time a user marks Redis away it logs one line and, whenever a call is served from local state instead, counts
`gateway_shared_state_fallbacks_total{what,reason}` (the callback given).

Bounds: the client has no socket timeout (`build_client`); each call is bounded where it is made, by an
`asyncio.timeout` of its user's configured timeout (`routing.redis_timeout_s`: prefix index, load, quarantine, flow
tags; `routing.limits_redis_timeout_s`: rate limits, budgets, concurrency caps, stored responses;
`routing.control_redis_timeout_s`: control state, audit, the control channel's subscribe; the idempotency store's
1 s). A hung Redis (connected, never answering) therefore costs a call its bound, never a request, a background loop
or a shutdown step its progress. The control channel's listener alone waits on Redis with no end (a pub/sub read of
a second at a time, in its own task, cancelled at shutdown). redis-py cancelled mid-call drops that connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.observability.logging import log_event

log = logging.getLogger("gateway.shared_state")

# every error a Redis call can end with (asyncio.timeout raises the builtin TimeoutError, an OSError)
REDIS_ERRORS = (RedisError, OSError)


class PoolSaturated(RedisError):
    """Every pooled connection stayed busy for the whole wait: this instance is saturated, Redis may be fine."""


class BoundedPool(BlockingConnectionPool):
    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        except RedisConnectionError as e:
            # BlockingConnectionPool raises ConnectionError "from" the wait's asyncio timeout when no connection
            # freed up; a failed connect raises redis' own TimeoutError or a ConnectionError without that cause
            if isinstance(e.__cause__, TimeoutError):
                raise PoolSaturated(f"all {self.max_connections} Redis connections busy for {self.timeout}s") from None
            raise


def default_max_connections(expected_inflight: int) -> int:
    return max(32, expected_inflight // 2)


def build_client(url: str, *, password: str | None, max_connections: int, pool_timeout: float,
                 connect_timeout: float) -> aioredis.Redis:
    # a dead pooled connection (Redis restarted) is reconnected and the command resent once, on ConnectionError only.
    # socket_timeout=None: no socket timeout of redis-py's own (8.x defaults to 5 s, which on Python 3.11 wraps every
    # send in asyncio.wait_for, a task per command, and every read in a timeout context). Every call made with this
    # client is bounded by its caller (an asyncio.timeout of the configured routing.*redis_timeout_s around it, see
    # "Bounds" above); the connect alone keeps redis-py's bound (socket_connect_timeout).
    pool = BoundedPool.from_url(url, max_connections=max_connections, timeout=pool_timeout,
                                socket_connect_timeout=connect_timeout, socket_timeout=None, password=password,
                                retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


def classify(err: BaseException) -> str:
    """`saturated` | `timeout` (slow: not an outage by itself) | `unavailable` (refused, reset, loading) | `error`."""
    if isinstance(err, PoolSaturated):
        return "saturated"
    if isinstance(err, (TimeoutError, RedisTimeoutError)):  # before OSError: TimeoutError is one
        return "timeout"
    if isinstance(err, (RedisConnectionError, OSError)):
        return "unavailable"
    return "error"


class RedisGuard:
    def __init__(self, what: str, *, retry_after: float = 1.0, hung_after: float = 3.0,
                 on_fallback: Callable[[str, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.retry_after, self.hung_after = what, retry_after, hung_after
        self.on_fallback = on_fallback
        self.clock = clock
        self._down_until = 0.0
        self._last_success = float("-inf")
        self._failing_since: float | None = None  # start of the earliest failed call begun after the last success
        self.down_reason: str | None = None

    @property
    def available(self) -> bool:
        return self.clock() >= self._down_until

    def succeeded(self) -> None:
        self._last_success, self._failing_since = self.clock(), None
        if self.down_reason is not None:
            log_event("redis_back", what=self.what, was=self.down_reason)
            self.down_reason = None

    def failed(self, err: BaseException, started: float) -> str:
        """Record a failed call that began at `started` (this guard's clock); returns its reason. Marks Redis
        away on an outage, or on slowness that has lasted `hung_after` with no success in between."""
        reason = classify(err)
        now = self.clock()
        if started > self._last_success and (self._failing_since is None or started < self._failing_since):
            self._failing_since = started  # (a call that began before someone else's success was only slow)
        hung = self._failing_since is not None and now - self._failing_since >= self.hung_after
        if reason in ("unavailable", "error") or hung:  # slow for hung_after with no success at all: away too
            if self.available and self.down_reason is None:  # once per outage, not per retry_after window
                log_event("redis_away", what=self.what, reason=reason, error=type(err).__name__,
                          fallback="this instance's own state")
            self.down_reason = reason
            self._down_until = now + self.retry_after
        return reason

    def fallback(self, reason: str) -> None:
        """A call is served from local state instead of Redis (`reason`: why; `away` while marked down)."""
        if self.on_fallback is not None:
            self.on_fallback(self.what, reason)
