"""One simulated MI355X node (2 replicas of mi355x-glm52-tp4) under the Wafer ramp, side by side with Wafer's table.

    .venv/bin/python -m loadtests.node_calibration [--time-scale 2] [--duration 450] [--des-seeds 12]

Starts `gateway sim` (2 replicas) as a child process, warms each group's prefix, then for each rate runs the
open-loop generator over real HTTP with requests split round-robin across the two replicas. Also runs the same
experiment on the virtual clock (no HTTP, many seeds) and the single-stream 10k/1.5k check. Prints one table,
writes loadtests/out/node_calibration.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
from tqdm import tqdm

from gateway_lab.sim.wafer import WAFER_TABLE, run_node
from loadtests.report import plot_ramp, save_json, table
from loadtests.runner import one_request, run_rate, summarize, warm_up
from loadtests.workload import WaferWorkload, random_text


def start_sim(port: int, time_scale: float, stream_interval: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "gateway.cli", "sim", "--enable-cache-report", "--replicas", "2", "--port", str(port),
           "--time-scale", str(time_scale), "--stream-interval", str(stream_interval), "--jitter", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            if all(httpx.get(f"http://127.0.0.1:{port + i}/ping", timeout=1).status_code == 200 for i in range(2)):
                return proc
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("simulator did not start")


async def single_stream(url: str, time_scale: float) -> dict[str, float]:
    import numpy as np

    text = random_text(np.random.default_rng(99), 40_000 - 40)
    body = {"model": "glm-5.2", "messages": [{"role": "user", "content": text}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=600, trust_env=False) as c:
        # a first small request pays the fresh process's one-off costs (imports, connection) outside the measurement
        await one_request(c, url, {**body, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2},
                          {"content-type": "application/json"}, time.perf_counter(), time_scale, 0)
        r = await one_request(c, url, body, {"content-type": "application/json"}, time.perf_counter(), time_scale, 0)
    assert r.ok and r.ttft is not None and r.end is not None, r.error
    decode = (r.completion_tokens - 1) / (r.end - r.sent - r.ttft)
    return {"prompt_tokens": r.prompt_tokens, "ttft": r.ttft, "decode_tok_s": decode,
            "e2e_tok_s": r.completion_tokens / (r.end - r.sent)}


async def main_async(a: argparse.Namespace) -> None:
    rates = [float(x) for x in a.rates.split(",")]
    print(f"virtual-clock model: {a.des_seeds} seeds x {a.duration:.0f} s per rate ...", file=sys.stderr)
    des = {}
    tqdm.monitor_interval = 0  # no tqdm monitor thread waking in the measuring client (the HTTP runs below)
    with tqdm(total=len(rates) * a.des_seeds, desc="virtual clock", unit="run", file=sys.stderr, leave=False,
              disable=a.no_progress) as bar:
        for rate in rates:
            runs = []
            for seed in range(a.des_seeds):
                runs.append(run_node(rate, a.duration, seed=seed))
                bar.update()
            des[rate] = {k: statistics.mean(getattr(r, k) for r in runs) for k in ("tok_s", "ttft_p50", "ttft_p95", "cache_hit")}
    proc = start_sim(a.port, a.time_scale, a.stream_interval)
    try:
        urls = [f"http://127.0.0.1:{a.port + i}/v1" for i in range(2)]
        single = await single_stream(urls[0], a.time_scale)
        wl = WaferWorkload(groups=a.groups, seed=a.seed)
        async with httpx.AsyncClient(timeout=600, trust_env=False) as c:
            await warm_up(c, urls, wl, {"content-type": "application/json"}, per_group=2)
        http_rows = []
        # one step per rate, drawn between rates; the runner's bar under it advances with the arrivals
        with tqdm(total=len(rates), unit="rate", file=sys.stderr, leave=False, disable=a.no_progress) as bar:
            for rate in rates:
                bar.set_description(f"HTTP @ {rate:g} req/s")
                t0 = time.time()
                res = await run_rate(urls, rate, a.duration, wl, time_scale=a.time_scale, seed=a.seed + int(rate * 100),
                                     progress=not a.no_progress)
                s = summarize(res, rate)
                s["wall_s"] = round(time.time() - t0, 1)
                http_rows.append(s)
                bar.update()
        # the runs are over: a blocking read on the loop holds nothing up
        lag = [httpx.get(f"http://127.0.0.1:{a.port + i}/_sim/state").json()["ranks"][0]["lag"]  # noqa: ASYNC210
               for i in range(2)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    rows = []
    for s in http_rows:
        w = WAFER_TABLE.get(s["rate"], (float("nan"),) * 3)
        d = des[s["rate"]]
        rows.append([s["rate"], w[0], round(s["tok_s"]), f"{(s['tok_s'] / w[0] - 1) * 100:+.0f}%", round(d["tok_s"]),
                     f"{w[1]:.2f}/{w[2]:.2f}", f"{s['ttft_p50']:.2f}/{s['ttft_p95']:.2f}",
                     f"{(s['ttft_p50'] / w[1] - 1) * 100:+.0f}%/{(s['ttft_p95'] / w[2] - 1) * 100:+.0f}%",
                     f"{d['ttft_p50']:.2f}/{d['ttft_p95']:.2f}", f"{s['success'] * 100:.0f}%", f"{s['cache_hit'] * 100:.1f}%"])
    print()
    print(f"One simulated MI355X node (2 x mi355x-glm52-tp4), Wafer workload, {a.duration:.0f} s per rate, "
          f"time scale {a.time_scale}x, HTTP seed {a.seed}; virtual-clock model: mean of {a.des_seeds} seeds")
    print(table(["req/s", "Wafer tok/s", "sim tok/s", "d", "model tok/s", "Wafer TTFT p50/p95", "sim p50/p95", "d",
                 "model p50/p95", "success", "cache hit"], rows))
    print(f"\nsingle stream 10k in / 1.5k out: prompt {single['prompt_tokens']} tokens, TTFT {single['ttft']:.2f} s, "
          f"decode {single['decode_tok_s']:.0f} tok/s (Wafer: 213), end-to-end {single['e2e_tok_s']:.0f} tok/s")
    print("simulator lag per replica (rank 0):", [{k: round(v, 4) for k, v in x.items()} for x in lag])
    save_json("node_calibration", {"args": vars(a), "http": http_rows, "model": des, "single_stream": single, "lag": lag,
                                   "wafer": WAFER_TABLE})
    png = plot_ramp("node_calibration", {"simulator over HTTP": http_rows,
                                         "virtual-clock model": [{"rate": r, **des[r]} for r in rates]},
                    "One MI355X node (simulated) vs Wafer", WAFER_TABLE)
    print(f"wrote {png}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,1.0,1.5,2.0,2.25,2.4")
    p.add_argument("--duration", type=float, default=450.0, help="simulated seconds per rate")
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--stream-interval", type=int, default=8, help="decode steps per SSE chunk (SGLang --stream-interval)")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--des-seeds", type=int, default=12)
    p.add_argument("--port", type=int, default=32000)
    p.add_argument("--no-progress", action="store_true", help="no progress bars (stderr)")
    a = p.parse_args()
    os.environ.setdefault("NO_PROXY", "127.0.0.1")
    asyncio.run(main_async(a))


if __name__ == "__main__":
    main()
