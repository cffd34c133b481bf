"""One subscription: a ZMQ SUB to one engine rank's KV-event publisher, in sequence.

- In order (`seq == last + 1`): applied.
- A gap (`seq > last + 1`, batches this subscriber never got): the missing batches are asked of the replay socket
  (`[b"", start_seq]` over a DEALER, read until the end marker; both reply layouts, with and without the topic
  frame). If they cannot all be had (no replay socket, a timeout, or the buffer no longer reaches back), the rank's
  view is dropped and refilled from the next events: wrong entries are worse than none.
- A reset (`seq < last`, or `seq == 0` after more): the engine restarted (a new incarnation, which real SGLang
  does not otherwise report): the rank's view is dropped.
- A duplicate (`seq == last`): skipped.
- A lost connection (the engine went away) drops the rank's view too: a restarted engine's cache is empty and an
  idle one would never say so. While disconnected, or while a gap is unresolved, the subscription is unhealthy
  and routing falls back to the approximate index for that replica.
The first message after (re)connecting asks the replay socket for everything buffered before it, so an instance
that starts after the engine learns what the engine already holds (as far as the buffer reaches).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.kvevents.wire import END_SEQ, Batch, WireError, decode_batch, seq_of

log = logging.getLogger("gateway.kvevents")

REPLAY_TIMEOUT_S = 1.0


@dataclass
class SubStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0  # batches recovered through the replay socket
    replay_failures: int = 0
    resets: int = 0  # sequence restarts (engine restarts)
    disconnects: int = 0
    bad_payloads: int = 0
    apply_errors: int = 0  # batches whose application raised (logged; the subscription goes on)
    last_seq: int | None = None
    lag_s: float = 0.0  # receive time - the batch's timestamp, last batch
    last_batch_at: float = 0.0  # wall clock
    encoding: str = ""  # arrays (<= 0.5.13) | maps (0.5.23)


class Subscription:
    """`on_batch(batch)` applies events; `on_reset(reason)` drops the rank's view. Both are synchronous."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str | None, topic: str,
                 on_batch: Callable[[Batch], None], on_reset: Callable[[str], None],
                 on_health: Callable[[], None] | None = None) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.on_health = on_health or (lambda: None)
        self.stats = SubStats()
        self.connected = False
        self.resyncing = False
        self._task: asyncio.Task[None] | None = None
        self._sock: zmq.asyncio.Socket | None = None

    @property
    def healthy(self) -> bool:
        return self.connected and not self.resyncing and self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.connected = False

    async def _run(self) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        self._sock = sock
        mon_task = asyncio.get_running_loop().create_task(self._watch(monitor))
        try:
            while True:
                frames = await sock.recv_multipart()
                self._receive(frames)
                if self._pending_gap is not None:
                    await self._resolve_gap()
        finally:
            mon_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await mon_task
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            self.connected = False
            self.on_health()

    _pending_gap: tuple[int, int, list[bytes]] | None = None  # (first missing, seq received, its frames)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            msg = parse_monitor_message(await monitor.recv_multipart())
            if msg["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
                self._first_after_connect = True
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    self.stats.disconnects += 1
                    log.warning("KV events %s: publisher gone; the rank's view is dropped until it is back",
                                self.endpoint)
                    self.on_reset("disconnected")
                self.connected = False
                self.stats.last_seq = None
            self.on_health()

    _first_after_connect = True

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) < 3 or len(frames[1]) != 8:
            self.stats.bad_payloads += 1
            return
        seq = seq_of(frames[1])
        last = self.stats.last_seq
        if self._first_after_connect:
            self._first_after_connect = False
            if seq > 0 and self.replay_endpoint:  # catch up on what the engine published before we listened
                self._gap(0, seq, frames, count=False)
                return
        if last is None or seq == last + 1:
            self._apply(seq, frames[2])
        elif seq == last:
            return  # duplicate
        elif seq < last:
            self.stats.resets += 1
            log.info("KV events %s: sequence restarted (%d after %d): the engine restarted", self.endpoint, seq, last)
            self.on_reset("restart")
            self._apply(seq, frames[2])
        else:
            self._gap(last + 1, seq, frames)

    def _gap(self, first_missing: int, seq: int, frames: list[bytes], count: bool = True) -> None:
        if count:
            self.stats.gaps += 1
        self.resyncing = True
        self._pending_gap = (first_missing, seq, frames)
        self.on_health()

    async def _resolve_gap(self) -> None:
        assert self._pending_gap is not None
        first, seq, frames = self._pending_gap
        self._pending_gap = None
        got = await self._replay(first, seq) if self.replay_endpoint else None
        if first == 0:  # a late joiner: whatever the buffer still holds beats nothing (orphans start new chains)
            for s, payload in got or []:
                self._apply(s, payload)
            self.stats.replays += len(got or [])
        elif got is not None and [s for s, _ in got] == list(range(first, seq)):
            for s, payload in got:
                self._apply(s, payload)
            self.stats.replays += len(got)
        else:
            self.stats.replay_failures += 1
            log.warning("KV events %s: batches %d..%d lost and not replayable: the rank's view is dropped",
                        self.endpoint, first, seq - 1)
            self.on_reset("gap")
        self._apply(seq, frames[2])
        self.resyncing = False
        self.on_health()

    async def _replay(self, start: int, stop: int) -> list[tuple[int, bytes]] | None:
        """Batches [start, stop) from the replay socket, or None when it does not answer in time."""
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await dealer.poll(left * 1000):
                    return None
                frames = await dealer.recv_multipart()
                body = frames[1:] if frames and frames[0] == b"" else frames
                # 0.5.23: [topic, seq, payload]; 0.5.9/0.5.13: [seq, payload]
                seq_frame, payload = (body[1], body[2]) if len(body) >= 3 else (body[0], body[1]) if len(body) == 2 else (b"", b"")
                if len(seq_frame) != 8:
                    continue
                s = seq_of(seq_frame)
                if s == END_SEQ:
                    return out
                if start <= s < stop:
                    out.append((s, payload))
        finally:
            dealer.close(0)

    def _apply(self, seq: int, payload: bytes) -> None:
        st = self.stats
        st.last_seq = seq
        try:
            batch = decode_batch(payload)
        except WireError as e:
            st.bad_payloads += 1
            log.warning("KV events %s: batch %d skipped: %s", self.endpoint, seq, e)
            return
        now = time.time()
        st.batches += 1
        st.events += len(batch.events)
        st.last_batch_at = now
        st.lag_s = max(0.0, now - batch.ts) if batch.ts else 0.0
        if batch.events:
            st.encoding = "maps" if batch.maps else "arrays"
        try:
            self.on_batch(batch)
        except Exception:  # no event an engine can send may end the subscription: counted, logged, skipped
            st.apply_errors += 1
            log.exception("KV events %s: batch %d could not be applied (skipped; the subscription goes on)",
                          self.endpoint, seq)

    def health(self) -> dict[str, object]:
        st = self.stats
        return {"endpoint": self.endpoint, "healthy": self.healthy, "connected": self.connected,
                "resyncing": self.resyncing, "last_seq": st.last_seq, "batches": st.batches, "gaps": st.gaps,
                "replayed": st.replays, "replay_failures": st.replay_failures, "resets": st.resets, "apply_errors": st.apply_errors,
                "disconnects": st.disconnects, "lag_s": round(st.lag_s, 4), "encoding": st.encoding or None}
