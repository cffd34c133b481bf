"""`gateway serve`: a gateway process from a config file, with the shutdown order load balancers expect; with
`--workers N`, N of them behind one port (gateway/workers.py)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from typing import Any

from gateway.app import create_admin_app, create_app
from gateway.config import ConfigError, HttpLimits, load_config
from gateway.observability.logging import log_event, mark_worker
from gateway.servers import make_server, run_loop, serve_all, taken_port_error


async def serve_gateway(app: Any, host: str, port: int, drain_timeout: float, drain_delay: float = 0.0,
                         extra: list[Any] | None = None, on_started: Any = None,
                         http_limits: HttpLimits | None = None, sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then shut down in the order load balancers expect:

    1. `/readyz` answers 503 for `drain_delay` seconds while every request is still served (the balancer notices
       and stops sending; a second signal skips the wait);
    2. the listener closes (uvicorn stops accepting; idle keep-alive connections are closed);
    3. in-flight requests and streams run to completion, up to `drain_timeout` seconds;
    4. streams still running then are cut: each ends with an error event, is logged as cut (reason `shutdown`) and
       billed for what was relayed (`cut_streams`); requests still waiting get CUT_GRACE_S more before uvicorn
       cancels them;
    then the other servers of the process (`extra`: the admin listener, the demo's simulated replicas) stop."""
    server = make_server(app, host, port, timeout_graceful_shutdown=drain_timeout + CUT_GRACE_S,
                         timeout_keep_alive=75, openai_errors=True, http_limits=http_limits, sock=sock)
    loop = asyncio.get_running_loop()
    pending: list[asyncio.TimerHandle] = []

    def stop_now() -> None:
        for h in pending:
            h.cancel()
        if not server.should_exit:  # each step of a shutdown is a line on-call can find (a hang shows where)
            log_event("listener_closing", logging.INFO, connections=len(server.server_state.connections),
                      requests_in_flight=len(server.server_state.tasks), drain_timeout_s=drain_timeout)
        server.should_exit = True
        loop.call_later(drain_timeout, cut_streams, app)

    def on_signal() -> None:
        st = getattr(app.state, "gateway", None)
        if st is None or st.draining or drain_delay <= 0:  # second signal, or no delay asked: stop accepting now
            if st is not None:
                st.draining = True
            stop_now()
            return
        st.draining = True
        log_event("draining", readyz=503, listener_closes_in_s=drain_delay)
        pending.append(loop.call_later(drain_delay, stop_now))

    def started() -> None:
        freeze_heap()
        if on_started is not None:
            on_started()

    await serve_all([server] + (extra or []), on_started=started, on_signal=on_signal)
    log_event("stopped", logging.INFO, connections_left=len(server.server_state.connections))


def freeze_heap() -> None:
    """Everything the process holds once it serves (modules, config, the app, its clients) leaves the collector's
    reach: a full collection then walks only what requests created since, instead of the ~100k objects of the
    imports and the app. Without this, the containers a large body allocates (an 8 MB history: thousands of
    messages) trigger a full collection that holds the GIL for 50-160 ms, and the event loop with it, however
    the body's steps are offloaded (gateway/offload.py). What of the start later becomes cyclic garbage (a
    replaced config) is not reclaimed: at most the start's own heap, once."""
    gc.collect()
    gc.freeze()


CUT_GRACE_S = 5.0  # after the drain timeout: streams cut, their last events and accounting, before the hard stop


def cut_streams(app: Any) -> int:
    """End every stream still in flight with an error event (the drain timeout is over); returns how many."""
    proxy = getattr(app.state, "proxy", None)
    if proxy is None or not len(proxy.live):
        return 0
    n: int = proxy.live.cut_all()
    log_event("streams_cut", count=n, why="drain timeout (each ends with an error event)")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--admin-port", type=int, default=None, help="the admin listener's port (the admin API and "
                   "/metrics); default: the config's admin.port, else --port + 1")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds in-flight requests get after SIGTERM")
    p.add_argument("--drain-delay", type=float, default=None, help="seconds /readyz answers 503 after SIGTERM "
                   "before the listener closes (default: the config's shutdown.readiness_drain_s, 5)")
    p.add_argument("--workers", type=_positive, default=1, help="gateway processes behind the port (one core each; "
                   "more than 1 needs routing.redis_url: docs/gateway.md#workers)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # i:fd[:admin_fd], set by the supervisor


def _positive(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def run(a: argparse.Namespace) -> int:
    return serve(a)


def serve(a: argparse.Namespace) -> int:
    try:
        cfg = load_config(a.config)
        app = create_app(cfg)  # loads the policy directory: an invalid one fails here too
    except ConfigError as e:
        print(f"config error:\n{e}", file=sys.stderr)
        return 2
    admin_port = a.admin_port if a.admin_port is not None else cfg.admin.listen_port(a.port)
    delay = cfg.shutdown.readiness_drain_s if a.drain_delay is None else a.drain_delay
    if a.worker is not None:
        return serve_worker(a, cfg, app, admin_port, delay)
    taken = taken_port_error("gateway serve", a.host, [a.port], "--port") or taken_port_error(
        "gateway serve", cfg.admin.host, [admin_port], "--admin-port (or admin.port in the config; default --port + 1)")
    if taken:
        print(taken, file=sys.stderr)
        return 2
    if a.workers > 1:
        from gateway.workers import supervise

        args = ["--config", a.config, "--host", a.host, "--port", str(a.port), "--admin-port", str(admin_port),
                "--drain-timeout", str(a.drain_timeout), "--drain-delay", str(delay)]
        return supervise(a.workers, a.host, a.port, cfg.admin.host, admin_port, args, cfg.routing.redis_url)
    # the admin listener: the admin API and /metrics, never on the client port (docs/on-call.md)
    extra = [make_server(create_admin_app(app), cfg.admin.host, admin_port, openai_errors=True, http_limits=cfg.http)]

    def started() -> None:
        log_event("listening", logging.INFO, api=f"http://{a.host}:{a.port}",
                  admin=f"http://{cfg.admin.host}:{admin_port}", serves={"api": "/v1/*, /healthz, /readyz",
                                                                         "admin": "/admin/*, /metrics"})

    run_loop(serve_gateway(app, a.host, a.port, a.drain_timeout, delay, extra=extra, on_started=started,
                           http_limits=cfg.http))
    return 0


def serve_worker(a: argparse.Namespace, cfg: Any, app: Any, admin_port: int, delay: float) -> int:
    """One worker of `--workers N`: the client socket (and, for worker 0, the admin socket) inherited from the
    supervisor, which checked the ports; every log line names the worker."""
    from gateway.workers import parse_worker

    index, fd, admin_fd = parse_worker(a.worker)
    mark_worker(index, os.getpid())
    extra = [] if admin_fd is None else [make_server(create_admin_app(app), cfg.admin.host, admin_port, openai_errors=True,
                                                     http_limits=cfg.http, sock=socket.socket(fileno=admin_fd))]

    def started() -> None:
        log_event("listening", logging.INFO, api=f"http://{a.host}:{a.port}",
                  admin=f"http://{cfg.admin.host}:{admin_port}" if extra else None)

    async def main() -> None:
        watch = asyncio.create_task(drain_when_orphaned(os.getppid()))
        try:
            await serve_gateway(app, a.host, a.port, a.drain_timeout, delay, extra=extra, on_started=started,
                                http_limits=cfg.http, sock=socket.socket(fileno=fd))
        finally:
            watch.cancel()

    run_loop(main())
    return 0


async def drain_when_orphaned(parent: int) -> None:
    """A worker whose supervisor is gone (killed without forwarding a signal) drains as if sent SIGTERM, rather than
    serving on unsupervised."""
    while True:  # polled: a parent's exit sends its child nothing it could await
        await asyncio.sleep(1.0)
        if os.getppid() != parent:
            break
    log_event("supervisor_gone", parent_pid=parent, why="draining as on SIGTERM")
    os.kill(os.getpid(), signal.SIGTERM)
