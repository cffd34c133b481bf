"""ASGI pieces shared by the gateway and the simulator.

`EventStreamResponse` streams an async iterator of SSE bytes with two properties Starlette's StreamingResponse
lacks: (1) the status line and headers are sent only when the first chunk exists — the commit point, before
which an error can still become a proper HTTP error; (2) a client disconnect is noticed at any time, even
while no chunk is being written (e.g. during a long prefill), and cancels the producer at once; (3) a client that
stops reading (a `send` blocked longer than `stall_timeout`) gets its connection cut, and the producer stops; (4)
`on_close` runs exactly once however the response ends, and nothing it raises reaches the server: the response
was already decided (a failure there is the callback's to log, never the connection's to carry); (5) a stream
registered in a `LiveStreams` can be cut (a shutdown past its drain timeout): it then ends with what `on_cut` gives
— a last event, or an error response if nothing was sent yet — and a proper end of body, never a silent close. The
server cancelling the response (uvicorn past its graceful timeout) is treated as a cut too.

The rest of the body is an async iterator of chunks, or a `PushBody`: chunks produced from callbacks (an upstream
read relayed from the HTTP client's read callback), each sent there by stepping the server's `send` — which for
uvicorn completes without suspending unless the client's socket pushes back — so the response's task sleeps until
the body ends, fails, or a send has to wait for the socket (then the task finishes that send, with the stall
watchdog on it, and the body goes on).
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


class LiveStreams:
    """The event streams in flight, so that a shutdown can end each of them with a last event (`cut_all`)."""

    def __init__(self) -> None:
        self._cuts: set[Callable[[], None]] = set()

    def __len__(self) -> int:
        return len(self._cuts)

    def add(self, cut: Callable[[], None]) -> None:
        self._cuts.add(cut)

    def discard(self, cut: Callable[[], None]) -> None:
        self._cuts.discard(cut)

    def cut_all(self) -> int:
        """Cut every stream in flight; returns how many."""
        cuts = list(self._cuts)
        for cut in cuts:
            cut()
        return len(cuts)


class PushBody:
    """A body whose chunks come from callbacks. `attach(emit, wake)` starts it: it calls `emit(chunk)` for each chunk
    (False: the send did not complete — the client's socket pushed back — and nothing more may be emitted until
    `resume()`), and `wake()` once it has `finished` (`result()` then returns, or raises what failed it). `detach()`
    ends it early (the client left, a cut, a stall): no call after it. Every method runs on the event loop."""

    finished = False

    def attach(self, emit: Callable[[bytes], bool], wake: Callable[[], None]) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def detach(self) -> None:
        raise NotImplementedError

    def result(self) -> None:
        raise NotImplementedError


class _Resumed:
    """Awaits a coroutine that already ran up to its first suspension (`yielded`, what it suspended on)."""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Any, yielded: Any) -> None:
        self.coro, self.yielded = coro, yielded

    def __await__(self) -> Any:
        coro, y = self.coro, self.yielded
        while True:
            try:
                sent = yield y
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the coroutine, as a task would
                try:
                    y = coro.throw(e)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    y = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


CUT_SEND_S = 2.0  # a cut stream's last event gets this long to reach its client


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
        rest: Callable[[], AsyncIterator[bytes] | PushBody],
        headers: dict[str, str] | None = None,
        on_close: Callable[[bool], Awaitable[None] | None] | None = None,
        stall_timeout: float | None = None,
        on_stall: Callable[[], None] | None = None,
        live: LiveStreams | None = None,
        on_cut: Callable[[bool], bytes | Response] | None = None,
    ) -> None:
        """`first()` returns the first chunk, or a Response (an error) to send instead of the stream;
        `rest()` yields the remaining chunks (or pushes them: `PushBody`). `on_close(disconnected)` runs however it
        ends. `on_stall()` is told before a stalled connection is cut (then `on_close(True)`: the client is as good
        as gone). `live`: where the stream registers while it runs, so it can be cut; `on_cut(committed)` says how a
        cut one ends: the last chunk (committed: the status line was sent) or the response to send instead (not
        committed)."""
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
        self._live = live
        self._on_cut = on_cut
        self._current: asyncio.Future[Any] | None = None  # what a cut cancels: the first chunk's work, then the pump
        self._cutting = False
        self._committed = False

    def _cut(self) -> None:
        if not self._cutting:
            self._cutting = True
            if self._current is not None:
                self._current.cancel()

    async def _end_cut(self, scope: Scope, receive: Receive, send: Send) -> None:
        """End a cut stream as `on_cut` says, within CUT_SEND_S (the client may not be reading)."""
        if self._on_cut is None:
            return
        last = self._on_cut(self._committed)
        try:
            async with asyncio.timeout(CUT_SEND_S):
                if not self._committed:
                    if isinstance(last, Response):
                        await last(scope, receive, send)
                    return
                await send({"type": "http.response.body", "body": last if isinstance(last, bytes) else b"",
                            "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (OSError, TimeoutError):
            pass  # the client is gone or not reading: the cut is still recorded by `on_cut`

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False
        if self._live is not None:
            self._live.add(self._cut)
        try:
            await self._run(scope, receive, send)
        except asyncio.CancelledError:
            # the server cancelled the response (past its graceful shutdown timeout): a cut, told to the client
            # if it still can be, then the cancellation goes on
            if not self._cutting:
                self._cutting = True
                await self._end_cut(scope, receive, send)
            raise
        except _Disconnected:
            disconnected = True
        finally:
            if self._live is not None:
                self._live.discard(self._cut)
            if self._on_close is not None:
                try:
                    res = self._on_close(disconnected)
                    if res is not None:
                        await res
                except Exception:  # the response is decided; its bookkeeping must not break the connection
                    log.exception("stream close callback failed")

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The response; raises _Disconnected when the client left (or stalled) before its end."""
        disconnected = False
        try:
            try:
                self._current = first_work = asyncio.ensure_future(self._first())
                disconnected, first = await run_until_disconnect(receive, first_work)
            except asyncio.CancelledError:
                if not self._cutting or _cancelled_from_outside():
                    raise
                await self._end_cut(scope, receive, send)
                return
            if disconnected:
                raise _Disconnected
            if self._cutting:  # cut while the first chunk was being taken: it is not sent
                await self._end_cut(scope, receive, send)
                return
            if isinstance(first, Response):
                await first(scope, receive, send)
                return
            self.raw_headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in self._extra_headers.items()]
            self.raw_headers.extend([(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")])
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self._committed = True
            await send({"type": "http.response.body", "body": first, "more_body": True})

            loop = asyncio.get_running_loop()
            sending_since: float | None = None  # when the send in progress began (None: not sending)
            stalled = False

            # a send wrapper that changes only the response's start offers the send under it for the body
            # (api/middleware.py): one layer less per event
            body_send = getattr(send, "body_send", send)

            async def pump() -> None:
                nonlocal sending_since
                rest = self._rest()
                if isinstance(rest, PushBody):
                    await pushed(rest)
                else:
                    async for chunk in rest:
                        sending_since = loop.time()
                        await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
                        sending_since = None
                await body_send({"type": "http.response.body", "body": b"", "more_body": False})

            async def pushed(body: PushBody) -> None:
                """The body's chunks sent from its callbacks; the task wakes only to finish a send that waits for
                the client's socket, or at the body's end."""
                nonlocal sending_since
                waiting: list[tuple[Any, Any]] = []  # a send that waits: (its coroutine, what it suspended on)
                failed: list[BaseException] = []
                waiter: asyncio.Future[None] | None = None

                def wake() -> None:
                    if waiter is not None and not waiter.done():
                        waiter.set_result(None)

                def emit(chunk: bytes) -> bool:
                    coro = body_send({"type": "http.response.body", "body": chunk, "more_body": True})
                    try:
                        y = coro.send(None)  # type: ignore[union-attr]
                    except StopIteration:
                        return True
                    except BaseException as e:  # noqa: BLE001 - the send failed: the task's to raise
                        failed.append(e)
                    else:
                        waiting.append((coro, y))
                    wake()
                    return False

                try:
                    body.attach(emit, wake)
                    while True:
                        if failed:
                            raise failed[0]
                        if waiting:
                            coro, y = waiting.pop()
                            sending_since = loop.time()
                            await _Resumed(coro, y)
                            sending_since = None
                            body.resume()
                            continue
                        if body.finished:
                            body.result()
                            return
                        waiter = loop.create_future()
                        await waiter
                        waiter = None
                finally:
                    body.detach()
                    for coro, _ in waiting:  # never finished (cancelled meanwhile)
                        coro.close()

            self._current = task = asyncio.ensure_future(pump())
            if self._cutting:
                task.cancel()
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
                if stalled:
                    disconnected = True
                    if self._on_stall is not None:
                        self._on_stall()
                    # returning with the body incomplete makes the server close the socket (one log line, where
                    # raising AbortConnection would log a traceback per stalled client)
                elif self._cutting and not _cancelled_from_outside():
                    await self._end_cut(scope, receive, send)
                else:
                    raise
            finally:
                if watchdog is not None:
                    watchdog.cancel()
        except OSError:
            disconnected = True
        if disconnected:
            raise _Disconnected


def _cancelled_from_outside() -> bool:
    """Is the running task itself being cancelled (by the server), rather than a future it awaited (by a cut)?"""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Disconnected(Exception):
    """The client left (or stopped reading) before the response's end."""
