"""A lean HTTP/1.1 client for plain-TCP upstreams (SGLang replicas on the cluster network).

httpx/httpcore were ~40% of the gateway's CPU per request in profiles (URL parsing, h11's pure-Python parser,
pool bookkeeping that scans every connection). SGLang speaks plain HTTP/1.1 with keep-alive, so this client does
just that: asyncio protocol + httptools' C parser (already installed with uvicorn[standard]), one keep-alive pool
per origin. Hosted endpoints (TLS, proxies, HTTP/2) keep using httpx.

Errors: `H1ConnectError` (could not connect), `H1Dropped` (the connection closed before any response byte — a
reused keep-alive connection the server had just closed; safe to retry), `H1Error` (anything else).

`H1Pool.get` is the engine polls' GET (backends/polls.py): the whole answer within one deadline, its body bounded;
besides the errors above it raises `H1Timeout` and `H1TooLarge`.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from typing import Protocol

import httptools


class H1Error(Exception):
    pass


class H1ConnectError(H1Error):
    pass


class H1Dropped(H1Error):
    """The connection closed before any byte of a response; `reused`: it was a pooled keep-alive connection (the
    server may have timed it out just as we sent), so the same request may go again on a fresh one."""

    reused = False


class H1Timeout(H1Error):
    """A GET did not end within its deadline; `connecting`: it was still connecting."""

    def __init__(self, message: str, connecting: bool) -> None:
        super().__init__(message)
        self.connecting = connecting


class H1TooLarge(H1Error):
    """A GET's body passed its bound (the connection is closed, not read to the end)."""


class BodySink(Protocol):
    """Takes a response's body from the connection's callbacks instead of the queue `H1Response.poll` reads
    (`backends/push.py`): each read, the end, or the error."""

    def data(self, body: bytes) -> None: ...

    def done(self) -> None: ...

    def fail(self, err: H1Error) -> None: ...


class _Conn(asyncio.Protocol):
    def __init__(self, pool: H1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_used = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.chunks: collections.deque[bytes] = collections.deque()
        self.done = False
        self.keep_alive = False
        self.got_bytes = False
        self.error: H1Error | None = None
        self.waiter: asyncio.Future[bytes | None] | None = None
        self.sink: BodySink | None = None  # set: the body goes there, not to `chunks`
        self.headers_done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- asyncio.Protocol ------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(H1Error(f"bad HTTP response: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done:
            self._fail(H1Error("connection closed mid-response") if self.got_bytes else H1Dropped("connection closed"))

    # -- httptools callbacks ---------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        # once per network read of a stream: a reader waiting in `H1Response.poll` is handed the bytes themselves
        if not body:
            return  # b"" is `H1Response.poll`'s end of body
        if self.sink is not None:
            self.sink.data(body)
            return
        w = self.waiter
        if w is not None and not w.done() and not self.chunks:
            w.set_result(body)
        else:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the callback returns
        self.done = True
        if self.sink is not None:
            self.sink.done()
        self._wake()

    # -- internals ---------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, err: H1Error) -> None:
        self.error = err
        if not self.headers_done.done():
            self.headers_done.set_exception(err)
            self.headers_done.exception()  # mark retrieved: the caller may already be gone
        if self.sink is not None:
            self.sink.fail(err)
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()


class H1Response:
    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self._released = False
        self.status_code = conn.status
        self.headers = conn.headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while True:
            got = self.poll()
            data = got if isinstance(got, bytes) else await got
            if data is None:
                continue
            if not data:
                return
            yield data

    def poll(self) -> bytes | asyncio.Future[bytes | None]:
        """What arrived since the last poll (b"" once the body has ended; raises its error), or, when nothing has, a
        future to await: its result is the next read, or None (the end, an error: poll again). For a relay that
        waits once per network read with one call and no iterator's frame around it (`aiter_raw`)."""
        c = self._conn
        if c.chunks:
            if len(c.chunks) == 1:
                return c.chunks.popleft()
            data = b"".join(c.chunks)
            c.chunks.clear()
            return data
        if c.done:
            return b""
        if c.error is not None:
            raise c.error
        c.waiter = w = asyncio.get_running_loop().create_future()
        return w

    def attach(self, sink: BodySink) -> None:
        """Hand the body to `sink` from the connection's callbacks from now on (no `poll`): what arrived before is
        handed over first, its reads and then its end or error."""
        c = self._conn
        c.sink = sink
        while c.chunks and c.sink is sink:
            sink.data(c.chunks.popleft())
        if c.sink is sink:
            if c.done:
                sink.done()
            elif c.error is not None:
                sink.fail(c.error)

    # Once released the connection may serve another request: a late call from this response's relay (a stop that
    # runs after the close, at shutdown) must not take that request's sink or pause its reads.
    def detach(self) -> None:
        if not self._released:
            self._conn.sink = None

    def pause_reading(self) -> None:
        t = self._conn.transport
        if not self._released and t is not None and not t.is_closing():
            t.pause_reading()

    def resume_reading(self) -> None:
        t = self._conn.transport
        if not self._released and t is not None and not t.is_closing():
            t.resume_reading()

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        """Return the connection to the pool if the response was read to its end; otherwise close it (which is
        how an unfinished upstream request is cancelled). Idempotent: the connection may already serve another."""
        if self._released:
            return
        self._released = True
        c = self._conn
        if c.done and c.error is None and c.keep_alive and c.usable():
            c.pool.release(c)
        elif c.transport is not None:
            c.transport.close()


class H1Pool:
    def __init__(self, host: str, port: int, max_idle: int = 256, idle_expiry: float = 4.0) -> None:
        self.host = host
        self.port = port
        self.max_idle = max_idle
        self.idle_expiry = idle_expiry  # below SGLang's 5 s keep-alive: never reuse a connection it is about to close
        self._idle: collections.deque[_Conn] = collections.deque()
        self.host_header = f"{host}:{port}".encode()

    async def _connect(self, timeout: float) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, proto = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except TimeoutError:
            raise H1ConnectError("connect timed out") from None
        except OSError as e:
            raise H1ConnectError(str(e)) from None
        return proto

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            c = self._idle.pop()  # most recently used first
            if c.usable() and now - c.last_used < self.idle_expiry:
                return c
            if c.transport is not None:
                c.transport.close()
        return None

    def release(self, c: _Conn) -> None:
        """Pool a connection whose response was read to its end, its transport read again (a paused one would take
        the next request and never see the answer)."""
        c.last_used = time.monotonic()
        c._reset()
        if c.transport is not None and not c.transport.is_reading():
            c.transport.resume_reading()
        if len(self._idle) < self.max_idle:
            self._idle.append(c)
        elif c.transport is not None:
            c.transport.close()

    async def request(self, path: str, body: bytes, headers: dict[str, str], connect_timeout: float) -> tuple[H1Response, bool]:
        """Send a POST; returns once the status line and headers arrived: (response, connection was reused)."""
        conn = self._take_idle()
        reused = conn is not None
        if conn is None:
            conn = await self._connect(connect_timeout)
        head = [b"POST ", path.encode(), b" HTTP/1.1\r\nhost: ", self.host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers.items():
            head += [k.encode(), b": ", v.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        assert conn.transport is not None
        conn.transport.write(b"".join(head) + body)
        try:
            await conn.headers_done
        except BaseException as e:
            if conn.transport is not None:
                conn.transport.close()
            if isinstance(e, H1Dropped):
                e.reused = reused
            raise
        return H1Response(conn), reused

    async def get(self, path: str, headers: dict[str, str], timeout: float, max_body: int) -> tuple[int, bytes]:
        """A GET read to its end within `timeout` s, connecting included: (status, body). A body over `max_body`
        bytes raises H1TooLarge; refused or failed connects H1ConnectError; the deadline H1Timeout. A pooled
        connection the server had just closed is replaced once by a fresh one (a GET is idempotent)."""
        head = [b"GET ", path.encode(), b" HTTP/1.1\r\nhost: ", self.host_header, b"\r\n"]
        for k, v in headers.items():
            head += [k.encode(), b": ", v.encode("latin-1"), b"\r\n"]
        head.append(b"\r\n")
        request = b"".join(head)
        connecting = False
        try:
            async with asyncio.timeout(timeout):
                conn = self._take_idle()
                if conn is not None:
                    try:
                        return await self._get_on(conn, request, max_body)
                    except H1Dropped:
                        pass  # the server closed it as we sent: once more on a fresh one
                connecting = True
                loop = asyncio.get_running_loop()
                try:
                    _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
                except OSError as e:
                    raise H1ConnectError(str(e)) from None
                connecting = False
                return await self._get_on(conn, request, max_body)
        except TimeoutError:
            raise H1Timeout(f"no whole answer within {timeout:g} s", connecting) from None

    async def _get_on(self, conn: _Conn, request: bytes, max_body: int) -> tuple[int, bytes]:
        assert conn.transport is not None
        try:
            conn.transport.write(request)
            await conn.headers_done
            length = conn.headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > max_body:
                raise H1TooLarge(f"body of {int(length)} bytes, over {max_body}")
            resp = H1Response(conn)
            parts: list[bytes] = []
            size = 0
            while True:
                try:
                    got = resp.poll()
                except H1Error:
                    if conn.closed and conn.status and not (b"content-length" in conn.headers
                                                            or b"transfer-encoding" in conn.headers):
                        break  # a body that ends with the connection (no length given): complete
                    raise
                data = got if isinstance(got, bytes) else await got
                if data is None:
                    continue
                if not data:
                    break
                size += len(data)
                if size > max_body:
                    raise H1TooLarge(f"body over {max_body} bytes")
                parts.append(data)
            status = conn.status
            await resp.aclose()  # back to the pool when kept alive and read to its end
            return status, b"".join(parts)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise

    def close(self) -> None:
        while self._idle:
            c = self._idle.pop()
            if c.transport is not None:
                c.transport.close()
