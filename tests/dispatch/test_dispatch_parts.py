import asyncio

import pytest

from gateway.backends.base import AttemptFailed
from gateway.backends.sse import MalformedEvent, sse_payloads
from gateway.circuit_breaker import CircuitBreaker
from gateway.config import GpuHourPricing, PerTokenPricing
from gateway.dispatch.retry_policy import final_error
from gateway.prediction.pricing import request_cost


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_breaker_opens_after_threshold_and_half_opens_after_cooldown():
    clock = Clock()
    b = CircuitBreaker(3, 10.0, clock)
    for _ in range(2):
        assert b.acquire()
        b.failure()
    assert b.available()
    b.acquire()
    b.failure()
    assert not b.available() and not b.acquire()
    clock.t = 10.0
    assert b.available()
    assert b.acquire()  # the single half-open trial
    assert not b.acquire()
    b.success()
    assert b.state.value == "closed" and b.acquire()


def test_breaker_half_open_failure_reopens():
    clock = Clock()
    b = CircuitBreaker(1, 5.0, clock)
    b.acquire()
    b.failure()
    clock.t = 5.0
    assert b.acquire()
    b.failure()
    assert b.state.value == "open" and not b.available()


@pytest.mark.parametrize("failures, opens", [
    ([("body1", "a"), ("body2", "a"), ("body3", "a"), ("body4", "a")], False),  # one tenant, many bodies
    ([("body1", "a"), ("body1", "b"), ("body1", "a")], True),  # two tenants: the target's fault
    ([("body1", None), ("body2", None), ("body3", None)], True),  # tenant unknown: distinct bodies count
    ([("body1", "a"), (None, None), ("body2", "a")], True),  # evidence about the replica itself
])
def test_breaker_counts_one_tenants_bodies_as_one_source(failures, opens):
    b = CircuitBreaker(3, 5.0, Clock())
    for source, tenant in failures:
        b.failure(source, tenant)
    assert (b.state.value == "open") is opens


def test_success_resets_consecutive_failures():
    b = CircuitBreaker(2, 5.0, Clock())
    b.failure()
    b.success()
    b.failure()
    assert b.state.value == "closed"


async def _collect(chunks):
    async def gen():
        for c in chunks:
            yield c

    return [p async for p in sse_payloads(gen())]


@pytest.mark.parametrize(
    "chunks",
    [
        [b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'],
        [b'data: {"a"', b':1}\n', b'\ndata: {"b":2}\n\nda', b'ta: [DONE]\n\n'],
        [b'data: {"a":1}\r\n\r\n: keep-alive\r\n\r\ndata: {"b":2}\r\n\r\ndata: [DONE]\r\n\r\n'],
        [b'data:{"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]'],
        [b'data: {"a":1}\r', b'\n\r\ndata: {"b":2}\r\n\r', b'\ndata: [DONE]\r\n\r\n'],  # CRLF split across reads
        [b'data: {"a":1}\n\ndata: {"b', b'":2}\n\ndata: [DONE]\n\n'],  # a read ending inside its second event
    ],
)
def test_sse_reader_handles_split_packed_and_crlf_frames(chunks):
    """Events split across reads (higress#4248) must not be lost or mangled."""
    assert asyncio.run(_collect(chunks)) == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


def test_per_token_cost_prices_cached_input_as_cached():
    p = PerTokenPricing(input_per_mtok=1.0, cached_input_per_mtok=0.2, output_per_mtok=3.0)
    assert request_cost(p, 20_000, 12_000, 1_000) == pytest.approx((8_000 * 1.0 + 12_000 * 0.2 + 1_000 * 3.0) / 1e6)


def test_gpu_hour_cost_is_replica_time_occupied():
    p = GpuHourPricing(gpus_per_replica=4, usd_per_gpu_hour=2.0, prefill_tokens_per_s=16_000, decode_tokens_per_s=3_600)
    seconds = 8_000 / 16_000 + 1_000 / 3_600
    assert request_cost(p, 20_000, 12_000, 1_000) == pytest.approx(8.0 / 3600 * seconds)
    assert request_cost(None, 10, 0, 10) == 0.0


def test_final_error_mapping():
    t = AttemptFailed("slow", timeout=True)
    o = AttemptFailed("busy", status=503, overloaded=True)
    x = AttemptFailed("boom", status=500)
    assert final_error([t, t]).status == 504
    assert final_error([o, o]).status == 503 and final_error([o]).headers()["retry-after"] == "2"
    e = final_error([o, x])
    assert e.status == 502 and e.headers()["x-should-retry"] == "false"


def test_h1_pool_reuses_connections_and_closes_unfinished_ones():
    """Keep-alive reuse (a second close must not kill a connection already back in the pool) and cancellation
    by closing a response that was not read to its end."""
    from gateway.backends.h1 import H1Pool

    async def go():
        accepted = []
        eof = asyncio.Event()

        async def handle(reader, writer):
            accepted.append(writer)
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1])
                body = await reader.readexactly(n)
                if body == b"slow":
                    writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
                    await writer.drain()
                    await reader.read()  # until the client closes
                    eof.set()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = H1Pool("127.0.0.1", port)
        for _ in range(3):
            resp, _ = await pool.request("/x", b"{}", {}, 1.0)
            assert resp.status_code == 200 and await resp.aread() == b"ok"
            await resp.aclose()
            await resp.aclose()
        assert len(accepted) == 1
        resp, reused = await pool.request("/x", b"slow", {}, 1.0)
        assert reused
        first = await resp.aiter_raw().__anext__()
        assert first == b"hello"
        await resp.aclose()  # unfinished: the connection is closed, the server sees EOF
        await asyncio.wait_for(eof.wait(), 5)
        resp, reused = await pool.request("/x", b"{}", {}, 1.0)
        assert not reused and len(accepted) == 2
        pool.close()
        server.close()

    asyncio.run(go())


@pytest.mark.parametrize("chunks", [
    [b'data: {"a":1}\n\ngarbage line\n\ndata: [DONE]\n\n'],  # a line that is no SSE field
    [b'data: {"a":1}\n\nevent: ping\n\ndata: [DONE]\n\n'],  # an event without data
    [b'data: {"a":1}\n\ndata: not json\n\ndata: [DONE]\n\n'],  # a payload the client could not parse
    [b'data: {"a":1}\n\ndata: [1, 2]\n\n'],
    [b'data: {"a":1}\n\ndata: {"trunc'],  # the stream ends inside an event
])
def test_sse_reader_refuses_malformed_events(chunks):
    """What the relay cannot pass on as an OpenAI event is an error, never skipped or relayed as a success."""
    with pytest.raises(MalformedEvent):
        asyncio.run(_collect(chunks))


def test_sse_reader_allows_comments_and_named_events_with_data():
    chunks = [b': keep-alive\n\nevent: response.created\ndata: {"a":1}\n\nid: 3\ndata: {"b":\ndata: 2}\n\n']
    assert asyncio.run(_collect(chunks)) == [b'{"a":1}', b'{"b":\n2}']
