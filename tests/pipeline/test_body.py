"""Reading the request body at the edge (pipeline/body.py), driven through a real Starlette Request over ASGI
messages: chunked bodies whose gaps stay under the read timeout arrive however long they take in all; a stall is a
408; a client leaving mid-body is a ClientDisconnect; a body the framework already read is used as it is."""

import asyncio
import threading

import pytest
from starlette.requests import ClientDisconnect, Request

from gateway.errors import RequestTimeout, RequestTooLarge
from gateway.pipeline.body import read_body


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


def test_a_body_that_arrived_while_the_event_loop_was_blocked_is_not_a_408():
    """An event-loop stall longer than the body-read timeout (a long synchronous step elsewhere) used to turn a request
    whose body had fully arrived into a 408 ("0 bytes received of 78 declared"), which clients must not retry. The
    body is sent while the gateway's loop is blocked for three read timeouts: it is read, not refused. A body that
    really stops arriving is still a 408 (the contrast)."""
    import socket
    import time

    from gateway.app import create_app
    from gateway.config import parse_config
    from gateway.servers import make_server
    from tests.fakes.openai_upstream import FakeOpenAI
    from tests.gateway_fixtures import KEY_A, config
    from tests.support import ServerThread, wait_until

    fake = FakeOpenAI()
    up = ServerThread([fake.app()]).start()
    app = create_app(parse_config(config([{"name": "h", "kind": "openai", "model": "m", "base_url": up.urls[0] + "/v1"}],
                                         timeouts={"body_read": 0.3})))
    gw = ServerThread([app])
    gw.servers = [make_server(app, "127.0.0.1", gw.ports[0], timeout_keep_alive=5, openai_errors=True)]
    gw.start()
    body = b'{"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY_A}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    try:
        for stall, send_body, expect in ((True, True, b"HTTP/1.1 200"), (False, False, b"HTTP/1.1 408")):
            with socket.create_connection(("127.0.0.1", gw.ports[0]), timeout=15) as s:
                s.sendall(head)
                # the request is in its body read (its task runs: the read's first await is its first await)
                wait_until(lambda: len(gw.servers[0].server_state.tasks) == 1, what="the request started")
                if stall:
                    blocked = threading.Event()

                    def block(blocked: threading.Event = blocked) -> None:
                        blocked.set()
                        time.sleep(0.9)  # three body-read timeouts with the loop blocked

                    gw.loop.call_soon_threadsafe(block)
                    blocked.wait(5)
                if send_body:
                    s.sendall(body)  # arrives while the loop is blocked
                got = b""
                while b"\r\n\r\n" not in got:
                    got += s.recv(65536)
            assert got.startswith(expect), got[:200]
    finally:
        gw.stop()
        up.stop()
