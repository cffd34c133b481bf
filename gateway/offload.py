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
`offload.switch_interval_ms` while it has work, and restores the interpreter's own when it is idle.

A thread still shares the GIL and the gateway's CPU with the event loop, and a C call that holds the GIL holds the
loop for its whole length, whatever thread makes it (orjson's parse of 8 MB: ~30 ms). So `CpuPool.front` runs a
large body's whole front half in a worker process (`offload.processes`, spawned on first use; niced by
`offload.process_niceness`, so where cores are short the event loop runs first): `job(parse_json(raw), *args)`, a
module-level function of the body and plain data — the chat path's `pipeline/front.py prepare` (validate, render,
count, hash), after the API's translation for Responses and Messages (`api/*/front.py`) — the same function a small
body runs inline. The worker sends the typed result back in slices the event loop loads one at a time
(pipeline/json_body.py). A worker that died is replaced; the body it held is worked on a thread. The other GIL holder
is the cyclic garbage collector: a full collection walks every tracked object with the GIL held, so `gateway serve`
freezes the heap it starts with (serve.freeze_heap).

The pool is bounded: at most `offload.max_queued` large-body steps (a front half is one) run or wait at once; one
more is refused at once with a 503 (`NoCapacity`, Retry-After; counted with reason `no_capacity`) rather than queued
behind minutes of work. A step whose request was cancelled
(the client left) still runs to its end in its thread, and still counts until it has.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, ParamSpec, TypeVar, cast

from gateway.config import Offload
from gateway.errors import NoCapacity
from gateway.pipeline.json_body import MAX_JSON_DEPTH, as_is, run_front, run_front_sliced

P = ParamSpec("P")
T = TypeVar("T")

RETRY_AFTER_S = 1.0


class CpuPool:
    def __init__(self, cfg: Offload, metrics: Any = None) -> None:
        """`metrics`: GatewayMetrics (its offload_steps counter and offload_queued gauge), or None."""
        self.cfg = cfg
        self._pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="gateway-cpu")
        self._procs: ProcessPoolExecutor | None = None  # offload.processes workers, spawned on the first large parse
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
        self._admit()
        # in the caller's context: steps read request-scoped context variables (the agent session, the API label)
        return await self._wait(self._pool.submit(contextvars.copy_context().run, functools.partial(fn, *args, **kwargs)))

    async def parse(self, raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
        """`parse_json(raw, max_depth)`, as `front` runs it (a large body in a worker process). 503 when full."""
        body: dict[str, Any] = await self.front(raw, max_depth, as_is)
        return body

    async def front(self, raw: bytes, max_depth: int, job: Callable[..., T], *args: Any, size: int = 0) -> T:
        """A request's front half, `job(parse_json(raw, max_depth), *args)` (`run_front`): inline when the body is
        small; a large body's whole in a worker process, its result rebuilt here a slice at a time with the event
        loop free in between (on a thread when `offload.processes` is 0, or the worker died). `job` is a module-level
        function and `args` plain data (they are pickled to the worker). `size`: the bytes the job works on when more
        than the body's (a small Responses body continuing a large stored turn). 503 when full; the job's own errors
        (a 400 for the JSON) are raised as inline."""
        size = max(size, len(raw))
        if size < self.cfg.min_body_bytes:
            return cast(T, run_front(raw, max_depth, job, args))
        if not self.cfg.processes:
            return cast(T, await self.run(size, run_front, raw, max_depth, job, args))
        self._admit()
        try:
            future = self._processes().submit(run_front_sliced, raw, max_depth, job, args, size)
        except (BrokenProcessPool, RuntimeError):  # found broken since the last body (a new one next time), or closed
            self._drop_processes()
            self._done()
            return cast(T, await self.run(size, run_front, raw, max_depth, job, args))
        try:
            sliced = await self._wait(future)
        except BrokenProcessPool:  # the worker died (killed, out of memory) while working on this body
            self._drop_processes()
            return cast(T, await self.run(size, run_front, raw, max_depth, job, args))
        rebuilt = sliced.rebuilding()
        value = next(rebuilt)  # its head: the long lists still empty
        for _ in rebuilt:  # each step adds one slice to `value`
            await asyncio.sleep(0)  # whatever else is ready runs between two slices
        return cast(T, value)

    def _processes(self) -> ProcessPoolExecutor:
        if self._procs is None:
            # spawned, not forked: a fork of a process running threads and an event loop is not safe
            self._procs = ProcessPoolExecutor(self.cfg.processes, mp_context=multiprocessing.get_context("spawn"),
                                              initializer=os.nice, initargs=(self.cfg.process_niceness,))
        return self._procs

    def _drop_processes(self) -> None:
        if self._procs is not None:
            self._procs.shutdown(wait=False, cancel_futures=True)
            self._procs = None

    def _admit(self) -> None:
        if self.queued >= self.cfg.max_queued:
            if self._refused is not None:
                self._refused.inc()
            raise NoCapacity("The gateway is busy processing other large requests; retry shortly.",
                             retry_after=RETRY_AFTER_S)
        if self.queued == 0:
            self._idle_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.cfg.switch_interval_ms / 1000)
        self.queued += 1
        if self._offloaded is not None:
            self._offloaded.inc()

    async def _wait(self, future: Future[T]) -> T:
        loop = asyncio.get_running_loop()
        # counted until the step is done, not until the caller stops waiting (a cancelled caller's step runs on)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return await asyncio.wrap_future(future, loop=loop)

    def _done(self) -> None:
        self.queued -= 1
        if self.queued == 0:
            sys.setswitchinterval(self._idle_interval)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._drop_processes()
