"""Slowloris and header floods against one `gateway serve` process (a simulated replica behind it), before any key:

    .venv/bin/python -m loadtests.slowloris                       # 1,000 connections, a header line every 2 s
    .venv/bin/python -m loadtests.slowloris --connections 200 --header-read-s 5

Three phases, one table:
1. `--connections` connections each send a request line and then one header line every `--line-every` seconds,
   never finishing the head; the gateway must close each within its `http.header_read_s` (here `--header-read-s`)
   plus a little, answering 408. Meanwhile a normal client sends a request every 0.2 s: all must be served.
2. a 32 MiB header on one connection: 431, connection closed, the process's RSS unchanged.
3. 100 connections each sending 1 MiB of headers at once: 431 each, RSS unchanged.
The RSS is the gateway process's own (procfs), before and after each phase.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.config import hash_key
from loadtests.procs import Proc, rss_mib
from tests.support import free_port

KEY = "sk-slowloris-normal"


def gateway_config(sim_url: str, header_read_s: float) -> dict[str, Any]:
    return {"models": [{"name": "glm-5.2", "pools": ["p"]}],
            "pools": [{"name": "p", "kind": "sglang", "model": "zai-org/GLM-5.2",
                       "replicas": [{"name": "sim-0", "url": sim_url}]}],
            "tenants": [{"name": "normal", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
            "http": {"header_read_s": header_read_s}}


async def slow_client(port: int, every: float, deadline: float) -> tuple[str, float]:
    """One slowloris connection: (how it ended, seconds it stayed open)."""
    t0 = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        return f"connect failed: {type(e).__name__}", 0.0
    got = b""
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        i = 0
        while time.monotonic() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), every)
                if not chunk:
                    break
                got += chunk
                continue
            except TimeoutError:
                pass
            writer.write(b"x-slow-%d: 1\r\n" % i)
            i += 1
            await writer.drain()
        else:
            return "still open", time.monotonic() - t0
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
    status = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.1 ") else "closed without answer"
    return status, time.monotonic() - t0


async def normal_traffic(url: str, stop: asyncio.Event) -> tuple[int, int]:
    ok = sent = 0
    body = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        while not stop.is_set():
            sent += 1
            try:
                r = await c.post(url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
                ok += r.status_code == 200
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    return ok, sent


async def flood(port: int, header_bytes: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * header_bytes + b"\r\n\r\n"
    writer.write(head)
    try:
        await asyncio.wait_for(writer.drain(), 30)
    except (ConnectionError, OSError, TimeoutError):
        pass  # the gateway answered and stopped reading
    got = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), 30)
            if not chunk:
                break
            got += chunk
    except (ConnectionError, OSError, TimeoutError):
        pass
    writer.close()
    return got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.1 ") else "no answer"


async def run(a: argparse.Namespace, gw: Proc, port: int) -> list[tuple[str, str]]:
    rows = []
    url = f"http://127.0.0.1:{port}"
    rss0 = rss_mib(gw.pid)
    stop = asyncio.Event()
    normal = asyncio.create_task(normal_traffic(url, stop))
    deadline = time.monotonic() + a.header_read_s * 3 + 10
    ends = await asyncio.gather(*(slow_client(port, a.line_every, deadline) for _ in range(a.connections)))
    stop.set()
    ok, sent = await normal
    by = {}
    for how, _ in ends:
        by[how] = by.get(how, 0) + 1
    held = sorted(t for _, t in ends)
    rows.append((f"{a.connections} slowloris connections (a header line every {a.line_every:g} s)",
                 f"{', '.join(f'{k}: {v}' for k, v in sorted(by.items()))}; open for {held[0]:.1f}-{held[-1]:.1f} s "
                 f"(header_read_s {a.header_read_s:g}); normal requests meanwhile {ok}/{sent} served; "
                 f"RSS {rss0:.0f} -> {rss_mib(gw.pid):.0f} MiB"))
    rss1 = rss_mib(gw.pid)
    status = await flood(port, 32 * 1024 * 1024)
    rows.append(("one 32 MiB header", f"{status}; RSS {rss1:.0f} -> {rss_mib(gw.pid):.0f} MiB"))
    rss2 = rss_mib(gw.pid)
    statuses = await asyncio.gather(*(flood(port, 1024 * 1024) for _ in range(100)))
    counts = {s: statuses.count(s) for s in set(statuses)}
    rows.append(("100 connections x 1 MiB of headers at once",
                 f"{', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))}; RSS {rss2:.0f} -> {rss_mib(gw.pid):.0f} MiB"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--line-every", type=float, default=2.0, help="seconds between a connection's header lines")
    p.add_argument("--header-read-s", type=float, default=10.0, help="the gateway's http.header_read_s")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gw-slowloris-"))
    sim_port, port = free_port(), free_port()
    sim = Proc("sim", [sys.executable, "-m", "gateway.cli", "sim", "--port", str(sim_port), "--time-scale", "20"],
               f"http://127.0.0.1:{sim_port}/ping", log=work / "sim.log")
    gw = None
    try:
        sim.wait_ready(60)
        cfg = work / "gateway.yaml"
        cfg.write_text(yaml.safe_dump(gateway_config(f"http://127.0.0.1:{sim_port}", a.header_read_s)))
        gw = Proc("gateway", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(port)],
                  f"http://127.0.0.1:{port}/readyz", log=work / "gateway.log")
        gw.wait_ready(60)
        rows = asyncio.run(run(a, gw, port))
    finally:
        if gw is not None:
            gw.stop()
        sim.stop()
    width = max(len(r[0]) for r in rows)
    for what, result in rows:
        print(f"{what.ljust(width)} | {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
