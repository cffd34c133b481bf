"""Child processes for benchmarks: start, wait for readiness, read CPU and RSS from procfs, stop by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

TICK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(_children(p))
    return pids


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process and its descendants."""
    total = 0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / TICK


def rss_mib(pid: int) -> float:
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


class Proc:
    def __init__(self, name: str, cmd: list[str], ready_url: str, env: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None, log: Path | None = None, cwd: str | None = None) -> None:
        self.name = name
        self.ready_url = ready_url
        self.headers = headers or {}
        self.log = open(log, "wb") if log else subprocess.DEVNULL
        full_env = {**os.environ, **(env or {})}
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
            full_env.pop(k, None)
        full_env["NO_PROXY"] = "127.0.0.1,localhost"
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                     cwd=cwd)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 120.0) -> float:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.ready_url, headers=self.headers, timeout=2, trust_env=False).status_code == 200:
                    return time.time() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: only what we started
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
