"""A named background loop with start/stop, shared by the health checker, engine poller, load heartbeat and the
simulator's ranks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundTask:
    def __init__(self, run: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        self._run = run
        self._name = name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        """Cancel and wait for it to end (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
