"""`gateway replay TRACE --http BASE_URL`: the same trace open-loop against a live OpenAI-compatible endpoint (this
gateway, a peer router, SGLang itself).

Prompts are rebuilt from deterministic blocks so that shared ids share text: block id b is 2,048 characters (512
tokens under the shared 4-characters-per-token rule) of a pattern made from b, and a prompt is its blocks in order,
the last one cut to the trace's length. They go to `/completions` as plain text, so the gateway's 256-token chunks
(1,024 characters) and the engine's pages fall on block boundaries. Each request streams with usage, asks for the
trace's output length (`ignore_eos`, as SGLang accepts), and is sent at its trace time ÷ `--speed` whatever the
previous ones are doing (open loop; `--concurrency` caps what is in flight, and the table says how late sends ran).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import orjson

from gateway.recording.trace import BLOCK_TOKENS, TraceRecord
from gateway.tokenizer import CHARS_PER_TOKEN
from gateway_lab.sim.stats import nearest_rank

BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN


def block_text(block_id: int) -> str:
    unit = f"<{block_id:x}> "
    return (unit * (BLOCK_CHARS // len(unit) + 1))[:BLOCK_CHARS]


def prompt_for(r: TraceRecord) -> str:
    text = "".join(block_text(b) for b in r.hash_ids)
    return text[: r.input_length * CHARS_PER_TOKEN]


@dataclass
class HttpResult:
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    lag: float = 0.0  # how late the request was sent vs its trace time
    sent: float = 0.0  # when it was sent, wall seconds from the run's start
    replica: str = ""  # the gateway's x-gateway-replica (where it went), when the endpoint says
    route: str = ""  # the gateway's x-gateway-route (the routing branch)
    flow_wait: float | None = None  # the gateway's x-gateway-flow-wait-ms, in seconds (time held by flow control)
    predicted: float | None = None  # the gateway's x-gateway-ttft-predicted-ms, in seconds (the replica's, from send)


async def _one(client: httpx.AsyncClient, base: str, model: str, r: TraceRecord, headers: dict[str, str]) -> HttpResult:
    res = HttpResult()
    body = {"model": model, "prompt": prompt_for(r), "max_tokens": max(1, r.output_length), "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    try:
        async with client.stream("POST", base.rstrip("/") + "/completions", content=orjson.dumps(body),
                                 headers=headers) as resp:
            res.replica = resp.headers.get("x-gateway-replica", "")
            res.route = resp.headers.get("x-gateway-route", "")
            wait = resp.headers.get("x-gateway-flow-wait-ms")
            res.flow_wait = float(wait) / 1000 if wait else None
            predicted = resp.headers.get("x-gateway-ttft-predicted-ms")
            res.predicted = float(predicted) / 1000 if predicted else None
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}"
                raw = await resp.aread()
                try:  # the error's code says why (a flow control refusal: flow_queue_timeout, ...)
                    code = (orjson.loads(raw).get("error") or {}).get("code")
                except (orjson.JSONDecodeError, AttributeError):
                    code = None
                if isinstance(code, str) and code:
                    res.error += f" {code}"
                return res
            buf, done = b"", False
            async for chunk in resp.aiter_raw():
                buf += chunk
                while b"\n\n" in buf:
                    frame, buf = buf.split(b"\n\n", 1)
                    if not frame.startswith(b"data: "):
                        continue
                    payload = frame[6:]
                    if payload == b"[DONE]":
                        done = True
                    elif payload.startswith(b'{"error"'):
                        res.error = "error event"
                    else:
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - start
                        if b'"usage":{' in payload:
                            u = orjson.loads(payload).get("usage") or {}
                            res.prompt_tokens = u.get("prompt_tokens") or res.prompt_tokens
                            res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            res.ok = done and not res.error and res.ttft is not None
            if not done and not res.error:
                res.error = "stream ended without [DONE]"
    except httpx.HTTPError as e:
        res.error = type(e).__name__
    return res


async def run_http(trace: Sequence[TraceRecord], base: str, model: str, api_key: str, speed: float,
                   concurrency: int, progress: Callable[[], None] | None = None,
                   origin_ms: float | None = None) -> list[HttpResult]:
    """`progress`: called as each request finishes (a progress bar's update); `origin_ms`: the trace time sent at
    the start (default the trace's first arrival; several streams of one run share theirs)."""
    sem = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        first = origin_ms if origin_ms is not None else trace[0].timestamp_ms if trace else 0.0

        async def fire(r: TraceRecord) -> HttpResult:
            due = (r.timestamp_ms - first) / 1000 / speed
            await asyncio.sleep(max(0.0, due - (time.perf_counter() - t0)))
            async with sem:
                sent = time.perf_counter() - t0
                res = await _one(client, base, model, r, headers)
                res.lag, res.sent = sent - due, sent
            if progress:
                progress()
            return res

        return list(await asyncio.gather(*(fire(r) for r in trace)))


def summary(results: Sequence[HttpResult], sla_s: float) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    ttft = sorted(r.ttft for r in ok if r.ttft is not None)
    prompt = sum(r.prompt_tokens for r in ok) or 1
    lags = sorted(r.lag for r in results)
    return {"requests": len(results), "ok": len(ok), "hit_rate": sum(r.cached_tokens for r in ok) / prompt,
            "ttft_p50": nearest_rank(ttft, 0.5), "ttft_p95": nearest_rank(ttft, 0.95),
            "ttft_p99": nearest_rank(ttft, 0.99), "within_sla": sum(x <= sla_s for x in ttft) / max(1, len(ttft)),
            "send_lag_p95": nearest_rank(lags, 0.95)}


def replay_http(trace: Sequence[TraceRecord], args: argparse.Namespace) -> int:
    from tqdm import tqdm  # stderr, so the summary on stdout stays clean

    with tqdm(total=len(trace), desc=args.http, unit="req", file=sys.stderr, leave=False,
              disable=args.no_progress) as bar:
        results = asyncio.run(run_http(trace, args.http, args.http_model, args.api_key, args.speed, args.concurrency,
                                       progress=None if args.no_progress else bar.update))
    s = summary(results, (args.sla_ms or 2220) / 1000)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    print(f"{args.http}: {s['ok']}/{s['requests']} ok, hit {s['hit_rate'] * 100:.1f}%, TTFT p50 {s['ttft_p50']:.2f} "
          f"p95 {s['ttft_p95']:.2f} p99 {s['ttft_p99']:.2f} s, {s['within_sla'] * 100:.1f}% within SLA, "
          f"send lag p95 {s['send_lag_p95']:.2f} s" + (f", errors {errors}" if errors else ""))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(orjson.dumps({"trace": args.trace, "base_url": args.http, "summary": s, "errors": errors}).decode())
    return 0 if s["ok"] else 1
