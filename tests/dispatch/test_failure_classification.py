"""Failure classification, breaker evidence, quarantine fingerprints and upstream text sanitising (pure parts)."""

import asyncio
import contextlib

import pytest

from gateway.backends.base import AttemptFailed
from gateway.backends.openai_compat import (
    MAX_UPSTREAM_TEXT,
    sanitize_upstream_text,
    upstream_message,
)
from gateway.circuit_breaker import CircuitBreaker
from gateway.dispatch.ejection import StallDetector
from gateway.dispatch.quarantine import BodyPrint, Quarantine, fingerprint
from gateway.dispatch.retry_policy import (
    Cause,
    classify,
    client_error,
    content_error,
    credentials_error,
    final_error,
)


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self):
        return self.t


@pytest.mark.parametrize("err,cause", [
    (AttemptFailed("refused", connect=True), Cause.REPLICA),
    (AttemptFailed("queue full", status=503, overloaded=True), Cause.REPLICA),
    (AttemptFailed("Unauthorized", status=401), Cause.CREDENTIALS),
    (AttemptFailed("Forbidden", status=403), Cause.CREDENTIALS),
    (AttemptFailed("no first byte", timeout=True), Cause.HANG),
    (AttemptFailed("connection dropped"), Cause.HANG),
    (AttemptFailed("Internal server error: KeyError", status=500), Cause.SUSPECT_5XX),
    (AttemptFailed("Internal server error: OverflowError", status=500), Cause.REQUEST),
    (AttemptFailed("1 validation error for ChatCompletionRequest; tools.0; Input should be a valid dictionary",
                   status=500), Cause.REQUEST),
    (AttemptFailed("token id 1099511627776 is out of vocabulary", status=500), Cause.REQUEST),
    (AttemptFailed("context length exceeded", status=400), Cause.REQUEST),
])
def test_classify_by_cause(err, cause):
    """Only what is about the replica may reach its breaker; the gateway's own credentials are never the client's."""
    assert classify(err) is cause


def test_client_error_for_an_engine_5xx_is_a_400_naming_it():
    e = client_error(AttemptFailed("Internal server error: OverflowError", status=500))
    assert e.status == 400 and e.type == "invalid_request_error" and e.code == "upstream_rejected_request"
    assert "OverflowError" in e.message and e.headers()["x-should-retry"] == "false"
    c = content_error(AttemptFailed("Internal server error: KeyError", status=500), 2)
    assert c.status == 400 and "2 model server replicas" in c.message and "KeyError" in c.message


def test_credentials_error_blames_the_gateway_not_the_client():
    e = credentials_error(["p"], AttemptFailed("Unauthorized", status=401))
    assert e.status == 502 and e.code == "upstream_credentials_rejected"
    assert "gateway's upstream credentials" in e.message and "not your API key" in e.message
    assert e.headers()["x-should-retry"] == "false"


def test_final_error_says_whether_a_retry_can_help():
    conn = AttemptFailed("refused", connect=True)
    busy = AttemptFailed("busy", status=503, overloaded=True)
    slow = AttemptFailed("slow", timeout=True)
    boom = AttemptFailed("boom", status=500)
    assert final_error([conn, conn]).headers()["x-should-retry"] == "true"
    assert final_error([busy]).headers()["x-should-retry"] == "true"
    assert final_error([slow, slow]).headers()["x-should-retry"] == "false"
    assert final_error([boom, conn]).headers()["x-should-retry"] == "false"


def test_breaker_needs_failures_from_distinct_sources():
    """One body replayed (one tenant's bad request) cannot open a breaker; different bodies, or replica-level
    evidence, can."""
    b = CircuitBreaker(3, 5.0, Clock())
    for _ in range(10):
        b.failure("same-body")
    assert b.state.value == "closed" and b.available()
    b.failure("another-body")
    assert b.state.value == "open"
    b2 = CircuitBreaker(3, 5.0, Clock())
    b2.failure("x")
    b2.failure(None)
    assert b2.state.value == "closed"
    b2.failure("x")
    assert b2.state.value == "open"


def test_breaker_trip_and_recent_success():
    clock = Clock(100.0)
    b = CircuitBreaker(3, 5.0, clock)
    assert not b.answered_within(60)
    b.success()
    clock.t = 150.0
    assert b.answered_within(60)
    b.trip("stalled")
    assert b.state.value == "open" and b.reason == "stalled" and not b.available()
    clock.t = 155.0
    assert b.acquire()  # the trial after the cooldown


def test_fingerprint_ignores_volatile_fields_only():
    base = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "n": 1000000}
    same = {**base, "stream": True, "stream_options": {"include_usage": True}, "user": "u1", "seed": 7}
    assert fingerprint(base) == fingerprint(same) == fingerprint(dict(reversed(list(same.items()))))
    assert fingerprint(base) != fingerprint({**base, "n": 2})
    assert fingerprint(base) != fingerprint({**base, "messages": [{"role": "user", "content": "hi!"}]})


def test_quarantine_memory_expires_and_costs_nothing_when_empty():
    clock = Clock(1000.0)
    q = Quarantine(60.0, clock=clock)
    bp = BodyPrint({"model": "m", "prompt": "x"})

    async def go():
        assert not await q.blocked(bp) and bp._key is None  # empty quarantine: no fingerprint computed
        await q.add(bp)
        assert await q.blocked(BodyPrint({"prompt": "x", "model": "m", "stream": True}))
        assert not await q.blocked(BodyPrint({"model": "m", "prompt": "y"}))  # same shape, other content
        other = BodyPrint({"model": "m", "prompt": "x", "n": 2})
        assert not await q.blocked(other) and other._key is None  # another shape: screened by the probe alone
        clock.t = 1061.0
        assert not await q.blocked(bp)

    asyncio.run(go())


def test_sanitize_drops_echoed_input_and_bounds_length():
    secret = "my secret prompt text that must never reach a log line " * 3
    pyd = (f"1 validation error for ChatCompletionRequest\nmessages.0.content\n  Input should be a valid string "
           f"[type=string_type, input_value='{secret}', input_type=dict]\n    For further information visit https://x")
    out = sanitize_upstream_text(pyd)
    assert "secret" not in out and "validation error" in out and "messages.0.content" in out and "\n" not in out
    assert "secret" not in sanitize_upstream_text(f"Cannot process '{secret}'")
    assert len(sanitize_upstream_text("x " * 2500)) == MAX_UPSTREAM_TEXT
    # a provider echoing the credential it refused must not put the gateway's own key in a log line
    for echoed in ("Invalid API key: sk-live-1234567890abcdef", "Incorrect API key provided: nvapi-ABCDEFGH12345",
                   "Authorization: Bearer abcdefgh", "token 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"):
        out = sanitize_upstream_text(echoed)
        assert "[redacted]" in out and echoed.split()[-1] not in out, out
    msg, _ = upstream_message(500, b'{"object":"error","message":"Internal error: \'' + secret.encode() + b'\'","code":500}')
    assert "secret" not in msg and msg.startswith("Internal error")


def test_stall_detector_needs_distinct_overdue_requests_and_silence():
    """One overdue request never ejects; two from different bodies on a replica that answered nothing do; a replica
    that answered anyone recently is alive."""

    class Target:
        name = "r0"
        breaker = CircuitBreaker(3, 5.0)

    async def go():
        clock = Clock(0.0)
        ejected = []
        d = StallDetector(5.0, 2, lambda t, n: ejected.append(n), clock)
        t = Target()
        async with contextlib.AsyncExitStack() as stack:
            w1 = d.begin(t, BodyPrint({"p": 1}), True, 0.0)
            await stack.enter_async_context(w1.timeout)
            clock.t = 6.0
            d._check(t)
            assert ejected == []  # one overdue request: maybe a poison body
            w2 = d.begin(t, BodyPrint({"p": 1}), True, 0.0)  # the same body again: not new evidence
            await stack.enter_async_context(w2.timeout)
            clock.t = 12.0
            d._check(t)
            assert ejected == []
            w3 = d.begin(t, BodyPrint({"p": 2}), True, 0.0)
            await stack.enter_async_context(w3.timeout)
            d.answered(t)  # the replica answered someone: alive
            clock.t = 14.0
            d._check(t)
            assert ejected == []
            clock.t = 23.0
            d._check(t)
            assert ejected == [3]
            assert w1.ejected and w2.ejected and w3.ejected
            await asyncio.Event().wait()  # cut short: the ejection expired the first-byte waits
        for w in (w1, w2, w3):
            d.end(w)

    with pytest.raises(TimeoutError):  # the ejected attempts' first-byte waits are cut short
        asyncio.run(go())


def test_every_5xx_says_whether_to_retry():
    from gateway.errors import GatewayError, InvalidRequest, NoCapacity, RateLimited, UpstreamError

    assert NoCapacity("busy", retry_after=1).headers()["x-should-retry"] == "true"
    assert GatewayError("The gateway hit an internal error.").headers()["x-should-retry"] == "false"
    assert UpstreamError("x", should_retry=True).headers()["x-should-retry"] == "true"
    # a 4xx the same request meets again says so too: agents built on the SDKs (Claude Code) retry unless told
    assert InvalidRequest("bad").headers()["x-should-retry"] == "false"
    assert "x-should-retry" not in RateLimited("slow down", retry_after=1).headers()  # a 429 may pass: the SDK decides
