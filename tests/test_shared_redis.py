"""How a Redis error is read (`gateway/shared_redis.py`): a busy pool or a late reply is slowness, refused/reset/
loading is an outage; a user of Redis switches to local state only on an outage or when nothing has succeeded for
`hung_after`. Pure: a fixed clock, no Redis."""

from __future__ import annotations

import logging

import pytest
from redis.exceptions import BusyLoadingError, ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.shared_redis import (
    PoolSaturated,
    RedisGuard,
    classify,
    default_max_connections,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("err,reason", [
    (PoolSaturated("busy"), "saturated"),
    (TimeoutError(), "timeout"),  # asyncio.timeout around a call
    (RedisTimeoutError("Timeout reading from socket"), "timeout"),
    (ConnectionError("Error 111 connecting: Connection refused."), "unavailable"),
    (ConnectionRefusedError(), "unavailable"),
    (ConnectionResetError(), "unavailable"),
    (BusyLoadingError("Redis is loading the dataset in memory"), "unavailable"),  # a restart replaying its AOF
    (ResponseError("OOM command not allowed"), "error"),
])
def test_errors_are_classified(err, reason):
    assert classify(err) == reason


def test_the_pool_default_follows_expected_concurrency():
    assert default_max_connections(256) == 128 and default_max_connections(10) == 32


def guard(clock: Clock, seen: list[tuple[str, str]]) -> RedisGuard:
    return RedisGuard("budgets", retry_after=1.0, hung_after=3.0, clock=clock,
                      on_fallback=lambda what, reason: seen.append((what, reason)))


def test_slow_calls_between_successes_never_mark_redis_away(caplog):
    """A saturated pool or a late reply while other calls succeed is a busy instance, not an outage: no log line,
    Redis stays the source of truth."""
    clock, seen = Clock(), []
    g = guard(clock, seen)
    caplog.set_level(logging.WARNING)
    for _ in range(50):
        started = clock.t
        clock.t += 0.5
        assert g.failed(PoolSaturated("busy"), started) == "saturated"
        assert g.failed(TimeoutError(), started) == "timeout"
        g.succeeded()  # others got through meanwhile
        assert g.available
    assert caplog.records == []


def test_a_slow_call_that_began_before_another_success_does_not_count_towards_hung():
    clock, seen = Clock(), []
    g = guard(clock, seen)
    started = clock.t
    clock.t += 1.0
    g.succeeded()
    clock.t += 5.0
    g.failed(TimeoutError(), started)  # slow for 6 s, but Redis answered someone 1 s in
    assert g.available


def test_an_outage_marks_redis_away_at_once_logs_once_and_retries_after_a_second(caplog):
    clock, seen = Clock(), []
    g = guard(clock, seen)
    caplog.set_level(logging.WARNING)
    assert g.failed(ConnectionError("refused"), clock.t) == "unavailable"
    assert not g.available
    g.failed(ConnectionError("refused"), clock.t)  # still away: no second line
    events = [r.fields for r in caplog.records if hasattr(r, "fields")]  # the structured event lines
    assert events == [{"event": "redis_away", "what": "budgets", "reason": "unavailable", "error": "ConnectionError",
                       "fallback": "this instance's own state"}]
    g.fallback("away")
    assert seen == [("budgets", "away")]
    clock.t += 1.0
    assert g.available  # tried again
    g.succeeded()
    assert caplog.records[-1].fields == {"event": "redis_back", "what": "budgets", "was": "unavailable"}


def test_timeouts_with_no_success_at_all_for_hung_after_mark_redis_away():
    """A hung server (connected, never answering) is an outage too, once nothing has succeeded for 3 s."""
    clock, seen = Clock(), []
    g = guard(clock, seen)
    first = clock.t
    for _ in range(5):
        clock.t += 0.5
        g.failed(TimeoutError(), clock.t - 0.5)
    assert g.available  # 2.5 s of timeouts
    clock.t += 0.5
    g.failed(TimeoutError(), first + 2.5)
    assert not g.available and g.down_reason == "timeout"
