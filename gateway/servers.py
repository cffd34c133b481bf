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
from collections.abc import Coroutine, Generator
from typing import Any, ClassVar

import httptools
import orjson
import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config import HttpLimits
from gateway.errors import InvalidRequest

log = logging.getLogger("gateway.errors")


class OpenAIErrorProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, but a request the HTTP parser refuses (a negative or duplicated Content-Length,
    a malformed request line...) gets the OpenAI error shape instead of uvicorn's plain text, so a client SDK can
    read it. Only the gateway's listener uses it: the simulator answers like SGLang (uvicorn's own text).

    It also bounds what a connection may hold before anything authenticates it (`limits`, config `http`), which
    httptools does not (a 400 MB header was buffered whole and answered 200):
    - the request head (request line and headers) is counted as it arrives: past `max_header_bytes`, or past
      `max_headers` fields, a 431 and the connection closed — the rest of what the client sends is read and
      discarded for LINGER_S (so it reads the 431 rather than a reset), never kept;
    - the head must arrive within `header_read_s` of the connection opening (or, on a kept-alive connection, of its
      first byte): otherwise a 408 (or a plain close, when nothing was sent) — slowloris connections do not pile up;
    - at most `max_connections_per_ip` open connections per client address: more are answered 429 and closed.
    Each refusal is counted and logged like any other (`_account`)."""

    limits: ClassVar[HttpLimits] = HttpLimits()  # make_server's subclass carries the configured ones
    per_ip: ClassVar[dict[str, int]] = {}  # open connections per client address, one server's connections

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._in_head = True  # the bytes arriving belong to a request head
        self._head_bytes = 0
        self._tail = b""  # the last bytes of the head so far: its end may straddle two reads
        self._fields = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._ip: str | None = None
        self._refused = False  # answered and closing: what still arrives is discarded

    # -- connection ----------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        cap = self.limits.max_connections_per_ip
        ip = self.client[0] if self.client else None
        if cap is not None and ip is not None:
            if self.per_ip.get(ip, 0) >= cap:
                self._refuse(429, "Too Many Requests", f"Too many open connections from this address (limit {cap}).",
                             "too_many_connections", "connections")
                return
            self.per_ip[ip] = self.per_ip.get(ip, 0) + 1
            self._ip = ip
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        if self._ip is not None:
            left = self.per_ip.get(self._ip, 1) - 1
            if left > 0:
                self.per_ip[self._ip] = left
            else:
                self.per_ip.pop(self._ip, None)
            self._ip = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering after a refusal: read and dropped
        # uvicorn's own data_received does this first: a kept-alive connection's next request stops the keep-alive
        # timer armed by the last response's end, or that timer closes the connection under the request in progress
        self._unset_keepalive_if_required()
        if self._in_head:
            if self._head_timer is None:  # a kept-alive connection's next request: its head's clock starts now
                self._arm_head_timer()
            probe = self._tail + data
            end = _head_end(probe)
            took = len(data) if end < 0 else max(0, end - len(self._tail))
            self._head_bytes += took
            self._tail = probe[-3:]
            if self._head_bytes > self.limits.max_header_bytes:
                self._too_large(f"The request's headers are larger than the {self.limits.max_header_bytes}-byte limit.")
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._fields > self.limits.max_headers:
                self._too_large(f"The request has more than {self.limits.max_headers} header fields.")
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def _unsupported_upgrade_warning(self) -> None:
        """A WebSocket handshake is served as the HTTP request it also is (`ws="none"`): the API answers it (426 on
        /v1/responses, so Codex falls back to HTTP at once). Nothing to warn about, once per client connection."""

    # -- parser callbacks ----------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._fields = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.limits.max_headers:
            raise _TooManyHeaders  # stops the parser; data_received answers 431
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes, self._tail = True, 0, b""  # what follows is the next request's head
        super().on_message_complete()

    # -- refusals ------------------------------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_read_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._refused or not self._in_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is under way (a pipelined head waits for it): not the client's delay
        if self._head_bytes == 0:
            self.transport.close()  # an idle connection that never sent a request: nothing to answer
            return
        self._refuse(408, "Request Timeout", f"The request's headers did not arrive within "
                     f"{self.limits.header_read_s:g} s.", "request_timeout", "header_timeout")

    def _too_large(self, message: str) -> None:
        self._refuse(431, "Request Header Fields Too Large", message, "request_header_fields_too_large",
                     "headers_too_large")

    def _refuse(self, status: int, phrase: str, message: str, code: str, stage: str) -> None:
        """Answer `status` in the OpenAI shape, then close after reading (and dropping) what still arrives."""
        self._refused = True
        self._disarm_head_timer()
        err = InvalidRequest(message, code=code)
        err.status = status
        body = orjson.dumps(err.body())
        head = [b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode())]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n", b"\r\n"]
        self.transport.write(b"".join(head) + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer is complete; the client reads it, then its end
        self.loop.call_later(LINGER_S, self.transport.close)
        self._account(err, stage)

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

    def _account(self, err: InvalidRequest, stage: str = "http") -> None:
        """Count and log the refusal like any other (reason by `stage`: invalid_http, headers_too_large,
        header_timeout, connections), through the app uvicorn was given."""
        try:
            state = getattr(self.config.app, "state", None)
            proxy = getattr(state, "proxy", None) if state is not None else None
            if proxy is None:  # the admin-only port's app: the main app's proxy
                main = getattr(state, "main", None) if state is not None else None
                proxy = getattr(getattr(main, "state", None), "proxy", None)
            if proxy is not None:
                # imported here, so the simulator (which shares this module) never loads the gateway's stack
                from gateway.pipeline.refusal import Edge

                proxy.accounting.rejected(Edge(uuid.uuid4().hex, "unknown", time.monotonic(), stage=stage), err)
        except Exception:  # counting must never break the connection handling it reports on
            log.exception("could not account a refused HTTP request")


LINGER_S = 2.0  # after a refusal, what the client still sends is read and dropped this long before the close


class _TooManyHeaders(Exception):
    pass


def _head_end(buf: bytes) -> int:
    """The index just past the blank line ending a request head in `buf`, or -1."""
    ends = [i + n for i, n in ((buf.find(b"\r\n\r\n"), 4), (buf.find(b"\n\n"), 2)) if i >= 0]
    return min(ends) if ends else -1


def protocol_for(limits: HttpLimits) -> type[OpenAIErrorProtocol]:
    """The gateway's protocol class for one server: its limits, and its own per-address connection counts."""
    return type("GatewayHttpProtocol", (OpenAIErrorProtocol,), {"limits": limits, "per_ip": {}})


class _Server(uvicorn.Server):
    bound: list[socket.socket] | None = None  # a listening socket made by another process (`gateway serve --workers`)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # signals are handled once for all servers by `serve_all`

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super().serve(sockets=sockets or self.bound)


def make_server(app: Any, host: str, port: int, **kw: Any) -> uvicorn.Server:
    """`openai_errors=True`: the gateway's protocol (OpenAI-shaped parser errors and the `http_limits`, default
    HttpLimits()); otherwise uvicorn's own httptools protocol (the simulator). `sock`: serve on this listening socket
    (inherited from `gateway serve --workers`' supervisor) instead of binding host:port."""
    limits = kw.pop("http_limits", None) or HttpLimits()
    sock: socket.socket | None = kw.pop("sock", None)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        **({"http": protocol_for(limits), "ws": "none"} if kw.pop("openai_errors", False) else {"http": "httptools"}),
        log_level=kw.pop("log_level", "warning"),
        access_log=False,
        lifespan="on",
        **kw,
    )
    server = _Server(config)
    if sock is not None:
        server.bound = [sock]
    return server


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


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run `main` to completion on uvloop, as uvicorn's own `run` does for `loop="uvloop"`: its `serve`, which
    `serve_all` awaits, runs on whatever loop it is given, and under `asyncio.run` that is the stdlib loop, whose
    selector, transports and timers are Python (a third of the gateway's function calls per request)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


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
