"""Large bodies against one `gateway serve`: does an 8 MB Responses body or a 5 MB Messages body hold up everything else?

    .venv/bin/python -m loadtests.big_bodies [--seconds 10] [--baseline /tmp/base --baseline-label main]

Per target (this checkout's gateway with large-body offload on, the same with every step inline on the event loop,
`--variant` configs of your own, and optionally the gateway of another checkout, same config, same run), two
phases of `--seconds` each against the stub upstream (loadtests/stub_upstream.py, one chunk every 50 ms):
- quiet: 50 normal streams (chat, 16 tokens, closed loop) and a `/healthz` probe every 20 ms;
- big: the same, while an 8 MB `/v1/responses` body and a 5 MB `/v1/messages` body (many turns, each turn a
  long text) are sent back to back, one of each at a time, by a process of their own (the streams' client measures
  TTFT on an event loop that is not writing megabytes); `--truncation` sends the Responses one with
  `truncation: "auto"`.
Reported: `/healthz` p50/p99/max, the normal streams' TTFT p50/p99 (first content chunk), how many big bodies were
answered and their status codes, and the CPU time the gateway's own process and its child processes (the large-body
worker) used in the phase (procfs; the quiet phase's is the streams' own cost).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import yaml

from gateway.config import hash_key
from loadtests.procs import Proc
from loadtests.report import table

CLK_TCK = os.sysconf("SC_CLK_TCK")

KEY = "sk-bench"
DEFAULT_VARIANTS = ["offload on (default)={}",
                    'all inline (offload.min_body_bytes 1 GiB)={"offload": {"min_body_bytes": 1073741824}}']
STREAM = orjson.dumps({"model": "glm-5.2", "messages": [{"role": "user", "content": "Say something short. " * 8}],
                       "max_tokens": 16, "stream": True})
TURN = "lorem ipsum dolor sit amet, " * 70  # ~2 KB a turn


def responses_body(size: int, truncation: bool) -> bytes:
    turns = size // (len(TURN) + 40)
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": TURN} for i in range(turns)]
    items[-1]["role"] = "user"
    body: dict[str, Any] = {"model": "glm-5.2", "input": items, "max_output_tokens": 16, "store": False}
    if truncation:
        body["truncation"] = "auto"
    return orjson.dumps(body)


def messages_body(size: int) -> bytes:
    turns = size // (len(TURN) + 40)
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": TURN} for i in range(turns | 1)]
    return orjson.dumps({"model": "glm-5.2", "max_tokens": 16, "messages": msgs})


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


async def http(port: int, method: str, path: str, body: bytes = b"", marker: bytes | None = None
               ) -> tuple[int, float | None, float]:
    """One request on its own connection (raw HTTP/1.1, `Connection: close`: the measuring client stays cheap next to
    the server it measures): (status, seconds to the first `marker` in the response or None, seconds to the end)."""
    s = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {KEY}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
    writer.write(head.encode() + body)
    first = None
    buf = b""
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            if first is None and marker is not None:
                buf = buf[-len(marker):] + data
                if marker in buf:
                    first = time.perf_counter() - s
            if not buf:
                buf = data[:16]
            elif len(buf) < 16 and marker is None:
                buf += data[:16]
    finally:
        writer.close()
    status = int(buf[9:12]) if marker is None and buf[:5] == b"HTTP/" else (200 if first is not None else 0)
    return status, first, time.perf_counter() - s


def probe(port: int, seconds: float, out: Any) -> None:
    """`/healthz` every 20 ms, in a process of its own (its latency is not the load generator's)."""
    async def run() -> list[float]:
        lat: list[float] = []
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            try:
                _, _, t = await http(port, "GET", "/healthz")
                lat.append(t)
            except OSError:
                lat.append(float("inf"))
            await asyncio.sleep(0.02)
        return lat
    out.put(asyncio.run(run()))


def send_big(port: int, seconds: float, big: list[tuple[str, bytes]], out: Any) -> None:
    """The big bodies, one of each at a time, in a process of their own: the normal streams' TTFT is measured by a
    client whose own event loop is not busy writing megabytes."""
    statuses: Counter[str] = Counter()
    big_s: list[float] = []

    async def sender(path: str, raw: bytes) -> None:
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            try:
                status, _, t = await http(port, "POST", path, raw)
                statuses[f"{path.rsplit('/', 1)[1]} {status}"] += 1
                big_s.append(t)
            except OSError as e:
                statuses[f"{path.rsplit('/', 1)[1]} {type(e).__name__}"] += 1

    async def run() -> None:
        await asyncio.gather(*(sender(p, b) for p, b in big))

    asyncio.run(run())
    out.put((dict(statuses), big_s))


async def phase(port: int, seconds: float, big: list[tuple[str, bytes]], streams: int,
                big_port: int | None = None) -> dict[str, Any]:
    """`big_port`: where the big bodies go, when not to the gateway the streams and `/healthz` measure."""
    ttft: list[float] = []
    stream_errors = 0
    ctx = multiprocessing.get_context("spawn")
    q, bq = ctx.Queue(), ctx.Queue()
    prober = ctx.Process(target=probe, args=(port, seconds, q))
    senders = ctx.Process(target=send_big, args=(big_port or port, seconds, big, bq)) if big else None
    prober.start()
    if senders is not None:
        senders.start()
    stop = time.perf_counter() + seconds

    async def normal() -> None:
        nonlocal stream_errors
        while time.perf_counter() < stop:
            try:
                _, first, _ = await http(port, "POST", "/v1/chat/completions", STREAM, b'"content":" ')
            except OSError:
                first = None
            if first is None:
                stream_errors += 1
            else:
                ttft.append(first)

    await asyncio.gather(*(normal() for _ in range(streams)))
    health = await asyncio.to_thread(q.get)
    prober.join()
    statuses: Counter[str] = Counter()
    big_s: list[float] = []
    if senders is not None:
        got, big_s = await asyncio.to_thread(bq.get)
        statuses.update(got)
        senders.join()
    return {"health": health, "ttft": ttft, "stream_errors": stream_errors, "statuses": statuses, "big_s": big_s}


def cpu_s(pid: int) -> tuple[float, float]:
    """(CPU seconds of process `pid`, of its live descendants): user + system time from procfs."""
    def own(p: int) -> float:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime

    def children(p: int) -> list[int]:
        out: list[int] = []
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                out += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
        return out + [g for c in out for g in children(c)]

    return own(pid), sum(own(c) for c in children(pid))


def start_gateway(name: str, port: int, stub_urls: list[str], work: Path, cwd: str | None,
                  extra: dict[str, Any] | None = None) -> Proc:
    cfg = {**(extra or {}), "models": [{"name": "glm-5.2", "pools": ["sim"]}],
           "pools": [{"name": "sim", "kind": "sglang", "model": "zai-org/GLM-5.2",
                      "replicas": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(stub_urls)]}],
           "tenants": [{"name": "bench", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
           "observability": {"log_requests": False}}
    (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return Proc(name, [sys.executable, "-m", "gateway.cli", "serve", "--config", str(work / f"{name}.yaml"),
                       "--port", str(port)], f"http://127.0.0.1:{port}/healthz", log=work / f"{name}.log", cwd=cwd)


async def main_async(a: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="gw-bigbodies-"))
    stub = Proc("stub", [sys.executable, "-m", "loadtests.stub_upstream", "--replicas", "2", "--port", str(a.stub_port),
                         "--chunk-interval-ms", "50"], f"http://127.0.0.1:{a.stub_port + 1}/health", log=work / "stub.log")
    stub.wait_ready()
    stub_urls = [f"http://127.0.0.1:{a.stub_port + i}" for i in range(2)]
    targets: list[tuple[str, Proc, int, int | None]] = []
    other: Proc | None = None
    for i, variant in enumerate(a.variant or DEFAULT_VARIANTS):
        label, _, extra = variant.partition("=")
        port = a.port + 2 * i  # each gateway's admin listener takes the port after its own
        targets.append((label, start_gateway(f"gateway-{i}", port, stub_urls, work, None,
                                             orjson.loads(extra or "{}")), port, None))
    if a.baseline:
        targets.append((f"gateway @ {a.baseline_label}",
                        start_gateway("baseline", a.port + 20, stub_urls, work, a.baseline), a.port + 20, None))
    if a.control:  # the machine's own share: the big bodies to a second gateway, the streams to this one
        other = start_gateway("control-other", a.port + 32, stub_urls, work, None)
        targets.append(("control: big bodies to another gateway", start_gateway("control", a.port + 30, stub_urls,
                                                                                   work, None), a.port + 30, a.port + 32))
    big = [("/v1/responses", responses_body(int(a.responses_mb * 1_000_000), a.truncation)),
           ("/v1/messages", messages_body(int(a.messages_mb * 1_000_000)))]
    rows = []
    try:
        for _, proc, _, _ in targets:
            proc.wait_ready(120)
        if other is not None:
            other.wait_ready(120)
        for name, proc, port, big_port in targets:
            await phase(port, 1.0, [], 4)  # warm-up
            for label, bodies in (("quiet", []), ("big bodies", big)):
                before = cpu_s(proc.pid)
                r = await phase(port, a.seconds, bodies, a.streams, big_port)
                after = cpu_s(proc.pid)
                rows.append([name, label, f"{pct(r['health'], 0.5):.1f}", f"{pct(r['health'], 0.99):.1f}",
                             f"{max(r['health']) * 1000:.1f}", f"{pct(r['ttft'], 0.5):.1f}", f"{pct(r['ttft'], 0.99):.1f}",
                             len(r["ttft"]), r["stream_errors"],
                             ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())) or "-",
                             f"{pct(r['big_s'], 0.5) / 1000:.2f}" if r["big_s"] else "-",
                             f"{after[0] - before[0]:.2f}", f"{after[1] - before[1]:.2f}"])
    finally:
        for _, proc, _, _ in targets:
            proc.stop()
        if other is not None:
            other.stop()
        stub.stop()
    sizes = ", ".join(f"{p} {len(b) / 1e6:.1f} MB" for p, b in big)
    print(f"\n{a.streams} normal streams (16 chunks, one every 50 ms) + /healthz every 20 ms, {a.seconds:g} s a phase; "
          f"big bodies: {sizes}{' (truncation: auto)' if a.truncation else ''}")
    print(table(["target", "phase", "healthz p50 ms", "healthz p99 ms", "healthz max ms", "TTFT p50 ms", "TTFT p99 ms",
                 "streams", "stream errors", "big bodies answered", "big body s (p50)", "gateway CPU s",
                 "workers' CPU s"], rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=50)
    p.add_argument("--responses-mb", type=float, default=8.0)
    p.add_argument("--messages-mb", type=float, default=5.0)
    p.add_argument("--truncation", action="store_true")
    p.add_argument("--port", type=int, default=18580)
    p.add_argument("--stub-port", type=int, default=18570)
    p.add_argument("--variant", action="append", help="label=JSON merged into the gateway config (repeatable); "
                   "default: offload on, and every step inline")
    p.add_argument("--baseline", default=None, help="a checkout of an earlier revision: its gateway joins the run")
    p.add_argument("--baseline-label", default="baseline")
    p.add_argument("--control", action="store_true", help="one more target: this checkout's gateway measured while "
                   "the big bodies go to a second one (the share of the rise that is the machine's, not the gateway's)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
