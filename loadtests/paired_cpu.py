"""Two gateways' CPU per request measured side by side: one request to A, then the same to B, in turn, for the
whole run, so that both see the same machine (a 2-core machine shared with other work moves a gateway's CPU per
request by ±20% from one minute to the next: runs taken minutes apart compare builds less well than this).

    .venv/bin/python -m loadtests.paired_cpu --a /tmp/snap-main --b /tmp/snap-branch --prompt-tokens 13000 --redis \
        --tokens 200 --chunk-interval-ms 2 --seconds 20

Each gateway is `gateway serve` from its checkout (the process's cwd), with request_profile.py's config (two stub
replicas, polls every 300 s, `--redis`: a private redis-server each); both behind one stub upstream. One client
connection per gateway, kept alive; one request in flight in all. The CPU is each process's utime + stime (procfs)
over the loop, per request it served.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from gateway.config import hash_key
from loadtests import raw_client
from loadtests.fleet_http import redis_proc
from loadtests.overhead import KEY
from loadtests.procs import Proc, cpu_seconds
from loadtests.request_profile import request


async def alternate(urls: list[str], raw: list[bytes], seconds: float) -> list[list[float]]:
    """Requests to each URL in turn on one kept-alive connection each, for `seconds`: the latencies per URL."""
    conns = []
    for u in urls:
        p = urlsplit(u)
        conns.append(await asyncio.open_connection(p.hostname, p.port))
    lat: list[list[float]] = [[] for _ in urls]
    stop = time.perf_counter() + seconds
    try:
        while time.perf_counter() < stop:
            for i, (reader, writer) in enumerate(conns):
                s = time.perf_counter()
                writer.write(raw[i])
                head = await reader.readuntil(b"\r\n\r\n")
                if int(head[9:12]) != 200:
                    raise RuntimeError(f"{urls[i]} answered {head[:12]!r}")
                await raw_client.read_body(reader, head)
                lat[i].append(time.perf_counter() - s)
    finally:
        for _, writer in conns:
            writer.close()
    return lat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="checkout A (cwd of its gateway)")
    p.add_argument("--b", required=True, help="checkout B")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--stream", action="store_true", help="the 16-token chat streamed (of --tokens events)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=0, help="the conversation trace's request (request_profile)")
    p.add_argument("--redis", action="store_true", help="a private redis-server per gateway for the prefix index")
    p.add_argument("--chunk-interval-ms", type=float, default=0.0, help="the stub's pause between events")
    p.add_argument("--port", type=int, default=18680, help="A's port; B's is 2 above, the admin ports 1 above each")
    p.add_argument("--sim-port", type=int, default=18670)
    p.add_argument("--redis-port", type=int, default=18690)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gw-paired-"))
    stub = Proc(
        "stub",
        [
            sys.executable,
            "-m",
            "loadtests.stub_upstream",
            "--replicas",
            "2",
            "--port",
            str(a.sim_port),
            "--chunk-interval-ms",
            str(a.chunk_interval_ms),
        ],
        f"http://127.0.0.1:{a.sim_port + 1}/health",
        log=work / "stub.log",
    )
    procs: list[Proc] = [stub]
    try:
        stub.wait_ready()
        urls = [f"http://127.0.0.1:{a.sim_port + i}" for i in range(2)]
        gws = []
        for n, checkout in enumerate((a.a, a.b)):
            port = a.port + 2 * n
            routing: dict[str, object] = {"load_poll_s": 300}
            if a.redis:
                (work / f"r{n}").mkdir()
                procs.append(redis_proc(a.redis_port + n, work / f"r{n}"))
                routing["redis_url"] = f"redis://127.0.0.1:{a.redis_port + n}/0"
            cfg = {
                "models": [{"name": "glm-5.2", "pools": ["sim"]}],
                "pools": [
                    {
                        "name": "sim",
                        "kind": "sglang",
                        "model": "zai-org/GLM-5.2",
                        "replicas": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(urls)],
                    }
                ],
                "tenants": [{"name": "bench", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
                "observability": {"log_requests": False},
                "health": {"interval_s": 300},
                "routing": routing,
            }
            (work / f"gw{n}.yaml").write_text(yaml.safe_dump(cfg))
            time.sleep(0.5 if a.redis else 0)  # redis-server listening before the gateway connects
            gw = Proc(
                f"gateway {'AB'[n]}",
                [
                    sys.executable,
                    "-m",
                    "gateway.cli",
                    "serve",
                    "--config",
                    str(work / f"gw{n}.yaml"),
                    "--port",
                    str(port),
                    "--admin-port",
                    str(port + 1),
                ],
                f"http://127.0.0.1:{port}/healthz",
                log=work / f"gateway{n}.log",
                cwd=checkout,
            )
            procs.append(gw)
            gws.append((gw, f"http://127.0.0.1:{port}"))
        for gw, _ in gws:
            gw.wait_ready(120)
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
        body, path = request(a)
        raws = [raw_client.request_bytes(u + path, body, headers) for _, u in gws]
        asyncio.run(alternate([u for _, u in gws], raws, 3.0))  # warm-up: lazy imports, pooled connections
        cpu0 = [cpu_seconds(gw.pid) for gw, _ in gws]
        lat = asyncio.run(alternate([u for _, u in gws], raws, a.seconds))
        cpu = [cpu_seconds(gw.pid) - c for (gw, _), c in zip(gws, cpu0)]
    finally:
        for pr in reversed(procs):
            pr.stop()
    what = f"{a.prompt_tokens}-token completions prompt" if a.prompt_tokens else "the 16-token chat"
    print(
        f"{what}, {a.tokens if a.prompt_tokens or a.stream else 16} events, {a.chunk_interval_ms} ms apart, "
        f"prefix index {'in Redis' if a.redis else 'in memory'}, {a.seconds:.0f} s, A and B in turn"
    )
    for name, checkout, c, lt in zip("AB", (a.a, a.b), cpu, lat):
        lt.sort()
        print(
            f"{name} {checkout}: {len(lt)} requests, {c * 1000 / max(len(lt), 1):.3f} ms of CPU per request, "
            f"latency p50 {lt[len(lt) // 2] * 1000 if lt else 0:.2f} ms"
        )


if __name__ == "__main__":
    main()
