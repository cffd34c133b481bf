"""Where the gateway's CPU per request goes: cProfile over a `gateway serve` process serving the overhead benchmark's
request, on the process CPU clock, after warm-up.

    .venv/bin/python -m loadtests.request_profile [--seconds 8] [--stream --tokens 100] [--checkout DIR] [--top 12]
    .venv/bin/python -m loadtests.request_profile --prompt-tokens 13000 --tokens 200 --redis   # a conversation-trace request

The gateway runs with overhead.py's config (instant stub upstream, two replicas, one tenant), its background polls
(health checks, the engines' loads) set to 300 s so that only requests are in the profile; a closed loop at
concurrency 1 (loadtests/raw_client.py) sends the 16-token chat (`--stream --tokens N`: a streamed answer of N
events). The profiler is switched on by a signal once the warm-up is done and off before the process stops.
`--checkout DIR`: profile that checkout's gateway (an earlier revision: `git worktree add DIR REV`) instead.
`--prompt-tokens N`: the conversation trace's request instead (fleet_trace.py): a plain-text prompt of N tokens built
from the replay's deterministic blocks (gateway_lab.replay.http), to `/v1/completions`, streamed with usage, `--tokens`
events; `--redis` gives the gateway a private redis-server for its prefix index, as fleet_trace's gateway has.
`--chunk-interval-ms` spaces the stub's events (one event per network read, as an engine decoding sends them).
`--cpu-only`: no profiler; the gateway process's real CPU per request over the same loop (procfs, as fleet_trace).
`--idle-seconds S` (with `--cpu-only`): the idle gateway's CPU over S seconds first, and the per-request figure net of it.
`--concurrency N`: N closed-loop clients instead of one (where the gateway's writes to Redis can batch). With
`--redis` it also prints Redis calls per request by command (the private server's count over the loop).

Prints the function calls per request (a count: the same on a busy machine), the profiled CPU per request (cProfile
inflates it several times over, so compare it only within one machine and one load), the CPU by area, and the
functions with the most own time. `--out FILE` keeps the pstats file.

The profiler's clock is the process CPU time, so a syscall's kernel time lands on the function that made it: with
uvloop the socket writes show in uvicorn's `send` and the HTTP client's `request`, not in a function of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import yaml

from gateway.config import hash_key
from gateway.recording.trace import BLOCK_TOKENS, TraceRecord
from gateway_lab.replay.http import prompt_for
from loadtests import raw_client
from loadtests.fleet_http import redis_proc
from loadtests.overhead import BODY, KEY
from loadtests.procs import Proc, cpu_seconds
from loadtests.report import table

# run in the gateway's process (any checkout's): the profiler on SIGUSR1, off and written on SIGUSR2
CHILD = """
import cProfile, signal, sys, time
out = sys.argv.pop(1)
prof = cProfile.Profile(time.process_time)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
signal.signal(signal.SIGUSR2, lambda *_: (prof.disable(), prof.dump_stats(out)))
from gateway.cli import main
sys.exit(main(sys.argv[1:]))
"""


def area(fn: tuple[str, int, str]) -> str:
    """The part of the process a profiled function belongs to."""
    path = fn[0]
    if path == "~":
        return "C calls (dict, bytes, orjson, builtins)"
    if "/asyncio/" in path or path.endswith(("selectors.py", "_weakrefset.py")):
        return "asyncio (the loop, tasks, timeouts)"
    for name in ("uvicorn", "starlette", "fastapi", "prometheus_client", "httpx", "httpcore", "redis"):
        if f"/{name}/" in path:
            return name
    if "/gateway/" in path:
        rest = path.split("/gateway/", 1)[1]
        return "gateway/" + rest.split("/", 1)[0] if "/" in rest else "gateway/" + rest
    return "other"


def report(stats: pstats.Stats, n: int, top: int) -> str:
    raw = stats.stats  # type: ignore[attr-defined]  # pstats keeps its table untyped
    calls = sum(v[1] for v in raw.values())
    cpu = sum(v[2] for v in raw.values())
    by_area: collections.Counter[str] = collections.Counter()
    area_calls: collections.Counter[str] = collections.Counter()
    for fn, v in raw.items():
        by_area[area(fn)] += v[2]
        area_calls[area(fn)] += v[1]
    out = [f"{n} requests: {calls / n:.0f} function calls per request, {cpu * 1000 / n:.2f} ms profiled CPU per request",
           "", table(["area", "profiled CPU ms/req", "share", "calls/req"],
                     [[k, f"{v * 1000 / n:.2f}", f"{100 * v / cpu:.1f}%", f"{area_calls[k] / n:.0f}"]
                      for k, v in by_area.most_common()]), ""]
    own = sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]
    out.append(table(["function (own time)", "calls/req", "own us/req", "with callees us/req"],
                     [[f"{_short(fn[0])}:{fn[1]}:{fn[2]}"[:90], f"{v[1] / n:.2f}", f"{v[2] * 1e6 / n:.0f}",
                       f"{v[3] * 1e6 / n:.0f}"] for fn, v in own]))
    return "\n".join(out)


def request(a: argparse.Namespace) -> tuple[bytes, str]:
    """The body and path profiled: the overhead benchmark's chat, or the conversation trace's kind of request."""
    if not a.prompt_tokens:
        return orjson.dumps({**BODY, "max_tokens": a.tokens, **({"stream": True} if a.stream else {})}), \
            "/v1/chat/completions"
    blocks = tuple(range(1, a.prompt_tokens // BLOCK_TOKENS + 2))
    prompt = prompt_for(TraceRecord(0.0, a.prompt_tokens, a.tokens, blocks))
    return orjson.dumps({"model": BODY["model"], "prompt": prompt, "max_tokens": a.tokens, "stream": True,
                         "stream_options": {"include_usage": True}, "ignore_eos": True}), "/v1/completions"


def redis_commands(port: int) -> dict[str, int]:
    """Calls per command on the private redis-server (INFO commandstats; a script's own calls are counted under
    theirs, so EVALSHA counts the scripts the gateway ran and HINCRBYFLOAT its load writes)."""
    import redis as sync_redis

    client = sync_redis.Redis(port=port)
    try:
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in client.info("commandstats").items()}
    finally:
        client.close()


def _short(path: str) -> str:
    for cut in ("site-packages/", "/lib/python3.11/"):
        if cut in path:
            return path.split(cut, 1)[1]
    return "gateway/" + path.split("/gateway/", 1)[1] if "/gateway/" in path else path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--stream", action="store_true", help="streamed answers (of --tokens events)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--checkout", default=None, help="profile this checkout's gateway (cwd of its process)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default=None, help="keep the pstats file here")
    p.add_argument("--port", type=int, default=18580)
    p.add_argument("--sim-port", type=int, default=18570)
    p.add_argument("--prompt-tokens", type=int, default=0, help="a plain-text completions prompt of this many tokens, "
                   "streamed with usage (the conversation trace's request); 0: the overhead benchmark's chat")
    p.add_argument("--redis", action="store_true", help="a private redis-server for the prefix index (as fleet_trace)")
    p.add_argument("--redis-port", type=int, default=18590)
    p.add_argument("--concurrency", type=int, default=1, help="closed-loop clients (requests in flight at once)")
    p.add_argument("--chunk-interval-ms", type=float, default=0.0, help="the stub's pause between events")
    p.add_argument("--idle-seconds", type=float, default=0.0, help="with --cpu-only: first the gateway's CPU over this "
                   "long with no request, subtracted from the loop's for the time it ran (its timers and polls)")
    p.add_argument("--cpu-only", action="store_true", help="no profiler: the gateway process's CPU (utime + stime, "
                   "procfs) per request over the same closed loop, as fleet_trace and overhead.py count it")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gw-profile-"))
    out = a.out or str(work / "gateway.prof")
    stub = Proc("stub", [sys.executable, "-m", "loadtests.stub_upstream", "--replicas", "2", "--port", str(a.sim_port),
                         "--chunk-interval-ms", str(a.chunk_interval_ms)],
                f"http://127.0.0.1:{a.sim_port + 1}/health", log=work / "stub.log")
    stub.wait_ready()
    redis = redis_proc(a.redis_port, work) if a.redis else None
    time.sleep(0.5 if redis is not None else 0)  # redis-server listening before the gateway connects
    urls = [f"http://127.0.0.1:{a.sim_port + i}" for i in range(2)]
    cfg = {"models": [{"name": "glm-5.2", "pools": ["sim"]}],
           "pools": [{"name": "sim", "kind": "sglang", "model": "zai-org/GLM-5.2",
                      "replicas": [{"name": f"sim-{i}", "url": u} for i, u in enumerate(urls)]}],
           "tenants": [{"name": "bench", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
           "observability": {"log_requests": False}, "health": {"interval_s": 300},
           "routing": {"load_poll_s": 300, **({"redis_url": f"redis://127.0.0.1:{a.redis_port}/0"} if a.redis else {})}}
    (work / "gw.yaml").write_text(yaml.safe_dump(cfg))
    gw = Proc("gateway", [sys.executable, "-c", CHILD, out, "serve", "--config", str(work / "gw.yaml"), "--port",
                          str(a.port), "--admin-port", str(a.port + 1)],
              f"http://127.0.0.1:{a.port}/healthz", log=work / "gateway.log", cwd=a.checkout)
    try:
        gw.wait_ready(120)
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
        raw, path = request(a)
        for _ in range(50):  # warm-up: lazy imports, pooled connections, metric children
            r = httpx.post(f"http://127.0.0.1:{a.port}{path}", content=raw, headers=headers, trust_env=False, timeout=30)
            r.raise_for_status()
        idle = 0.0
        if a.cpu_only and a.idle_seconds:
            cpu0 = cpu_seconds(gw.pid)
            time.sleep(a.idle_seconds)
            idle = (cpu_seconds(gw.pid) - cpu0) / a.idle_seconds
        if not a.cpu_only:
            os.kill(gw.pid, signal.SIGUSR1)
        commands0 = redis_commands(a.redis_port) if redis is not None else {}
        cpu0, t0 = cpu_seconds(gw.pid), time.monotonic()
        lat, errors = asyncio.run(raw_client.closed_loop([f"http://127.0.0.1:{a.port}"], raw, headers, a.concurrency,
                                                         a.seconds, path=path))
        cpu, ran = cpu_seconds(gw.pid) - cpu0, time.monotonic() - t0
        # what a request asked of Redis: the private server's calls per command over the loop (the gateway is its
        # only client; a pipeline's commands count one each: commands, not round trips)
        commands1 = redis_commands(a.redis_port) if redis is not None else {}
        commands = {k: v - commands0.get(k, 0) for k, v in commands1.items() if v > commands0.get(k, 0)}
        if not a.cpu_only:
            os.kill(gw.pid, signal.SIGUSR2)
            deadline = time.time() + 30
            while not Path(out).exists() and time.time() < deadline:
                time.sleep(0.1)
            time.sleep(1.0)  # the dump is written at once; let it finish
    finally:
        gw.stop()
        stub.stop()
        if redis is not None:
            redis.stop()
    what = f"chat, streamed, {a.tokens} events" if a.stream else "chat, non-streamed, 16 tokens"
    if a.prompt_tokens:
        what = (f"completions, {a.prompt_tokens}-token prompt ({len(raw) / 1024:.0f} KiB body), streamed with usage, "
                f"{a.tokens} events")
    print(f"{'CPU' if a.cpu_only else 'cProfile (process CPU clock)'} of {'the gateway at ' + a.checkout if a.checkout else 'this gateway'}: "
          f"{what}, prefix index {'in Redis' if a.redis else 'in memory'}, concurrency {a.concurrency}, "
          f"{a.seconds:.0f} s, {errors} errors; load average {os.getloadavg()[0]:.2f}\n")
    if redis is not None:
        n = max(len(lat), 1)
        print("Redis calls per request (the server's count over the loop, the heartbeat's included; a script's own "
              "calls under it): " + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(commands.items())
                                              if k in ("evalsha", "hincrbyfloat", "hgetall", "zadd", "zrangebyscore",
                                                       "hset", "get", "set", "incrbyfloat", "eval")))
    if a.cpu_only:
        lat.sort()
        print(f"{len(lat)} requests: {cpu * 1000 / max(len(lat), 1):.3f} ms of the gateway's CPU per request (no "
              f"profiler), {len(lat) / ran:.1f} req/s, latency p50 {lat[len(lat) // 2] * 1000 if lat else 0:.2f} ms")
        if a.idle_seconds:
            print(f"idle: {idle * 1000:.2f} ms of CPU per second; net of it over the loop's {ran:.1f} s: "
                  f"{(cpu - idle * ran) * 1000 / max(len(lat), 1):.3f} ms per request")
        return
    print(report(pstats.Stats(out), len(lat), a.top))


if __name__ == "__main__":
    main()
