"""N real engine servers on free loopback ports, started with a recipe's flags, waited on until they serve.

Ready means served, not merely listening: `/v1/models` answers while SGLang's scheduler is still warming up (its
`/health` and `/ping` answer 503 then, and may still a moment after its first completion), so readiness is a
one-token completion that comes back 200 and a `/health` that answers 200. A server that
exits before that fails the start with the tail of its log.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway_lab.engines.envs import EngineEnv
from gateway_lab.engines.recipes import ServerFlags, server_env, sglang_argv, vllm_argv


class StartError(RuntimeError):
    pass


# engines' ports are drawn from here (free_port_pair), below the kernel's ephemeral range
PORT_FLOOR, PORT_CEILING = 20000, 24000


@dataclass
class EngineServer:
    engine: str
    flags: ServerFlags
    proc: subprocess.Popen[bytes]
    log: Path
    started_at: float
    ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.flags.port}"

    @property
    def kv_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.flags.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.flags.replay_port}"

    def describe(self) -> dict[str, object]:
        return {"engine": self.engine, "url": self.url, "pid": self.proc.pid, "kv_events": self.kv_endpoint,
                "replay": self.replay_endpoint, "ready_s": self.ready_s, "log": str(self.log)}

    def log_tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Fleet:
    servers: list[EngineServer] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def stop(self) -> None:
        for s in self.servers:
            stop_server(s)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    with socket.socket() as s:  # the PUB binds the wildcard address
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out on its own (to bind(0) and to every outgoing connection)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_pair(taken: set[int], n: int = 2, below: int = 65536) -> int:
    """A port p with p .. p+n-1 free (the KV-event PUBs and replay ROUTERs: two per DP rank), all below `below`.

    Drawn below the kernel's ephemeral range: an engine binds its ports only when it has loaded (a minute or two on
    this CPU), and until then a port from that range can be taken by any outgoing connection or bind(0) on the
    machine, the test suite's own included."""
    top = min(_ephemeral_floor(), below, PORT_CEILING)
    for _ in range(500):
        p = random.randrange(PORT_FLOOR, top - n) if top - n > PORT_FLOOR else _kernel_port()
        run = set(range(p, p + n))
        if p + n <= below and not run & taken and all(_port_free(q) for q in run):
            return p
    raise StartError(f"no {n} consecutive free ports for KV events")


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> Callable[[], None] | None:
    """A server in a session of its own outlives a test run that is killed (its fixtures never run): two such servers
    held both cores of the machine through a later run. On Linux the kernel sends it SIGTERM when the process that
    launched it dies (PR_SET_PDEATHSIG), and SGLang and vLLM end their workers on SIGTERM. The signal follows the
    launching *thread*, so it is set only when that is the main thread, which lives as long as the process."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG

    return arm


def launch(env: EngineEnv, flags: ServerFlags, core: int, log: Path) -> EngineServer:
    argv = sglang_argv(flags) if env.recipe.engine == "sglang" else vllm_argv(flags)
    proc_env = dict(os.environ)
    for k in ("PYTHONPATH", "VIRTUAL_ENV"):  # the engine sees its own environment only
        proc_env.pop(k, None)
    cores = os.cpu_count() or 1
    ranks = [(core + r) % cores for r in range(flags.dp_size)] if flags.dp_size > 1 else None
    proc_env |= server_env(env.recipe.engine, core, env.stub_dir, ranks)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as f:
        f.write((" ".join([str(env.python), *argv]) + "\n").encode())
        f.flush()
        # a process group of its own: the engine forks schedulers and detokenizers, all ended with it
        proc = subprocess.Popen([str(env.python), *argv], stdout=f, stderr=subprocess.STDOUT, env=proc_env,
                                start_new_session=True, cwd=str(log.parent), preexec_fn=_die_with_parent())
    return EngineServer(env.recipe.engine, flags, proc, log, time.monotonic())


def wait_ready(server: EngineServer, timeout_s: float = 600.0) -> float:
    """Blocks until the server completes a one-token request and reports itself healthy; returns the seconds since
    launch."""
    deadline = server.started_at + timeout_s
    body = {"model": server.flags.served_name, "prompt": "ready", "max_tokens": 1, "temperature": 0}
    with httpx.Client(timeout=30.0) as c:
        while True:
            if server.proc.poll() is not None:
                raise StartError(f"{server.engine} on {server.url} exited ({server.proc.returncode}) before serving; "
                                 f"log {server.log}:\n{server.log_tail()}")
            try:
                if c.get(server.url + "/v1/models").status_code == 200 and \
                        c.post(server.url + "/v1/completions", json=body).status_code == 200 and \
                        c.get(server.url + "/health").status_code == 200:
                    server.ready_s = round(time.monotonic() - server.started_at, 1)
                    return server.ready_s
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                stop_server(server)
                raise StartError(f"{server.engine} on {server.url} not serving after {timeout_s:.0f} s; "
                                 f"log {server.log}:\n{server.log_tail()}")
            time.sleep(0.5)


def start_fleet(env: EngineEnv, model: str, n: int, logs: Path, flags: dict[str, object] | None = None,
                timeout_s: float = 600.0) -> Fleet:
    """N servers, one core each (cycling over the machine's cores), started together and waited on; the page
    size is the recipe's unless `flags` names one."""
    flags = {"page_size": env.recipe.page_size, **(flags or {})}
    fleet = Fleet()
    taken: set[int] = set()
    cores = os.cpu_count() or 1
    try:
        for i in range(n):
            # SGLang 0.5.13 derives a gRPC port as the HTTP port + 10000 and refuses to start when that passes 65535
            port = free_port_pair(taken, below=55536)
            taken |= {port, port + 1}
            dp = int(flags.get("dp_size", 1))  # type: ignore[call-overload]
            kv = free_port_pair(taken, 2 * dp)
            taken |= set(range(kv, kv + 2 * dp))
            sf = ServerFlags(port=port, kv_port=kv, model=model, **flags)  # type: ignore[arg-type]
            fleet.servers.append(launch(env, sf, i % cores, logs / f"{env.recipe.engine}-{i}-{port}.log"))
        for s in fleet.servers:
            wait_ready(s, timeout_s)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def stop_server(server: EngineServer, grace_s: float = 15.0) -> None:
    if server.proc.poll() is not None:
        return
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        server.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(5)
    # children that outlived the leader (a scheduler mid-forward) are in the same group
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def running(env: EngineEnv, model: str, n: int, logs: Path, **kw: object) -> Iterator[Fleet]:
    fleet = start_fleet(env, model, n, logs, **kw)  # type: ignore[arg-type]
    try:
        yield fleet
    finally:
        fleet.stop()


def write_state(fleet: Fleet, path: Path) -> None:
    path.write_text(json.dumps([s.describe() for s in fleet.servers], indent=2) + "\n")
