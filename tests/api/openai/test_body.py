"""Reading the request body at the edge (api/openai/body.py), driven through a real Starlette Request over ASGI
messages: chunked bodies whose gaps stay under the read timeout arrive however long they take in all; a stall is a
408; a client leaving mid-body is a ClientDisconnect; a body the framework already read is used as it is."""

import asyncio

import pytest
from starlette.requests import ClientDisconnect, Request

from gateway.api.openai.body import read_body
from gateway.errors import RequestTimeout, RequestTooLarge


def _request(messages: list[dict | None], gap_s: float = 0.0) -> Request:
    """`None` in `messages`: receive never returns again (a client that stopped sending)."""
    it = iter(messages)

    async def receive() -> dict:
        m = next(it)
        if m is None:
            await asyncio.Event().wait()
        await asyncio.sleep(gap_s)
        return m

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def _chunks(n: int) -> list[dict | None]:
    return [{"type": "http.request", "body": b"x", "more_body": i < n - 1} for i in range(n)]


def test_a_slow_but_live_body_arrives_past_one_read_timeout_in_all():
    body = asyncio.run(read_body(_request(_chunks(30), gap_s=0.05), 1000, timeout=1.0))  # ~1.5 s in all
    assert body == b"x" * 30


def test_a_stalled_body_is_a_408_that_closes_the_connection():
    with pytest.raises(RequestTimeout) as e:
        asyncio.run(read_body(_request([{"type": "http.request", "body": b"{", "more_body": True}, None]), 1000, 0.1))
    assert e.value.status == 408 and e.value.extra_headers["connection"] == "close"


def test_a_client_gone_mid_body_is_a_client_disconnect():
    with pytest.raises(ClientDisconnect):
        asyncio.run(read_body(_request([{"type": "http.request", "body": b"{", "more_body": True},
                                        {"type": "http.disconnect"}]), 1000, 1.0))


def test_a_body_past_the_limit_is_a_413():
    with pytest.raises(RequestTooLarge):
        asyncio.run(read_body(_request(_chunks(5)), 4, 1.0))


def test_the_callers_own_cancellation_is_not_a_timeout():
    async def go() -> None:
        task = asyncio.ensure_future(read_body(_request([None]), 1000, 5.0))
        await asyncio.sleep(0.01)
        task.cancel()
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(go())


def test_a_body_the_framework_already_read_is_used():
    async def go() -> bytes:
        r = _request([{"type": "http.request", "body": b'{"a":1}', "more_body": False}])
        await r.body()
        return await read_body(r, 1000, 1.0)

    assert asyncio.run(go()) == b'{"a":1}'
