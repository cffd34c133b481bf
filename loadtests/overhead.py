"""Gateway overhead, side by side in one run: direct to the simulator, through this gateway, through the LiteLLM
proxy and through the SGLang router (round-robin; none of them does prefix work here, so this is pure proxying).

    .venv/bin/python -m loadtests.overhead [--rounds 3] [--seconds 4] [--concurrency 4]
    .venv/bin/python -m loadtests.overhead --workers 1,2 --client raw --peers ''   # gateway serve --workers N
    .venv/bin/python -m loadtests.overhead --peers '' --baseline /tmp/a --baseline-label a --baseline /tmp/b ...

The upstream is `loadtests/stub_upstream.py` (2 ports): it answers instantly and streams chunks as fast as the
connection takes them, so what is measured is proxy cost (the simulator's own scheduling would dominate). Every
target proxies to the same two stub ports.
Targets are measured in interleaved rounds (same background noise); figures are medians over rounds.
- added latency p50/p99: closed loop, non-streaming chat, fixed concurrency, minus direct's
- CPU ms per request: the target process tree's utime+stime (procfs) / requests it served
- max req/s per process: closed loop at concurrency 64 (`--client raw`: a lean client, loadtests/raw_client.py, so
  the client's own CPU, not the target, does not set the ceiling)
- `--workers 1,2`: this gateway once per worker count (`gateway serve --workers N`, state in a private Redis the run
  starts, as N > 1 requires; the 1-worker target uses it too, so the two differ only in processes)
- idle RSS: after start-up and a short warm-up
- SSE chunks/s: 16 concurrent streams of 5,000 chunks each, chunks received per second; CPU us/SSE chunk: the
  target's CPU over those streams / chunks received (a streamed answer's per-event relay cost)
Peers are installed into loadtests/.venvs on first use (see loadtests/peers.py).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import socket
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
from loadtests import raw_client
from loadtests.peers import ensure
from loadtests.procs import Proc, cpu_seconds, rss_mib
from loadtests.report import save_json, table

KEY = "sk-bench"
BODY = {"model": "glm-5.2", "messages": [{"role": "user", "content": "Say something short about routers. " * 6}],
        "max_tokens": 16, "ignore_eos": True}


class Target:
    def __init__(self, name: str, base_urls: list[str], proc: Proc | None, headers: dict[str, str]) -> None:
        self.name = name
        self.base_urls = base_urls
        self.proc = proc
        self.headers = {"content-type": "application/json", **headers}
        self.rounds: list[dict[str, float]] = []
        self.idle_rss = float("nan")


async def closed_loop(t: Target, concurrency: int, seconds: float, body: dict[str, Any],
                      lean: bool = False) -> tuple[list[float], int, float]:
    lat: list[float] = []
    errors = 0
    raw = orjson.dumps(body)
    if lean:
        cpu0 = cpu_seconds(t.proc.pid) if t.proc else 0.0
        lat, errors = await raw_client.closed_loop(t.base_urls, raw, t.headers, concurrency, seconds)
        return lat, errors, (cpu_seconds(t.proc.pid) - cpu0) if t.proc else float("nan")
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as c:
        stop = time.perf_counter() + seconds
        cpu0 = cpu_seconds(t.proc.pid) if t.proc else 0.0

        async def worker(i: int) -> None:
            nonlocal errors
            k = i
            while time.perf_counter() < stop:
                url = t.base_urls[k % len(t.base_urls)] + "/v1/chat/completions"
                k += 1
                s = time.perf_counter()
                try:
                    r = await c.post(url, content=raw, headers=t.headers)
                    if r.status_code == 200:
                        lat.append(time.perf_counter() - s)
                    else:
                        errors += 1
                except httpx.HTTPError:
                    errors += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        cpu = (cpu_seconds(t.proc.pid) - cpu0) if t.proc else float("nan")
    return lat, errors, cpu


async def sse_rate(t: Target, streams: int, tokens: int) -> tuple[float, float]:
    """Chunks received per second, and the target's CPU microseconds per chunk meanwhile (nan without a process)."""
    body = {**BODY, "max_tokens": tokens, "stream": True}
    raw = orjson.dumps(body)
    count = 0
    cpu0 = cpu_seconds(t.proc.pid) if t.proc else 0.0
    async with httpx.AsyncClient(timeout=120, trust_env=False) as c:
        async def one(i: int) -> None:
            nonlocal count
            url = t.base_urls[i % len(t.base_urls)] + "/v1/chat/completions"
            async with c.stream("POST", url, content=raw, headers=t.headers) as r:
                async for chunk in r.aiter_raw():
                    count += chunk.count(b"data: ")

        s = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(streams)))
        rate = count / (time.perf_counter() - s)
    cpu_us = (cpu_seconds(t.proc.pid) - cpu0) * 1e6 / count if t.proc and count else float("nan")
    return rate, cpu_us


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def gateway_proc(a: argparse.Namespace, work: Path, cfg: dict[str, Any], name: str, port: int, admin_port: int,
                 workers: int = 1) -> Proc:
    (work / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    return Proc(name, [sys.executable, "-m", "gateway.cli", "serve", "--config", str(work / f"{name}.yaml"), "--port",
                       str(port), "--admin-port", str(admin_port), "--workers", str(workers)],
                f"http://127.0.0.1:{port}/healthz", log=work / f"{name}.log")


def _has_admin_port(checkout: Path) -> bool:
    return any("--admin-port" in f.read_text() for f in (checkout / "gateway").rglob("*.py"))


def start_targets(a: argparse.Namespace, sim_urls: list[str], work: Path) -> list[Target]:
    targets = [Target("direct (stub upstream)", sim_urls, None, {})]
    gw_cfg = {"models": [{"name": "glm-5.2", "pools": ["sim"]}],
              "pools": [{"name": "sim", "kind": "sglang", "model": "zai-org/GLM-5.2",
                         "replicas": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(sim_urls)]}],
              "tenants": [{"name": "bench", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
              "observability": {"log_requests": False}}
    (work / "gw.yaml").write_text(yaml.safe_dump(gw_cfg))
    auth = {"authorization": f"Bearer {KEY}"}
    # ports: gateway +0 (admin +5), LiteLLM +1, SGLang router +2 (+3), first baseline +4 (admin +6), workers +10..
    # (admin +20..), further baselines +42.. (admin +43..), floors +50, +51
    for k, n in enumerate(a.workers):
        port = a.port + 10 + k
        cfg = {**gw_cfg, "routing": {"redis_url": a.redis_url, "redis_prefix": f"ov{n}:"}}
        gw = gateway_proc(a, work, cfg, f"gateway-{n}w", port, a.port + 20 + k, workers=n)
        targets.append(Target(f"this gateway, {n} worker{'s' if n > 1 else ''}", [f"http://127.0.0.1:{port}"], gw, auth))
    if not a.workers:
        gw = gateway_proc(a, work, gw_cfg, "gateway", a.port, a.port + 5)  # port + 1 is LiteLLM's
        targets.append(Target("this gateway", [f"http://127.0.0.1:{a.port}"], gw, auth))
    labels = a.baseline_label or []
    for k, checkout in enumerate(a.baseline or []):  # the gateway of another checkout (`git worktree add /tmp/base
        # <rev>`), same config, same run; a revision from before the admin listener has no --admin-port
        port, admin_port = (a.port + 4, a.port + 6) if k == 0 else (a.port + 40 + 2 * k, a.port + 41 + 2 * k)
        admin = ["--admin-port", str(admin_port)] if _has_admin_port(Path(checkout)) else []
        base = Proc(f"gateway-baseline-{k}", [sys.executable, "-m", "gateway.cli", "serve", "--config",
                                              str(work / "gw.yaml"), "--port", str(port), *admin],
                    f"http://127.0.0.1:{port}/healthz", log=work / f"gateway-baseline-{k}.log", cwd=checkout)
        label = labels[k] if k < len(labels) else f"baseline {k + 1}"
        targets.append(Target(f"gateway @ {label}", [f"http://127.0.0.1:{port}"], base,
                              {"authorization": f"Bearer {KEY}"}))

    if a.floors:  # the same server stack with (almost) nothing on top: loadtests/floor_server.py
        ups = [x for u in sim_urls for x in ("--upstream", u)]
        for k, (mode, name) in enumerate((("answer", "floor: uvicorn alone (canned answer)"),
                                          ("relay", "floor: uvicorn + h1 relay, no pipeline"))):
            port = a.port + 50 + k
            fp = Proc(f"floor-{mode}", [sys.executable, "-m", "loadtests.floor_server", "--mode", mode, "--port",
                                        str(port), *ups], f"http://127.0.0.1:{port}/healthz", log=work / f"floor-{mode}.log")
            targets.append(Target(name, [f"http://127.0.0.1:{port}"], fp, {}))
    if "litellm" in a.peers and (bin_ := ensure("litellm")):
        model_list = [{"model_name": "glm-5.2", "litellm_params": {"model": "hosted_vllm/zai-org/GLM-5.2", "api_base": u + "/v1",
                                                                   "api_key": "sk-none"}, "model_info": {"id": f"sim-{i}"}}
                      for i, u in enumerate(sim_urls)]
        cfg = {"model_list": model_list, "router_settings": {"routing_strategy": "simple-shuffle", "num_retries": 0},
               "litellm_settings": {"drop_params": True, "request_timeout": 30}, "general_settings": {"master_key": KEY}}
        (work / "litellm.yaml").write_text(yaml.safe_dump(cfg))
        p = Proc("litellm", [str(bin_ / "litellm"), "--config", str(work / "litellm.yaml"), "--host", "127.0.0.1",
                             "--port", str(a.port + 1)], f"http://127.0.0.1:{a.port + 1}/health/liveliness",
                 env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, log=work / "litellm.log")
        targets.append(Target("LiteLLM proxy 1.106.2", [f"http://127.0.0.1:{a.port + 1}"], p, {"authorization": f"Bearer {KEY}"}))
    if "sglang-router" in a.peers and (bin_ := ensure("sglang-router")):
        p = Proc("sglang-router", [str(bin_ / "python"), "-m", "sglang_router.launch_router", "--worker-urls", *sim_urls,
                                   "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(a.port + 2),
                                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(a.port + 3), "--log-level", "warn"],
                 f"http://127.0.0.1:{a.port + 2}/v1/models", log=work / "sglang-router.log")
        targets.append(Target("SGLang router 0.3.2", [f"http://127.0.0.1:{a.port + 2}"], p, {}))
    return targets


async def main_async(a: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="gw-overhead-"))
    sim = Proc("stub", [sys.executable, "-m", "loadtests.stub_upstream", "--replicas", "2", "--port", str(a.sim_port)],
               f"http://127.0.0.1:{a.sim_port + 1}/health", log=work / "stub.log")
    sim.wait_ready()
    sim_urls = [f"http://127.0.0.1:{a.sim_port + i}" for i in range(2)]
    redis = None
    if a.workers:  # shared state for `--workers`: a private redis-server (never the machine's shared one)
        redis = Proc("redis", ["redis-server", "--port", str(a.port + 30), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(work)], "http://127.0.0.1:1/", log=work / "redis.log")
        a.redis_url = f"redis://127.0.0.1:{a.port + 30}/0"
        wait_port(a.port + 30)
    targets = start_targets(a, sim_urls, work)
    try:
        for t in targets:
            if t.proc:
                t.startup_s = t.proc.wait_ready(180)
        await asyncio.sleep(5 if a.workers else 2)  # (every worker of a --workers target up, not only the first)
        for t in targets:  # the sglang router registers workers in the background
            for _ in range(100):
                try:
                    # warm-up before any measurement: blocking the loop here holds nothing up
                    r = httpx.post(t.base_urls[0] + "/v1/chat/completions",  # noqa: ASYNC210
                                   content=orjson.dumps(BODY), headers=t.headers,
                                   timeout=30, trust_env=False)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.3)
            else:
                raise RuntimeError(f"{t.name} never served a request")
            await closed_loop(t, 2, 1.0, BODY)  # warm-up (lazy imports, pools)
            await asyncio.sleep(1.0)
            if t.proc:
                t.idle_rss = rss_mib(t.proc.pid)
        # one step per target per round, drawn between measurements: nothing runs in this process while one is
        # timed (tqdm draws only on set_description / update; no per-request work)
        tqdm.monitor_interval = 0  # no tqdm monitor thread waking in the measuring client
        with tqdm(total=a.rounds * len(targets), unit="target", file=sys.stderr, leave=False,
                  disable=a.no_progress) as bar:
            for r in range(a.rounds):
                for t in targets:
                    bar.set_description(f"round {r + 1}/{a.rounds}: {t.name}")
                    lat, err, cpu = await closed_loop(t, a.concurrency, a.seconds, BODY)
                    tput_lat, tput_err, tput_cpu = await closed_loop(t, 64, a.seconds, BODY, lean=a.client == "raw")
                    chunks, chunk_cpu = await sse_rate(t, 16, 5_000)
                    t.rounds.append({"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "n": len(lat),
                                     "errors": err + tput_err, "cpu_ms": cpu * 1000 / max(len(lat), 1),
                                     "max_rps": len(tput_lat) / a.seconds,
                                     "cpu_ms_at_max": tput_cpu * 1000 / max(len(tput_lat), 1), "sse_chunks_s": chunks,
                                     "sse_cpu_us": chunk_cpu})
                    bar.update()
    finally:
        for t in targets:
            if t.proc:
                t.proc.stop()
        sim.stop()
        if redis is not None:
            redis.stop()

    def med(t: Target, k: str) -> float:
        return statistics.median(r[k] for r in t.rounds)

    d50, d99 = med(targets[0], "p50"), med(targets[0], "p99")
    rows = []
    for t in targets:
        rows.append([t.name, f"{med(t, 'p50'):.2f}", f"{med(t, 'p50') - d50:+.2f}", f"{med(t, 'p99') - d99:+.2f}",
                     "-" if t.proc is None else f"{med(t, 'cpu_ms'):.2f}", "-" if t.proc is None else f"{med(t, 'cpu_ms_at_max'):.2f}",
                     f"{med(t, 'max_rps'):.0f}", "-" if t.proc is None else f"{t.idle_rss:.0f}", f"{med(t, 'sse_chunks_s'):.0f}",
                     "-" if t.proc is None or math.isnan(med(t, "sse_cpu_us")) else f"{med(t, 'sse_cpu_us'):.1f}",
                     sum(r["errors"] for r in t.rounds)])
    import os

    print(f"\nOverhead, {a.rounds} interleaved rounds x {a.seconds:.0f} s, concurrency {a.concurrency}, non-streaming chat "
          f"(16 tokens) against an instant stub upstream; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
          f"; max req/s measured with the {a.client} client")
    if a.tokenizer_cost:  # after every server has stopped: measured in this process, nothing else running
        from loadtests.tokenize_cost import measure

        about, steps = measure()
        wanted = ("HF tokenizer, first turn", "HF tokenizer, next turn", "approximate mode", "event consumer")
        for name, ms in steps:
            if name.startswith(wanted):
                rows.append([f"+ {name.split(':')[0].split(' (')[0]} (20k-token chat)", "-", "-", "-", f"{ms:.2f}",
                             "-", "-", "-", "-", "-", "-"])
    print(table(["target", "p50 ms", "added p50 ms", "added p99 ms", "CPU ms/req", "CPU ms/req @64", "max req/s (c=64)",
                 "idle RSS MiB", "SSE chunks/s", "CPU us/SSE chunk", "errors"], rows))
    if a.tokenizer_cost:
        print(f"(+ rows: the per-request steps of routing.mode precise/hybrid, in-process, loadtests/tokenize_cost.py; {about})")
    save_json("overhead", {"args": vars(a), "targets": {t.name: {"rounds": t.rounds, "idle_rss_mib": t.idle_rss} for t in targets}})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--port", type=int, default=18480)
    p.add_argument("--sim-port", type=int, default=18400)
    p.add_argument("--peers", default="litellm,sglang-router", help="comma-separated; '' for none")
    p.add_argument("--baseline", action="append", help="a checkout of an earlier revision: its gateway joins the "
                   "run (repeat for several, each with its --baseline-label in the same order)")
    p.add_argument("--baseline-label", action="append", help="the name of the --baseline of the same position")
    p.add_argument("--floors", action="store_true", help="also the floor under the gateway's figures: uvicorn alone "
                   "and uvicorn + the gateway's HTTP/1.1 client relaying, same server stack (loadtests/floor_server.py)")
    p.add_argument("--tokenizer-cost", action="store_true", help="also the precise mode's per-request tokenizer and "
                   "event costs on a 20k-token chat, as rows under the table (~30 s more: it trains its tokenizer)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    p.add_argument("--workers", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                   help="e.g. 1,2: this gateway once per worker count (`gateway serve --workers N`, state in Redis)")
    p.add_argument("--client", choices=("httpx", "raw"), default="httpx", help="the client of the c=64 max req/s loop "
                   "(raw: loadtests/raw_client.py, lean enough that the target saturates first)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
