"""The app's shutdown, step by step, each step bounded: a process that was told to stop must stop.

uvicorn awaits the lifespan's end with no bound, so one step that never returns (a client waiting on a peer that
vanished, a drain waiting on a task that cannot finish) kept a drained instance alive for good: a `--workers 2`
worker was found an hour after SIGTERM, idle in its event loop. Each step now gets `each_s`; one that takes longer
is abandoned and named in a `shutdown_step_timeout` line, one that raises in `shutdown_step_failed`, and the steps
after it still run (in order: what they flush comes after what the earlier ones finished)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence

from gateway.observability.logging import log_event

Step = tuple[str, Callable[[], Awaitable[object] | object]]


async def run_steps(steps: Sequence[Step], each_s: float) -> list[str]:
    """Run `steps` in order; returns the names of those that timed out or failed."""
    bad: list[str] = []
    for name, fn in steps:
        try:
            result = fn()
            if inspect.isawaitable(result):
                await asyncio.wait_for(result, each_s)
        except TimeoutError:
            bad.append(name)
            log_event("shutdown_step_timeout", logging.ERROR, step=name, after_s=each_s)
        except Exception as e:  # noqa: BLE001 - one failed step must not skip the others' flushes
            bad.append(name)
            log_event("shutdown_step_failed", logging.ERROR, step=name, error=type(e).__name__, detail=str(e)[:200])
    return bad
