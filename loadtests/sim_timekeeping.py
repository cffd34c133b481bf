"""Does the simulator keep time? 2 replicas x 48 running streams at real-time speed on this machine.

    .venv/bin/python -m loadtests.sim_timekeeping [--time-scale 1] [--seconds 30]

Starts `gateway sim --replicas 2` as a child process, opens 48 long streaming requests per replica (every stream
consumed by a second process, this one), waits, then reads each rank's lag statistics from /_sim/state: the
measured wall time of every back-to-back forward vs the model's duration, and how late steps completed.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

import httpx
from tqdm import tqdm

from loadtests.report import save_json, table


async def stream_forever(client: httpx.AsyncClient, url: str, stop: asyncio.Event, counter: list[int]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "tick " * 200}], "max_tokens": 20_000,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for chunk in r.aiter_raw():
            counter[0] += chunk.count(b"data: ")
            if stop.is_set():
                return


async def wait(seconds: float, bar: Any) -> None:
    """Sleep `seconds`, stepping `bar` (tqdm, in seconds) once a second; a disabled bar: one plain sleep."""
    if bar.disable:
        await asyncio.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        await asyncio.sleep(min(left, 1.0))
        bar.update(min(round(seconds - max(end - time.perf_counter(), 0.0)), bar.total) - bar.n)


async def main_async(a: argparse.Namespace) -> None:
    proc = subprocess_start(a)
    try:
        urls = [f"http://127.0.0.1:{a.port + i}" for i in range(2)]
        stop = asyncio.Event()
        counter = [0]
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200), trust_env=False) as c:
            tasks = [asyncio.create_task(stream_forever(c, u, stop, counter)) for u in urls for _ in range(48)]
            await asyncio.sleep(2)
            base = [(await c.get(u + "/_sim/state")).json()["ranks"][0] for u in urls]
            # the measured wait, stepped once a second (no per-event work; the monitor thread off)
            tqdm.monitor_interval = 0
            with tqdm(total=round(a.seconds), desc="measuring", unit="s", file=sys.stderr, leave=False,
                      disable=a.no_progress) as bar:
                t0, n0 = time.time(), counter[0]
                await wait(a.seconds, bar)
            states = [(await c.get(u + "/_sim/state")).json()["ranks"][0] for u in urls]
            events_s = (counter[0] - n0) / (time.time() - t0)
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    rows = []
    for i, (b, s) in enumerate(zip(base, states)):
        lag = s["lag"]
        rows.append([f"replica {i}", len(s["running"]), lag["steps"] - b["lag"]["steps"],
                     f"{(lag['step_time_ratio'] - 1) * 100:+.2f}%", f"{lag['mean_step_error'] * 100:.1f}%",
                     f"{lag['within_5pct'] * 100:.0f}%", f"{lag['p99_lag_s'] * 1000:.1f}", f"{lag['max_lag_s'] * 1000:.0f}",
                     lag["resyncs"]])
    print(f"\n2 replicas x 48 streams, time scale {a.time_scale}x, {a.seconds:.0f} s measured; client relayed {events_s:.0f} SSE events/s")
    print(table(["replica", "running", "steps", "step time vs model", "mean |step error|", "steps within 5%",
                 "p99 lag ms", "max lag ms", "resyncs"], rows))
    save_json("sim_timekeeping", {"args": vars(a), "ranks": states, "events_per_s": events_s})


def subprocess_start(a: argparse.Namespace):  # type: ignore[no-untyped-def]
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim", "--enable-cache-report", "--replicas", "2", "--port", str(a.port),
                             "--time-scale", str(a.time_scale), "--jitter", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            if httpx.get(f"http://127.0.0.1:{a.port + 1}/ping", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError("simulator did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--port", type=int, default=32200)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
