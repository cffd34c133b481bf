"""Run several uvicorn servers in one process and one event loop (simulated replicas, the demo); the gateway's
HTTP protocol (parser errors in the OpenAI shape); free and taken ports for the CLIs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
import uuid
from collections.abc import Generator
from typing import Any

import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import InvalidRequest

log = logging.getLogger("gateway.errors")


class OpenAIErrorProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, but a request the HTTP parser refuses (a negative or duplicated Content-Length,
    a malformed request line...) gets the OpenAI error shape instead of uvicorn's plain text, so a client SDK can
    read it. Only the gateway's listener uses it: the simulator answers like SGLang (uvicorn's own text)."""

    def send_400_response(self, msg: str) -> None:
        err = InvalidRequest(f"{msg} The HTTP request could not be parsed (check Content-Length and the request line).",
                             code="invalid_http_request")
        body = orjson.dumps(err.body())
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"x-should-retry: false\r\n", b"connection: close\r\n", b"\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
        self._account(err)

    def _account(self, err: InvalidRequest) -> None:
        """Count and log the refusal like any other (reason `invalid_http`), through the app uvicorn was given."""
        try:
            state = getattr(self.config.app, "state", None)
            proxy = getattr(state, "proxy", None) if state is not None else None
            if proxy is None:  # the admin-only port's app: the main app's proxy
                main = getattr(state, "main", None) if state is not None else None
                proxy = getattr(getattr(main, "state", None), "proxy", None)
            if proxy is not None:
                # imported here, so the simulator (which shares this module) never loads the gateway's stack
                from gateway.api.openai.accounting import Edge

                proxy.accounting.rejected(Edge(uuid.uuid4().hex, "unknown", time.monotonic(), stage="http"), err)
        except Exception:  # counting must never break the connection handling it reports on
            log.exception("could not account a refused HTTP request")


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
        http=OpenAIErrorProtocol if kw.pop("openai_errors", False) else "httptools",
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


def port_in_use(host: str, port: int) -> bool:
    """Whether binding (host, port) would fail, checked with SO_REUSEADDR as uvicorn binds (so a port in TIME_WAIT
    is not reported as taken)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_ports(host: str, n: int) -> list[int]:
    """n ports the OS has free right now (held together while choosing, so they are distinct)."""
    socks = [socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def taken_port_error(prog: str, host: str, ports: list[int], flag: str) -> str | None:
    """A one-line message naming the first taken port and the flag that chooses another, or None."""
    for p in ports:
        if port_in_use(host, p):
            return f"{prog}: port {p} on {host} is already in use; choose another with {flag}"
    return None
