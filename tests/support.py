"""Test infrastructure: real servers on loopback (simulated replicas, the gateway) and a private Redis."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from gateway.servers import make_server
from gateway_lab.sim.profiles import for_version, profile
from gateway_lab.sim.replica import Replica
from gateway_lab.sim.server import create_sim_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_base(offsets: tuple[int, ...] = (0, 1, 2, 3, 50, 51, 52, 53)) -> int:
    """A base port with base + every offset free on loopback now: SGLang's KV-event sockets are a base port + the DP
    rank and the replay socket base + 50 (+ rank), and a base from free_port() alone collided with a port in use."""
    for _ in range(200):
        base = free_port()
        if base + max(offsets) > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for o in offsets:
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", base + o))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no free block of ports")


def _listening() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(2048)
    return s


class ServerThread:
    """uvicorn servers for the given ASGI apps, on free loopback ports, in one background event loop."""

    def __init__(self, apps: list[Any], ports: list[int] | None = None) -> None:
        # without given ports, each server gets a socket bound and listening here, which it serves on: a port found
        # free and bound later by uvicorn could be taken in between by another test process (EADDRINUSE seen in CI)
        socks: list[socket.socket | None] = [None] * len(apps) if ports else [_listening() for _ in apps]
        self.ports = ports or [int(s.getsockname()[1]) for s in socks if s is not None]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.servers = [make_server(app, "127.0.0.1", p, timeout_keep_alive=5, sock=sock)
                        for app, p, sock in zip(apps, self.ports, socks)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(asyncio.gather(*(s.serve() for s in self.servers)))

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 10
        while not all(s.started for s in self.servers):
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("servers did not start")
            time.sleep(0.01)
        return self

    def stop_one(self, i: int) -> None:
        """Stop server i (its port then refuses connections)."""
        srv = self.servers[i]
        srv.should_exit = True
        deadline = time.time() + 10
        while srv.started and not getattr(srv, "_stopped", False):
            try:
                with socket.create_connection(("127.0.0.1", self.ports[i]), timeout=0.2):
                    pass
            except OSError:
                return
            if time.time() > deadline:
                raise RuntimeError("server did not stop")
            time.sleep(0.02)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the servers' loop thread (for touching simulator state safely)."""
        async def wrap() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(5)

    def stop(self) -> None:
        for s in self.servers:
            s.should_exit = True
        self.thread.join(15)


def start_sims(n: int = 2, prof: str = "mi355x-glm52-tp4", sglang_version: str = "0.5.23",
               **overrides: Any) -> tuple[ServerThread, list[Replica]]:
    """n simulated servers. Unlike SGLang's defaults, the tests ask for the cache report (the gateway needs it)
    and for an incarnation id in /server_info (restart tests); pass False to get SGLang's behaviour."""
    overrides.setdefault("time_scale", 20.0)
    overrides.setdefault("enable_cache_report", True)
    overrides.setdefault("report_incarnation", True)
    cfg = for_version(profile(prof), sglang_version).with_overrides(**overrides)
    reps = [Replica(cfg.with_overrides(seed=i), name=f"sim-{i}") for i in range(n)]
    st = ServerThread([create_sim_app(r) for r in reps]).start()
    return st, reps


def start_pd_sims(prefill: int = 1, decode: int = 1, prof: str = "mi355x-glm52-tp4",
                  decode_overrides: dict[str, Any] | None = None, **overrides: Any
                  ) -> tuple[ServerThread, list[Replica], list[Replica], list[int]]:
    """A PD deployment in one event loop (the simulator's KV fabric is per process): `prefill` prefill servers
    with their bootstrap servers, then `decode` decode servers. Returns the thread (urls: prefill servers, decode
    servers, then the bootstrap servers), both replica lists and the bootstrap ports."""
    from gateway_lab.sim.pd_bootstrap import create_bootstrap_app

    overrides.setdefault("time_scale", 20.0)
    overrides.setdefault("enable_cache_report", True)
    overrides.setdefault("report_incarnation", True)
    cfg = for_version(profile(prof), "0.5.23").with_overrides(**overrides)
    boots = [free_port() for _ in range(prefill)]
    pre = [Replica(cfg.with_overrides(seed=i, disaggregation_mode="prefill", disaggregation_bootstrap_port=boots[i]),
                   name=f"prefill-{i}") for i in range(prefill)]
    dec = [Replica(cfg.with_overrides(seed=100 + i, disaggregation_mode="decode", **(decode_overrides or {})),
                   name=f"decode-{i}")
           for i in range(decode)]
    apps = [create_sim_app(r) for r in pre + dec] + [create_bootstrap_app(r) for r in pre]
    st = ServerThread(apps, [free_port() for _ in range(prefill + decode)] + boots).start()
    return st, pre, dec, boots


class RedisServer:
    """A private redis-server on a free port (never the machine's shared one), ended by PID. `appendonly`: with an
    AOF (fsync every second, as deployed) in its directory, so a restart on the same directory keeps the data."""

    def __init__(self, password: str | None = None, appendonly: bool = False) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="gw-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.password = password
        self.appendonly = appendonly
        self.start()

    def start(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            # a second process on the same port would exit, and the first would outlive stop() (it leaked one
            # redis-server per suite run until a test called start() on a started server)
            raise RuntimeError("redis-server is already running; kill() it first")
        exe = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--dir", self.dir,
             "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def kill(self, hard: bool = False) -> None:
        """Stop it (by our PID) but keep the port and directory, so start() brings it back — empty, or from its AOF.
        `hard`: SIGKILL, a crash (no shutdown flush: an AOF then holds what was fsynced, up to a second old)."""
        if self.proc.poll() is None:
            self.proc.kill() if hard else self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not up")


def stop_processes(procs: list[subprocess.Popen[Any]], grace_s: float = 20.0) -> None:
    """SIGTERM every process first (they drain together), then wait for each; one that outlives the grace is killed."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()


def start_serves(n: int, argv: Callable[[int, int, int], list[str]], env: Callable[[int], dict[str, str]],
                 attempts: int = 3) -> tuple[list[subprocess.Popen[Any]], list[int], list[int]]:
    """`n` `gateway serve` processes, `argv(i, port, admin_port)`, each on free ports and up (/healthz) before this
    returns (processes, ports, admin ports). free_port() cannot hold a port for another process: one the kernel hands
    to someone else before the server binds it makes `gateway serve` refuse to start (exit 2, the port named). Then
    every process is stopped and all start again on other ports; any other exit fails at once."""
    for attempt in range(attempts):
        ports, admin = [free_port() for _ in range(n)], [free_port() for _ in range(n)]
        procs = [subprocess.Popen(argv(i, ports[i], admin[i]), env=env(i), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL) for i in range(n)]
        try:
            for port, proc in zip(ports, procs):
                wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc)
            return procs, ports, admin
        except RuntimeError:
            exited = [p.returncode for p in procs if p.poll() is not None]  # before this stops the others
            stop_processes(procs)
            if attempt + 1 == attempts or not exited or any(code != 2 for code in exited):
                raise
    raise AssertionError("unreachable")


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `pred` until it holds. For effects the server commits after the client saw its last byte (a stream's
    accounting runs when the response closes), so a test asserts on them without racing the server."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def env_without_proxies() -> dict[str, str]:
    env = dict(os.environ)
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(k, None)
    env["NO_PROXY"] = "127.0.0.1,localhost"
    return env
