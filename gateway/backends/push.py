"""A stream's reads relayed from the HTTP client's read callback (`PushReads` of an H1 response).

An engine sends an event per decode step, one network read each. Awaited by a task, each read cost a future, a
task wakeup and the frames of the coroutines between the socket and the client's send (`HttpBackend._reads`). Here
the read is split into events in the connection's own callback and handed to the relay's sink at once, which frames
it and writes it to the client in the same callback; the request's task sleeps until the stream ends, fails, or the
client's socket pushes back (then `pause` stops reading the upstream until the client drains: `resume`).

The idle watchdog is the iterator path's: one timer for the stream, which on firing breaks the stream if nothing
came from the upstream for `idle` seconds, else sets itself for when that would be. Time the client spends draining
(paused) is not the upstream's silence.
"""

from __future__ import annotations

import asyncio
import collections

from gateway.backends.base import ReadSink, StreamBroken
from gateway.backends.h1 import H1Error, H1Response
from gateway.backends.sse import MalformedEvent, SseSplitter


class UpstreamPush:
    """The rest of an H1 stream after its first payload: `pending` (the first read's other payloads), then each read
    as the connection's callbacks get it. Implements `base.PushReads` for the connection's `BodySink`."""

    __slots__ = ("held", "idle", "loop", "paused", "pending", "queue", "resp", "since", "sink", "split", "stopped",
                 "timer")

    def __init__(self, resp: H1Response, split: SseSplitter, pending: list[bytes], idle: float) -> None:
        self.resp, self.split, self.pending, self.idle = resp, split, pending, idle
        self.sink: ReadSink | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # what arrived while paused, in order: a read, b"" (the end) or the connection's error
        self.queue: collections.deque[bytes | H1Error] = collections.deque()
        self.paused = False  # the sink asked for nothing more until `resume`
        # the connection's transport is not being read (`pause` stopped it). Not the same as `paused`: `resume`
        # clears `paused` first and hands over the queue, which may end the stream before reading starts again.
        self.held = False
        self.stopped = False
        self.since: float | None = None  # when the wait for the upstream in progress began (None: not waiting)
        self.timer: asyncio.TimerHandle | None = None

    # -- PushReads -------------------------------------------------------------------------------------------
    def start(self, sink: ReadSink) -> None:
        self.sink = sink
        self.loop = loop = asyncio.get_running_loop()
        if self.pending:
            first, self.pending = self.pending, []
            sink.read(first)
        if self.stopped:
            return
        self.resp.attach(self)  # hands over what arrived meanwhile, then each read from its callback
        if not self.stopped and not self.paused:
            self.since = loop.time()
            self.timer = loop.call_at(self.since + self.idle, self._check)

    def pause(self) -> None:
        if not self.paused and not self.stopped:
            self.paused = True
            self.since = None
            if not self.held:
                self.held = True
                self.resp.pause_reading()

    def resume(self) -> None:
        if not self.paused or self.stopped:
            return
        self.paused = False
        q = self.queue
        while q and not self.paused and not self.stopped:
            item = q.popleft()
            if isinstance(item, H1Error):
                self._fail(item)
            elif item:
                self._data(item)
            else:
                self._done()
        if self.paused or self.stopped:
            return
        self.held = False
        self.resp.resume_reading()
        assert self.loop is not None
        self.since = self.loop.time()
        if self.timer is None:
            self.timer = self.loop.call_at(self.since + self.idle, self._check)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.since = None
        self.resp.detach()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.paused = False
        if self.held:  # a response whose end arrived before the pause goes back to the pool: reading again
            self.held = False
            self.resp.resume_reading()
        self.queue.clear()

    # -- the connection's BodySink ---------------------------------------------------------------------------------
    def data(self, body: bytes) -> None:
        if self.paused or self.queue or self.stopped:
            if not self.stopped:
                self.queue.append(body)
            return
        # `_data`'s body, kept inline rather than called: this runs once per event, where a call is a measurable
        # share of the relay's CPU (docs/results/2026-11-28-request-cpu.md, 9a620bc); keep the two alike
        self.since = self.loop.time()  # type: ignore[union-attr]
        try:
            payloads = self.split.feed(body)
        except MalformedEvent as e:
            self._broken(f"upstream sent a malformed event ({e})")
            return
        if payloads:
            self.sink.read(payloads)  # type: ignore[union-attr]

    def done(self) -> None:
        if self.paused or self.queue:
            self.queue.append(b"")
            return
        self._done()

    def fail(self, err: H1Error) -> None:
        if self.paused or self.queue:
            self.queue.append(err)
            return
        self._fail(err)

    # -- internals -------------------------------------------------------------------------------------------------
    def _data(self, body: bytes) -> None:
        if self.stopped:
            return
        assert self.loop is not None and self.sink is not None
        self.since = self.loop.time()
        try:
            payloads = self.split.feed(body)
        except MalformedEvent as e:
            self._broken(f"upstream sent a malformed event ({e})")
            return
        if payloads:
            self.sink.read(payloads)

    def _done(self) -> None:
        if self.stopped:
            return
        assert self.sink is not None
        try:
            payloads = self.split.end()
        except MalformedEvent as e:
            self._broken(f"upstream sent a malformed event ({e})")
            return
        if payloads:
            self.sink.read(payloads)
        if not self.stopped:
            self.stop()
            self.sink.end(None)

    def _fail(self, err: H1Error) -> None:
        if not self.stopped:
            self._broken(f"upstream stream broken: {type(err).__name__}")

    def _broken(self, message: str) -> None:
        self.stop()
        assert self.sink is not None
        self.sink.end(StreamBroken(message))

    def _check(self) -> None:
        self.timer = None
        since = self.since
        if since is None or self.stopped:
            return  # paused (resume sets the timer again) or over
        assert self.loop is not None
        if self.loop.time() - since >= self.idle:
            self._broken(f"no chunk from upstream for {self.idle:.0f} s")
            return
        self.timer = self.loop.call_at(since + self.idle, self._check)
