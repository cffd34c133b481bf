"""An open-loop load generator for any OpenAI-compatible base URL (the simulator, the gateway, real SGLang).

Poisson arrivals at a fixed rate; every request streams, and the client records when it was sent, when the first
content arrived (TTFT), when it ended, and the usage the server reported (prompt, cached and completion tokens).
With `time_scale` k the target runs k times faster than real time (the simulator's --time-scale): arrivals are
sent k times faster and every measured duration is multiplied by k, so results are in simulated seconds.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from tqdm import tqdm

from gateway.backends.sse import sse_payloads
from gateway_lab.sim.stats import nearest_rank, window_throughput
from loadtests.workload import WaferWorkload


@dataclass
class Result:
    sent: float
    group: int
    target: str
    ttft: float | None = None
    end: float | None = None
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    headers: dict[str, str] = field(default_factory=dict)


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str],
                      t0: float, scale: float, group: int) -> Result:
    res = Result(sent=(time.perf_counter() - t0) * scale, group=group, target=url)
    start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/chat/completions", content=orjson.dumps(body), headers=headers) as r:
            res.headers = {k: v for k, v in r.headers.items() if k.startswith("x-gateway")}
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            done = False
            async for payload in sse_payloads(r.aiter_raw()):
                if payload == b"[DONE]":
                    done = True
                    continue
                if payload.startswith(b'{"error"'):
                    res.error = payload[:200].decode(errors="replace")
                    continue
                if res.ttft is None:  # the first chunk (the role chunk) is sent at the first token
                    res.ttft = (time.perf_counter() - start) * scale
                if b'"usage":{' in payload and b'"choices":[]' in payload:
                    u = orjson.loads(payload)["usage"]
                    res.prompt_tokens = u.get("prompt_tokens") or 0
                    res.completion_tokens = u.get("completion_tokens") or 0
                    res.cached_tokens = ((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
            res.end = res.sent + (time.perf_counter() - start) * scale
            res.ok = done and not res.error and res.ttft is not None
            if not done and not res.error:
                res.error = "stream ended without [DONE]"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def warm_up(client: httpx.AsyncClient, urls: list[str], wl: WaferWorkload, headers: dict[str, str],
                  per_group: int) -> None:
    """Put every group's prefix in cache first (as a long-running agentic fleet would have it), not measured."""
    bodies = [(g, wl.body(g, max_tokens=1)) for g in range(wl.groups) for _ in range(per_group)]
    sem = asyncio.Semaphore(4)

    async def go(i: int, body: dict[str, Any]) -> None:
        async with sem:
            await one_request(client, urls[i % len(urls)], body, headers, time.perf_counter(), 1.0, -1)

    # the same group twice in a row to each of N round-robin targets warms it on every target
    await asyncio.gather(*(go(i, b) for i, (g, b) in enumerate(bodies)))


async def run_rate(urls: list[str], rate: float, duration: float, wl: WaferWorkload, *, api_key: str | None = None,
                   time_scale: float = 1.0, seed: int = 0, progress: bool = True, drain_timeout: float = 600.0) -> list[Result]:
    """Open loop: Poisson arrivals at `rate` req/s (simulated) for `duration` simulated seconds, round-robin over urls."""
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=500)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        tasks: list[asyncio.Task[Result]] = []
        t_next = 0.0
        i = 0
        bar = tqdm(total=round(duration), desc=f"rate {rate:g}", unit="sim s", disable=not progress, leave=False)
        while True:
            t_next += rng.expovariate(rate)
            if t_next > duration:
                break
            delay = t0 + t_next / time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            g = wl.group_of(i)
            tasks.append(asyncio.create_task(one_request(client, urls[i % len(urls)], wl.body(g), headers, t0, time_scale, g)))
            i += 1
            if i % 16 == 0:
                done = sum(t.done() for t in tasks)
                bar.set_postfix(sent=len(tasks), in_flight=len(tasks) - done, refresh=False)
                bar.update(min(round(t_next), bar.total) - bar.n)
        bar.set_description(f"rate {rate:g}: draining")
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=drain_timeout)
        bar.close()
    return list(results)


def summarize(results: list[Result], rate: float) -> dict[str, Any]:
    """Spec 6.4's measurement: TTFT nearest-rank percentiles over finished requests; throughput = output tokens of
    requests finishing between the 10th- and 90th-percentile send times / that window."""
    ok = [r for r in results if r.ok]
    ttft = sorted(r.ttft for r in ok if r.ttft is not None)

    prompt = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    return {
        "rate": rate,
        "requests": len(results),
        "success": len(ok) / len(results) if results else 0.0,
        "tok_s": window_throughput((r.sent for r in results), ((r.end, r.completion_tokens) for r in ok if r.end is not None)),
        "ttft_p50": nearest_rank(ttft, 0.50),
        "ttft_p95": nearest_rank(ttft, 0.95),
        "cache_hit": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "errors": errors,
    }
