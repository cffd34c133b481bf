"""`gateway serve --workers N`: N gateway processes behind one port, and the supervisor that runs them.

Why processes: one gateway process is one event loop on one core; a second core needs a second interpreter.

- Sockets: the supervisor binds one listening socket per worker on the same host:port with SO_REUSEPORT, so the
  kernel spreads new connections over the workers' own accept queues (a shared accept queue wakes every worker for
  each connection and tends to feed the least busy one everything). The admin listener (admin API, /metrics) is
  bound once and served by worker 0 alone. Each worker is a fresh interpreter (`gateway serve ... --worker
  i:fd[:admin_fd]`) that inherits its sockets: nothing the supervisor imported or started leaks into it.
- State: the workers are instances, sharing what instances share through Redis (prefix index, load, limits,
  budgets, on-call changes, idempotency, quarantine), so `routing.redis_url` is required: in-memory state cannot be
  shared between processes, and N private copies would multiply every tenant's limits and budgets by N.
- Metrics: PROMETHEUS_MULTIPROC_DIR (a fresh directory, removed at exit) is set for every worker before it imports
  prometheus_client; worker 0's /metrics sums every worker's files (observability/metrics.py).
- Shutdown: SIGTERM or SIGINT to the supervisor is forwarded to every worker, which drains as one instance does
  (`serve.serve_gateway`: /readyz 503, listener closed, in-flight requests finished); the supervisor exits when the
  last worker has. A second signal is forwarded too (the workers then skip the readiness delay). Workers run in
  their own process group (a terminal's Ctrl-C reaches the supervisor only, once) and drain on their own if the
  supervisor disappears.
- A worker that exits while the others serve is started again (new socket, same index); one that exits within
  MIN_UPTIME_S of its start takes the others down (it would fail again: a config the supervisor could not check,
  Redis refusing its password...), and the supervisor exits 1."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from gateway.observability.logging import log_event, mark_worker, setup_logging
from gateway.observability.metrics import MULTIPROC_ENV

MIN_UPTIME_S = 10.0  # a worker that dies sooner after its start is not restarted
POLL_S = 0.1
BACKLOG = 2048


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A listening TCP socket a child process can inherit."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((host, port))
    s.listen(BACKLOG)
    s.set_inheritable(True)
    return s


def parse_worker(spec: str) -> tuple[int, int, int | None]:
    """`i:fd[:admin_fd]` -> (index, fd, admin fd or None)."""
    parts = [int(x) for x in spec.split(":")]
    return parts[0], parts[1], parts[2] if len(parts) > 2 else None


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[bytes]
    started: float


class Supervisor:
    """Starts `n` workers, restarts one that dies, forwards SIGTERM/SIGINT and waits for every worker to end.
    `argv(spec)` is the worker's command line for its `--worker` spec."""

    def __init__(self, n: int, host: str, port: int, admin: socket.socket, argv: Callable[[str], list[str]]) -> None:
        self.n, self.host, self.port, self.admin, self.argv = n, host, port, admin, argv
        self.metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
        self.env = {**os.environ, MULTIPROC_ENV: self.metrics_dir}
        self.workers: list[Worker] = []
        self.stopping = False
        self.exit_code = 0

    def spawn(self, index: int) -> Worker:
        sock = listening_socket(self.host, self.port, reuse_port=True)
        try:
            fds = [sock.fileno()] + ([self.admin.fileno()] if index == 0 else [])
            spec = ":".join(str(x) for x in [index, *fds])
            proc = subprocess.Popen(self.argv(spec), pass_fds=fds, env=self.env, start_new_session=True)
        finally:
            sock.close()  # the worker holds its own copy: the socket closes with the worker
        log_event("worker_started", logging.INFO, index=index, worker_pid=proc.pid)
        return Worker(index, proc, time.monotonic())

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        for w in self.workers:
            if w.proc.poll() is None:
                os.kill(w.proc.pid, signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        try:
            self.workers = [self.spawn(i) for i in range(self.n)]
            while any(w.proc.poll() is None for w in self.workers) or not self.stopping:
                for k, w in enumerate(self.workers):
                    if w.proc.poll() is not None and not self.stopping:
                        self.workers[k] = self.replace(w)
                time.sleep(POLL_S)
        finally:
            self.admin.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        log_event("workers_stopped", logging.INFO, exit_code=self.exit_code)
        return self.exit_code

    def replace(self, w: Worker) -> Worker:
        """A worker ended while the others serve: start it again, or take every worker down if it died young."""
        from prometheus_client import multiprocess

        # its live gauges leave the sums (prometheus_client leaves the function unannotated)
        multiprocess.mark_process_dead(w.proc.pid, self.metrics_dir)  # type: ignore[no-untyped-call]
        code = w.proc.returncode
        if time.monotonic() - w.started < MIN_UPTIME_S:
            log_event("worker_failed", index=w.index, worker_pid=w.proc.pid, exit_code=code,
                      why=f"exited within {MIN_UPTIME_S:g} s of its start; stopping every worker")
            self.exit_code = 1
            self.on_signal(signal.SIGTERM, None)
            return w
        log_event("worker_exited", index=w.index, worker_pid=w.proc.pid, exit_code=code, why="started again")
        return self.spawn(w.index)


def supervise(n: int, host: str, port: int, admin_host: str, admin_port: int, worker_args: list[str],
              redis_url: str | None) -> int:
    """Run `n` workers; 2 on a refusal (no shared state, a port taken) before anything starts."""
    if not redis_url:
        print(f"gateway serve: --workers {n} needs shared state: set routing.redis_url in the config (in-memory "
              "state cannot be shared between processes; each worker would enforce its own copy of every limit and "
              "budget)", file=sys.stderr)
        return 2
    setup_logging()
    mark_worker("supervisor", os.getpid())
    admin = listening_socket(admin_host, admin_port, reuse_port=False)

    def argv(spec: str) -> list[str]:
        return [sys.executable, "-m", "gateway.cli", "serve", *worker_args, "--worker", spec]

    return Supervisor(n, host, port, admin, argv).run()
