"""A stream's reads after its first chunk, framed for the client (`Framer`), taken one of two ways: awaited a read
at a time by the response's task (`framed`, any backend), or pushed from the HTTP client's read callback
(`PushedStream`, an H1 upstream's `Opened.push`) and sent from there — no future, no task wakeup and no coroutine
frames per event; the task wakes at the end, on an error, or when the client's socket pushes back (asgi.PushBody).

Both take the same framing, so what the client receives does not depend on the path (nor on how the upstream cut
its reads: tests/pipeline/test_relay_reads.py).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import orjson

from gateway.asgi import PushBody
from gateway.backends.base import PushReads, StreamBroken
from gateway.pipeline import idempotency
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.outcome import Outcome

if TYPE_CHECKING:
    from gateway.pipeline.relay import Relay

DONE = b"data: [DONE]\n\n"
GAP_SAMPLES = 256  # reads of a stream whose spacing is kept (Outcome.gaps): a 1k-token answer's ~300 decode steps


def error_of(message: str, type_: str = "server_error", code: str = "upstream_error") -> dict[str, Any]:
    return {"message": message, "type": type_, "param": None, "code": code}


def stream_error(ex: Exchange, error: dict[str, Any]) -> bytes:
    """An in-band error event after the commit point, in the client's API (its encoder's event, else chat SSE)."""
    enc = ex.call.encoder
    return enc.error(error) if enc is not None else b"data: " + orjson.dumps({"error": error}) + b"\n\n"


class Framer:
    """One stream's reads as the client's chunks: the client's model name, the usage chunk kept for metering (and
    shown only if asked for), `[DONE]` or an in-band error ending it, each chunk recorded for a held
    Idempotency-Key. `read(payloads)` returns the bytes for one read (maybe none); `ended` once the stream ended
    ([DONE], an error event); `broken(e)` and `closed()` the last bytes when the upstream broke or closed early."""

    __slots__ = (
        "enc",
        "ended",
        "ex",
        "gaps",
        "held",
        "last",
        "new",
        "new2",
        "old",
        "old2",
        "out",
        "plain",
        "relay",
        "saw_done",
        "swap",
    )

    def __init__(self, relay: Relay, ex: Exchange, out: Outcome) -> None:
        self.relay, self.ex, self.out = relay, ex, out
        self.enc, self.held = ex.call.encoder, ex.idem
        self.swap = relay._swap(ex, out)  # per stream, not per event
        self.old, self.new, self.old2, self.new2 = self.swap
        self.plain = self.enc is None and self.old == self.new  # nothing to rename: the payload is framed as it came
        self.saw_done = False
        self.ended = False
        self.gaps = out.gaps = array("d")  # 8 bytes a read, not a float object each
        self.last = out.first_token_at or time.monotonic()

    def read(self, payloads: list[bytes]) -> bytes:
        out = self.out
        now = time.monotonic()  # each read's spacing: the replica's decode steps (accounting's decode ITL)
        if len(self.gaps) < GAP_SAMPLES:
            self.gaps.append((now - self.last) / (len(payloads) or 1))
        self.last = now
        if len(payloads) == 1:  # the common read: one event
            payload = payloads[0]
            if payload[:8] != b'{"error"' and payload != b"[DONE]":
                out.chunks += 1
                if self.enc is not None or (b'"usage"' in payload and b'"choices":[]' in payload):
                    chunk = self.relay._relay(self.ex, out, payload, self.swap, counted=True)
                    if not chunk:
                        return b""
                elif self.plain:
                    chunk = b"data: " + payload + b"\n\n"
                else:
                    chunk = (
                        b"data: " + payload.replace(self.old, self.new, 1).replace(self.old2, self.new2, 1) + b"\n\n"
                    )
                if self.held is not None:
                    idempotency.streamed(self.held, chunk)
                return chunk
        parts = []
        end = b""
        for payload in payloads:
            if payload == b"[DONE]":
                self.saw_done = True
                end = self.enc.done() if self.enc is not None else DONE
                break
            if payload.startswith(b'{"error"'):
                out.end("stream_error", "upstream error event")
                end = stream_error(self.ex, self.relay._rewrap_error(payload))
                break
            part = self.relay._relay(self.ex, out, payload, self.swap)
            if part:
                parts.append(part)
        chunk = (b"".join(parts) if len(parts) > 1 else parts[0]) if parts else b""
        if chunk and self.held is not None:
            idempotency.streamed(self.held, chunk)
        if end:
            self.ended = True
            if self.saw_done:
                idempotency.streamed(self.held, end)
            return chunk + end if chunk else end
        return chunk

    def broken(self, e: StreamBroken) -> bytes:
        self.ended = True
        self.out.end("stream_error", str(e))
        return stream_error(self.ex, error_of(f"The upstream replica failed mid-stream: {e}"))

    def closed(self) -> bytes:
        """The upstream's stream ended; the last bytes unless it had ended properly."""
        if self.ended:
            return b""
        self.ended = True
        self.out.end("stream_error", "upstream closed the stream before [DONE]")
        return stream_error(self.ex, error_of("The upstream replica closed the stream before it was complete."))


async def framed(framer: Framer, reads: AsyncIterator[list[bytes]]) -> AsyncIterator[bytes]:
    """The stream a read at a time, awaited by the response's task."""
    try:
        async for payloads in reads:
            chunk = framer.read(payloads)
            if chunk:
                yield chunk
            if framer.ended:
                return
    except StreamBroken as e:
        yield framer.broken(e)
        return
    tail = framer.closed()
    if tail:
        yield tail


class PushedStream(PushBody):
    """The stream pushed from the upstream's read callback (`push`), each read framed and emitted there; a send that
    has to wait pauses the upstream until the response's task has finished it (`resume`). Implements
    `base.ReadSink` for the upstream and `asgi.PushBody` for the response."""

    __slots__ = ("backlog", "blocked", "emit", "error", "framer", "push", "wake")

    def __init__(self, framer: Framer, push: PushReads) -> None:
        self.framer, self.push = framer, push
        self.emit: Callable[[bytes], bool] | None = None
        self.wake: Callable[[], None] | None = None
        self.blocked = False  # a send is waiting for the client's socket: chunks wait in `backlog`
        self.backlog: list[bytes] = []
        self.error: BaseException | None = None

    # -- asgi.PushBody -------------------------------------------------------------------------------------------
    def attach(self, emit: Callable[[bytes], bool], wake: Callable[[], None]) -> None:
        self.emit, self.wake = emit, wake
        self.push.start(self)

    def resume(self) -> None:
        self.blocked = False
        if self.backlog:
            chunk = b"".join(self.backlog)
            self.backlog.clear()
            self._send(chunk)
        if not self.blocked and not self.finished:
            self.push.resume()

    def detach(self) -> None:
        self.push.stop()

    def result(self) -> None:
        if self.error is not None:
            raise self.error

    # -- base.ReadSink ---------------------------------------------------------------------------------------------
    def read(self, payloads: list[bytes]) -> None:
        if self.finished:
            return
        try:
            chunk = self.framer.read(payloads)
        except Exception as e:  # noqa: BLE001 - a failure of ours: the response's task raises it, as it would its own
            self.error = e
            self._finish(b"")
            return
        if self.framer.ended:
            self._finish(chunk)
        elif chunk:
            if self.blocked:
                self.backlog.append(chunk)
            elif not self.emit(chunk):  # type: ignore[misc]  # `_send` inline: once per event
                self.blocked = True
                self.push.pause()

    def end(self, err: StreamBroken | None) -> None:
        if self.finished:
            return
        try:
            tail = self.framer.broken(err) if err is not None else self.framer.closed()
        except Exception as e:  # noqa: BLE001 - as in `read`
            self.error, tail = e, b""
        self._finish(tail)

    # -- internals -------------------------------------------------------------------------------------------------
    def _send(self, chunk: bytes) -> None:
        if self.blocked:
            self.backlog.append(chunk)
            return
        assert self.emit is not None
        if not self.emit(chunk):
            self.blocked = True
            self.push.pause()

    def _finish(self, tail: bytes) -> None:
        self.finished = True
        self.push.stop()
        if tail and self.error is None:
            self._send(tail)
        assert self.wake is not None
        self.wake()
