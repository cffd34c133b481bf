"""CPU-heavy steps of large requests, off the event loop.

Parsing, translating, validating, counting, prefix-hashing and tokenizing a body are synchronous work proportional
to its size: for a 16-token chat body they cost microseconds, for an 8 MB Responses history tens to hundreds of
milliseconds, during which an event loop serves nobody else (`/healthz` included). `CpuPool.run` runs a step inline
when the body is small (a hop to a thread costs more than the step) and on a small thread pool when it is at least
`offload.min_body_bytes`. Python threads share the GIL, but the interpreter hands it back to the event loop every
switch interval (5 ms), so a large body delays other requests by a few milliseconds at a time instead of holding
them for its whole processing.

While a step runs, the event loop thread gives the GIL up at every socket call and then waits up to the switch
interval to get it back, so serving one small request costs several intervals; the pool shortens the interval to
`offload.switch_interval_ms` while it has work, and restores the interpreter's own when it is idle. A C call that
holds the GIL (orjson parsing 8 MB: ~30 ms) still holds the loop for its whole length.

The pool is bounded: at most `offload.max_queued` large-body steps run or wait at once; one more is refused at once
with a 503 (`NoCapacity`, Retry-After) rather than queued behind minutes of work. A step whose request was cancelled
(the client left) still runs to its end in its thread, and still counts until it has.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from gateway.config import Offload
from gateway.errors import NoCapacity

P = ParamSpec("P")
T = TypeVar("T")

RETRY_AFTER_S = 1.0


class CpuPool:
    def __init__(self, cfg: Offload, metrics: Any = None) -> None:
        """`metrics`: GatewayMetrics (its offload_steps counter and offload_queued gauge), or None."""
        self.cfg = cfg
        self._pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="gateway-cpu")
        self.queued = 0  # large-body steps submitted and not yet finished (touched on the event loop only)
        self._idle_interval = sys.getswitchinterval()
        self._offloaded = self._refused = None
        if metrics is not None:
            self._offloaded = metrics.offload_steps.labels("offloaded")
            self._refused = metrics.offload_steps.labels("refused")
            metrics.offload_queued.set_function(lambda: self.queued)

    def large(self, size: int) -> bool:
        return size >= self.cfg.min_body_bytes

    async def run(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` for a body of `size` bytes: inline when small, else on the pool (503 when full)."""
        if size < self.cfg.min_body_bytes:
            return fn(*args, **kwargs)
        if self.queued >= self.cfg.max_queued:
            if self._refused is not None:
                self._refused.inc()
            raise NoCapacity("The gateway is busy processing other large requests; retry shortly.",
                             retry_after=RETRY_AFTER_S)
        loop = asyncio.get_running_loop()
        if self.queued == 0:
            self._idle_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.cfg.switch_interval_ms / 1000)
        self.queued += 1
        if self._offloaded is not None:
            self._offloaded.inc()
        # in the caller's context: steps read request-scoped context variables (the agent session, the API label)
        future = self._pool.submit(contextvars.copy_context().run, functools.partial(fn, *args, **kwargs))
        # counted until the thread is done, not until the caller stops waiting (a cancelled caller's step runs on)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return await asyncio.wrap_future(future, loop=loop)

    def _done(self) -> None:
        self.queued -= 1
        if self.queued == 0:
            sys.setswitchinterval(self._idle_interval)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
