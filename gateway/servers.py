"""Run several uvicorn servers in one process and one event loop (simulated replicas, the demo)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Generator
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # signals are handled once for all servers by `serve_all`


def make_server(app: Any, host: str, port: int, **kw: Any) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        log_level=kw.pop("log_level", "warning"),
        access_log=False,
        lifespan="on",
        **kw,
    )
    return _Server(config)


async def serve_all(servers: list[uvicorn.Server], on_started: Any = None, on_signal: Any = None) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully (in-flight requests finish).

    `on_signal` replaces the default "stop every server"; whatever it stops first, the others are stopped once the
    first server (the primary: the gateway in the demo) has finished draining."""
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal or stop_all)
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.02)
    if on_started is not None and all(s.started for s in servers):
        on_started()
    await tasks[0]
    stop_all()
    await asyncio.gather(*tasks[1:])
