"""ASGI helpers shared by the gateway and the simulator.

`EventStreamResponse` streams an async iterator of SSE bytes with two properties Starlette's StreamingResponse
lacks: (1) the status line and headers are sent only when the first chunk exists — the commit point, before
which an error can still become a proper HTTP error; (2) a client disconnect is noticed at any time, even
while no chunk is being written (e.g. during a long prefill), and cancels the producer at once; (3) a client that
stops reading (a `send` blocked longer than `stall_timeout`) gets its connection cut, and the producer stops; (4)
`on_close` runs exactly once however the response ends, and nothing it raises reaches the server: the response
was already decided (a failure there is the callback's to log, never the connection's to carry).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("gateway.asgi")


class AbortConnection(Exception):
    """Raised by a producer to cut the connection (no terminator): uvicorn closes the socket."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` unless the client disconnects first: (disconnected, result)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return False, task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001, S110 - the client is gone; nothing to report to
        pass
    return True, None


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        first: Callable[[], Awaitable[Response | bytes]],
        rest: Callable[[], AsyncIterator[bytes]],
        headers: dict[str, str] | None = None,
        on_close: Callable[[bool], Awaitable[None] | None] | None = None,
        stall_timeout: float | None = None,
        on_stall: Callable[[], None] | None = None,
    ) -> None:
        """`first()` returns the first chunk, or a Response (an error) to send instead of the stream;
        `rest()` yields the remaining chunks. `on_close(disconnected)` runs however it ends. `on_stall()` is told
        before a stalled connection is cut (then `on_close(True)`: the client is as good as gone)."""
        self.status_code = 200
        self.background = None
        # No content-length: the body is chunked and its end is the stream's end. `headers` is read at commit
        # time, so `first()` may still add to it (e.g. which replica answered).
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        self._extra_headers = headers if headers is not None else {}
        self._first = first
        self._rest = rest
        self._on_close = on_close
        self._stall = stall_timeout
        self._on_stall = on_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        try:
            disconnected, first = await run_until_disconnect(receive, self._first())
            if disconnected:
                return
            if isinstance(first, Response):
                await first(scope, receive, send)
                return
            self.raw_headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in self._extra_headers.items()]
            self.raw_headers.extend([(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")])
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})

            loop = asyncio.get_running_loop()
            sending_since: float | None = None  # when the send in progress began (None: not sending)
            stalled = False

            async def pump() -> None:
                nonlocal sending_since
                async for chunk in self._rest():
                    sending_since = loop.time()
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    sending_since = None
                await send({"type": "http.response.body", "body": b"", "more_body": False})

            task = asyncio.ensure_future(pump())
            # A watchdog, not a timer re-armed per chunk (costly next to the rest of a chunk's work): it wakes once
            # per `stall_timeout` and cuts the stream if one send (uvicorn's waits for the socket to drain) has been
            # blocked that long. Waiting for the upstream is not a stall: that is the idle timeout's business.
            watchdog: asyncio.TimerHandle | None = None
            if self._stall is not None:
                limit = self._stall

                def check() -> None:
                    nonlocal watchdog, stalled
                    since, now = sending_since, loop.time()
                    if since is not None and now - since >= limit:
                        stalled = True
                        task.cancel()
                        return
                    watchdog = loop.call_at((since if since is not None else now) + limit, check)

                watchdog = loop.call_at(loop.time() + limit, check)
            try:
                disconnected, _ = await run_until_disconnect(receive, task)
            except asyncio.CancelledError:
                if not stalled:
                    raise
                disconnected = True
                if self._on_stall is not None:
                    self._on_stall()
                # returning with the body incomplete makes the server close the socket (one log line, where
                # raising AbortConnection would log a traceback per stalled client)
            finally:
                if watchdog is not None:
                    watchdog.cancel()
        except OSError:
            disconnected = True
        finally:
            if self._on_close is not None:
                try:
                    res = self._on_close(disconnected)
                    if res is not None:
                        await res
                except Exception:  # the response is decided; its bookkeeping must not break the connection
                    log.exception("stream close callback failed")
