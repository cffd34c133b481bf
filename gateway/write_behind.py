"""Writes to a shared store that no request waits for, sent together: one exchange in flight at a time, and what is
staged meanwhile goes in the next.

Why: a request's effects on the routing state (its load, its confirmed prefix entries, its end) were one Redis
exchange each, a task each: ~100 Python calls of the client per command and a round trip apiece, on the event loop
that also decides and relays. Staged here, the effects of every request that reached the same point since the last
exchange go as one pipeline — one at concurrency 1 per point in a request, one for many requests under load — and
nothing on a request's path waits for them. What a store stages must be applied to its own local view at once (the
store's job), so this instance's next decision sees it before the exchange is done.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("gateway.write_behind")


def exchange_bound(call_timeout: float, writes: int) -> float:
    """The time bound of an exchange carrying `writes` writes: one call's bound per four writes, at least one call's,
    at most a second (unless one call's is more). No request waits on it; the bound only notices a Redis that stopped
    answering, and a batch that timed out is replayed, so it must not be one call's bound when it carries fifty."""
    return max(call_timeout, min(call_timeout * writes / 4, 1.0))


class Flusher:
    """Runs `send` soon after `kick`, never two at once. `send` must take everything staged when it starts (before
    its first await), and must handle its store's errors itself: a failed exchange is the store's to repair."""

    def __init__(self, send: Callable[[], Awaitable[None]], name: str) -> None:
        self._send = send
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self._staged = False  # something was staged since the current send began

    def kick(self) -> None:
        """Something was staged: send it once the loop is free (with whatever else is staged by then)."""
        self._staged = True
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def _run(self) -> None:
        try:
            while self._staged:
                self._staged = False
                try:
                    await self._send()
                except Exception:  # a bug, not a store error (those are the store's): logged, the next kick sends
                    log.exception("write-behind send failed (%s)", self._name)
        finally:
            self._task = None

    async def settle(self) -> None:
        """Return once everything staged has been sent (shutdown, tests; under steady writes it waits them out)."""
        while (task := self._task) is not None:
            await asyncio.shield(task)  # a cancelled caller must not cancel the send other writes ride on
