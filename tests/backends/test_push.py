"""An H1 stream's reads pushed from the connection's read callback (`backends/push.py`) and what the pooled
connection is left as afterwards.

A relay that pauses the upstream (the client's socket pushed back) pauses the connection's transport. If the rest
of the response, its end included, was already read when it paused, the stream ends while the relay drains what was
held back — and the connection goes back to the pool (its response was read to the end). It must go back reading:
a pooled connection whose transport stays paused takes the next request and never sees its answer (that request
then fails on the first-byte timeout: a 504 for a request that had nothing to do with the slow client).

A raw loopback upstream sends the stream in two writes so that the test knows what each of the client's reads
holds: the head and two events, then (when the test asks) the third event, [DONE] and the body's end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.backends.base import StreamBroken
from gateway.backends.h1 import H1Pool
from gateway.backends.openai_compat import _first_read
from gateway.backends.push import UpstreamPush
from gateway.backends.sse import SseSplitter


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
PART1 = _chunked(b'data: {"i":0}\n\n') + _chunked(b'data: {"i":1}\n\n')
PART2 = _chunked(b'data: {"i":2}\n\n') + _chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class Upstream:
    """Answers each request on a connection in turn: a POST with the two-part stream, a GET with `ok`."""

    def __init__(self) -> None:
        self.connections = 0
        self.handlers: list[tuple[asyncio.Task[None], asyncio.StreamWriter]] = []
        self.go_on = asyncio.Event()  # the stream's second write
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.append((task, writer))  # type: ignore[arg-type]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                body = await reader.readexactly(int(length.split(b":")[1]))
                if body == b"stream":
                    writer.write(HEAD + PART1)
                    await writer.drain()
                    await self.go_on.wait()
                    self.go_on.clear()
                    writer.write(PART2)
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def close(self) -> None:
        """Stop listening and end each connection's handler (its reads end at the close)."""
        assert self.server is not None
        self.server.close()
        self.go_on.set()
        for task, writer in self.handlers:
            writer.close()
            await asyncio.wait([task], timeout=10)


class Client:
    """A relay's end of the push (`base.ReadSink`) that takes its payloads as `PushedStream` does: the first read
    pushes back (`pause`), [DONE] ends the stream (`stop`, then the end)."""

    def __init__(self, push: UpstreamPush) -> None:
        self.push = push
        self.payloads: list[bytes] = []
        self.ended = asyncio.get_running_loop().create_future()

    def read(self, payloads: list[bytes]) -> None:
        self.payloads += payloads
        if b"[DONE]" in payloads:
            self.push.stop()
            self.ended.set_result(None)
        elif len(self.payloads) == len(payloads):  # the first read: the client's socket is full
            self.push.pause()

    def end(self, err: StreamBroken | None) -> None:
        if not self.ended.done():
            self.ended.set_result(err)


async def _until(cond: Callable[[], bool], what: str) -> None:
    """Polled: the connection's parser has no event to await."""
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"waited in vain for {what}")


async def test_a_stream_that_ends_while_its_client_pushes_back_leaves_its_connection_reading_in_the_pool():
    up = Upstream()
    pool = H1Pool("127.0.0.1", await up.start())
    try:
        resp, reused = await pool.request("/v1/chat/completions", b"stream", {}, 1.0)
        assert not reused
        split = SseSplitter()
        payloads = await _first_read(resp, None, split)
        assert payloads[0] == b'{"i":0}'
        up.go_on.set()  # the rest of the response, its end included, comes before the relay takes it
        await _until(lambda: resp._conn.done, "the whole response read")
        push = UpstreamPush(resp, split, payloads[1:], idle=30.0)
        client = Client(push)
        push.start(client)  # the first read ({"i":1}) pushes back: the upstream is paused, the rest held
        assert push.paused and client.payloads == [b'{"i":1}']
        push.resume()  # the client drained: what was held is handed over, up to [DONE]
        assert await client.ended is None
        assert client.payloads == [b'{"i":1}', b'{"i":2}', b"[DONE]"]
        conn = resp._conn
        assert conn.transport is not None and conn.transport.is_reading(), "the ended stream left its upstream paused"
        await resp.aclose()  # read to its end: back to the pool, reading
        assert conn in pool._idle and conn.transport.is_reading()
        # and it serves the next request
        resp2, reused = await asyncio.wait_for(pool.request("/health", b"{}", {}, 1.0), 10)
        assert reused and await resp2.aread() == b"ok"
        await resp2.aclose()
        assert up.connections == 1
    finally:
        pool.close()
        await up.close()


async def test_a_stream_whose_client_leaves_while_paused_closes_its_unfinished_connection():
    """The client leaves while the upstream is paused mid-response: the connection is closed (the engine aborts),
    never pooled; the next request takes a new one."""
    up = Upstream()
    pool = H1Pool("127.0.0.1", await up.start())
    try:
        resp, _ = await pool.request("/v1/chat/completions", b"stream", {}, 1.0)
        split = SseSplitter()
        payloads = await _first_read(resp, None, split)
        push = UpstreamPush(resp, split, payloads[1:], idle=30.0)
        client = Client(push)
        push.start(client)
        assert push.paused
        push.stop()  # the client left
        await resp.aclose()
        assert resp._conn not in pool._idle
        await _until(lambda: resp._conn.closed, "the unfinished connection closed")
        up.go_on.set()
        resp2, reused = await asyncio.wait_for(pool.request("/health", b"{}", {}, 1.0), 10)
        assert not reused and await resp2.aread() == b"ok"
        await resp2.aclose()
    finally:
        pool.close()
        await up.close()


async def test_the_pool_takes_a_finished_connection_back_reading_however_its_response_left_it():
    """A response read to its end while its transport was paused (by whatever relayed it) goes back to the pool
    reading: the next request on it is answered."""
    up = Upstream()
    pool = H1Pool("127.0.0.1", await up.start())
    try:
        resp, _ = await pool.request("/health", b"{}", {}, 1.0)
        assert await resp.aread() == b"ok"
        resp.pause_reading()
        await resp.aclose()
        assert resp._conn in pool._idle and resp._conn.transport is not None and resp._conn.transport.is_reading()
        resp2, reused = await asyncio.wait_for(pool.request("/health", b"{}", {}, 1.0), 10)
        assert reused and await resp2.aread() == b"ok"
        await resp2.aclose()
    finally:
        pool.close()
        await up.close()


async def test_a_released_response_cannot_touch_the_request_its_connection_serves_next():
    """A relay's late stop (after its response was closed and the connection pooled, e.g. at shutdown) calls detach
    and the read switches on its old response: the next request on that connection keeps its sink and its reads."""
    up = Upstream()
    pool = H1Pool("127.0.0.1", await up.start())
    try:
        old, _ = await pool.request("/health", b"{}", {}, 1.0)
        assert await old.aread() == b"ok"
        await old.aclose()
        new, reused = await pool.request("/v1/chat/completions", b"stream", {}, 1.0)
        assert reused and new._conn is old._conn
        split = SseSplitter()
        payloads = await _first_read(new, None, split)
        push = UpstreamPush(new, split, payloads[1:], idle=30.0)
        got: list[bytes] = []

        class Sink:
            def read(self, more: list[bytes]) -> None:
                got.extend(more)

            def end(self, err: StreamBroken | None) -> None:
                pass

        push.start(Sink())  # type: ignore[arg-type]
        old.pause_reading()
        old.detach()
        conn = new._conn
        assert conn.sink is not None and conn.transport is not None and conn.transport.is_reading()
        up.go_on.set()
        await _until(lambda: b"[DONE]" in got, "the next request's stream read to its end")
        push.stop()
        await new.aclose()
    finally:
        pool.close()
        await up.close()
