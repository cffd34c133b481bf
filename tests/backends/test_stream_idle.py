"""The upstream idle timeout of a relayed stream awaited a read at a time (`HttpBackend._reads`; the pushed path's:
tests/pipeline/test_relay_reads.py): what counts as the upstream's silence.

A stream whose upstream stops sending must end as a broken stream (the relay's error event), whatever else waits on
the same task; time the consumer spends (a slow client, while the relay is suspended between chunks) is never the
upstream's; and a cancellation from elsewhere (a client that left, a shutdown) stays a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.backends.base import StreamBroken
from gateway.backends.openai_compat import HttpBackend, _first_read
from gateway.backends.sse import SseSplitter
from gateway.config import RetryPolicy

IDLE = 0.2


async def _backend() -> HttpBackend:
    return HttpBackend(httpx.AsyncClient(), RetryPolicy(), IDLE)


async def _chunks(gaps: list[float], then_hang: bool = False) -> AsyncIterator[bytes]:
    """An upstream's network reads: one event each after its gap, the first at once (the watchdog starts after the
    first event, which the first-byte timeout bounds)."""
    yield b'data: {"first":1}\n\n'
    for i, gap in enumerate(gaps):
        await asyncio.sleep(gap)
        yield b'data: {"i":%d}\n\n' % i
    if then_hang:
        await asyncio.Event().wait()


async def _payloads(backend: HttpBackend, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The payloads after the first, one by one, as the relay reads them (a list per read)."""
    raw, split = chunks.__aiter__(), SseSplitter()
    assert await _first_read(None, raw, split) == [b'{"first":1}']
    async for payloads in backend._reads(raw, split, []):
        for p in payloads:
            yield p


async def test_an_upstream_silent_for_the_idle_timeout_breaks_the_stream():
    """Two chunks, then nothing: both are relayed, then StreamBroken names the silence."""
    got = []
    with pytest.raises(StreamBroken, match="no chunk from upstream"):
        async for p in _payloads(await _backend(), _chunks([0, 0], then_hang=True)):
            got.append(p)
    assert got == [b'{"i":0}', b'{"i":1}']


async def test_gaps_under_the_idle_timeout_never_break_it_however_long_the_stream():
    """Chunks each well inside the timeout, over many timeouts in all: the single timer is pushed back, never fires
    on a wait shorter than the timeout."""
    gaps = [IDLE / 3] * 15
    got = [p async for p in _payloads(await _backend(), _chunks(gaps))]
    assert len(got) == len(gaps)


async def test_the_consumer_s_own_time_between_chunks_is_not_upstream_silence():
    """The relay suspended at a chunk for longer than the timeout (a slow client's send) while the upstream has the
    next chunk ready: the stream goes on."""
    got = []
    async for p in _payloads(await _backend(), _chunks([0, 0, 0])):
        got.append(p)
        await asyncio.sleep(IDLE * 2.5)
    assert len(got) == 3


async def test_a_cancellation_from_elsewhere_stays_a_cancellation():
    """The consuming task cancelled while it waits for a chunk (the client left): CancelledError, not StreamBroken,
    and no timer left behind to cancel the task later."""
    backend = await _backend()
    reached = asyncio.Event()

    async def consume() -> None:
        async for _ in _payloads(backend, _chunks([0], then_hang=True)):
            reached.set()

    task = asyncio.ensure_future(consume())
    await reached.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
