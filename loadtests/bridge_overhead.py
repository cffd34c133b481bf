"""What the Responses and Messages bridges cost per request next to the chat path they sit on.

    .venv/bin/python -m loadtests.bridge_overhead [--rounds 3] [--seconds 3] [--concurrency 4] [--stream-tokens 64]

One gateway process (in-memory state, request log off) in front of `loadtests/stub_upstream.py` (2 ports, instant
answers), so the figure is the gateway's own work. Each API is driven with the same prompt, closed loop at fixed
concurrency, in interleaved rounds (same background noise); CPU ms per request is the gateway process tree's
utime+stime (procfs) over the requests it served; figures are medians over rounds. Rows:
- chat: POST /v1/chat/completions (the plain-ASGI fast path)
- responses: POST /v1/responses, `store: true` (the default: the turn is written to the memory store) and `false`
- messages: POST /v1/messages
and each streaming (`--stream-tokens` one-token chunks re-emitted as the API's own events).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml
from tqdm import tqdm

from gateway.config import hash_key
from loadtests.procs import Proc, cpu_seconds
from loadtests.report import save_json, table

KEY = "sk-bench"
PROMPT = "Say something short about routers. " * 6


def cases(tokens: int, stream_tokens: int) -> dict[str, tuple[str, dict[str, Any]]]:
    msgs = [{"role": "user", "content": PROMPT}]
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for stream in (False, True):
        n = stream_tokens if stream else tokens
        sfx = " (stream)" if stream else ""
        out["chat" + sfx] = ("/v1/chat/completions", {"model": "glm-5.2", "messages": msgs, "max_tokens": n, "stream": stream})
        out["responses, store" + sfx] = ("/v1/responses", {"model": "glm-5.2", "input": PROMPT, "max_output_tokens": n,
                                                           "stream": stream})
        out["responses, no store" + sfx] = ("/v1/responses", {"model": "glm-5.2", "input": PROMPT, "max_output_tokens": n,
                                                              "stream": stream, "store": False})
        out["messages" + sfx] = ("/v1/messages", {"model": "glm-5.2", "messages": msgs, "max_tokens": n, "stream": stream})
    return out


async def closed_loop(base: str, path: str, body: dict[str, Any], concurrency: int, seconds: float,
                      pid: int) -> tuple[int, int, float, list[float]]:
    raw = orjson.dumps(body)
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    ok = errors = 0
    lat: list[float] = []
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as c:
        stop = time.perf_counter() + seconds
        cpu0 = cpu_seconds(pid)

        async def worker() -> None:
            nonlocal ok, errors
            while time.perf_counter() < stop:
                s = time.perf_counter()
                try:
                    async with c.stream("POST", base + path, content=raw, headers=headers) as r:
                        data = b"".join([chunk async for chunk in r.aiter_raw()])
                    # an in-band stream error (chat / Messages / Responses): never counted as served
                    good = r.status_code == 200 and b'data: {"error"' not in data and b"event: error" not in data
                except httpx.HTTPError:
                    good = False
                if good:
                    ok += 1
                    lat.append(time.perf_counter() - s)
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu = cpu_seconds(pid) - cpu0
    return ok, errors, cpu, lat


async def main_async(a: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="gw-bridge-overhead-"))
    stub = Proc("stub", [sys.executable, "-m", "loadtests.stub_upstream", "--replicas", "2", "--port", str(a.sim_port)],
                f"http://127.0.0.1:{a.sim_port + 1}/health", log=work / "stub.log")
    stub.wait_ready()
    cfg = {"models": [{"name": "glm-5.2", "pools": ["stub"]}],
           "pools": [{"name": "stub", "kind": "sglang", "model": "zai-org/GLM-5.2",
                      "replicas": [{"name": f"stub-{i}", "url": f"http://127.0.0.1:{a.sim_port + i}"} for i in range(2)]}],
           "tenants": [{"name": "bench", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
           "observability": {"log_requests": False}, "health": {"enabled": False}}
    (work / "gw.yaml").write_text(yaml.safe_dump(cfg))
    gw = Proc("gateway", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(work / "gw.yaml"), "--port",
                          str(a.port)], f"http://127.0.0.1:{a.port}/healthz", log=work / "gateway.log")
    base = f"http://127.0.0.1:{a.port}"
    todo = cases(a.tokens, a.stream_tokens)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in todo}
    try:
        gw.wait_ready(60)
        for name, (path, body) in todo.items():  # warm-up, and a check that every case is served
            ok, errors, _, _ = await closed_loop(base, path, body, 2, 0.5, gw.pid)
            if not ok or errors:
                raise RuntimeError(f"{name}: {ok} ok, {errors} errors in warm-up (see {work}/gateway.log)")
        # one step per case per round, drawn between measurements, never per request (the client shares the cores
        # with the gateway it measures)
        tqdm.monitor_interval = 0  # no tqdm monitor thread waking in the measuring client
        with tqdm(total=a.rounds * len(todo), unit="case", file=sys.stderr, leave=False, disable=a.no_progress) as bar:
            for r in range(a.rounds):
                for name, (path, body) in todo.items():
                    bar.set_description(f"round {r + 1}/{a.rounds}: {name}")
                    ok, errors, cpu, lat = await closed_loop(base, path, body, a.concurrency, a.seconds, gw.pid)
                    results[name].append({"cpu_ms": cpu * 1000 / max(ok, 1), "rps": ok / a.seconds, "errors": errors,
                                          "p50_ms": statistics.median(lat) * 1000 if lat else float("nan")})
                    bar.update()
    finally:
        gw.stop()
        stub.stop()

    def med(name: str, k: str) -> float:
        return statistics.median(x[k] for x in results[name])

    rows = []
    for name in todo:
        ref = "chat (stream)" if name.endswith("(stream)") else "chat"
        rows.append([name, f"{med(name, 'cpu_ms'):.2f}", f"{med(name, 'cpu_ms') - med(ref, 'cpu_ms'):+.2f}",
                     f"{med(name, 'p50_ms'):.2f}", f"{med(name, 'rps'):.0f}", sum(int(x["errors"]) for x in results[name])])
    print(f"\nBridge overhead, {a.rounds} interleaved rounds x {a.seconds:g} s, concurrency {a.concurrency}, "
          f"{a.tokens}-token answers ({a.stream_tokens} chunks streamed) from an instant stub upstream; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(table(["API", "gateway CPU ms/req", "vs chat", "p50 ms", "req/s", "errors"], rows))
    save_json("bridge_overhead", {"args": vars(a), "results": results})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=18580)
    p.add_argument("--sim-port", type=int, default=18560)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
