"""The chaos suite: two gateway instances on one Redis in front of simulated replicas (each its own process), steady
traffic through a readiness-following load balancer, and one fault per scenario. Prints one table:

    sent / ok / failed by status / lost (no response: the request never started) / streams truncated without an
    error event / the scenario's own check

    .venv/bin/python -m loadtests.chaos                 # every scenario, fuzz of 5,000 requests (~6 min on 2 cores)
    .venv/bin/python -m loadtests.chaos --quick         # shorter faults, fuzz of 600 (the CI test runs a subset)
    .venv/bin/python -m loadtests.chaos --only poison,fuzz

Scenarios: replica SIGKILLed under load and brought back; a hung replica; a replica answering 503; Redis killed and
restarted (AOF) with a budgeted tenant spending through the outage; SIGTERM of one instance with streams in flight;
poison bodies; content-caused upstream failures from one tenant; malformed HTTP edges; a burst against a tenant's
concurrency cap, and one at the moment Redis is killed; a burst against a $-budget whose cap fits ~200 requests and
a rate limit across both instances; one x-request-id reused by 300 requests in sequence and at once (and by another
tenant); a header flood and 1,000 slowloris connections before any key; a fuzz of chat, completions, responses,
messages, count_tokens, /v1/models and the admin API (drawn bodies, and every field of a valid body of each in turn
replaced by each kind of JSON value); then normal traffic on every replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from tqdm import tqdm

from loadtests.chaos_stack import ADMIN_TOKEN, BODY_READ_S, TENANTS, LoadBalancer, Stack

POISON = [
    ("completions", {"model": "glm-5.2", "prompt": "x", "max_tokens": 4, "n": 1000000}),
    ("completions", {"model": "glm-5.2", "prompt": "x", "max_tokens": 1e308}),
    ("completions", {"model": "glm-5.2", "prompt": "x", "max_tokens": 4, "logprobs": 1e308}),
    ("completions", {"model": "glm-5.2", "prompt": [1099511627776], "max_tokens": 3}),
    ("completions", {"model": "glm-5.2", "prompt": [""], "max_tokens": 3}),
    ("completions", {"model": "glm-5.2", "prompt": [[], []], "max_tokens": 3}),
    ("chat/completions", {"model": "glm-5.2", "messages": [{"role": "user", "content": "x"}], "tools": [1],
                          "tool_choice": "required", "max_tokens": 3}),
    ("chat/completions", {"model": "glm-5.2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                          "n": 128}),
    ("completions", {"model": "glm-5.2", "prompt": ["a"] * 2000, "n": 8, "max_tokens": 3}),
]
# Bodies the gateway's edge cannot judge (it knows no vocabulary and validates no schema) that every engine refuses:
# they reach replicas, and must come back as the client's 4xx without counting against any replica.
ENGINE_REFUSED = [
    ("completions", {"model": "glm-5.2", "prompt": [200000], "max_tokens": 3}),
    ("completions", {"model": "glm-5.2", "prompt": "x", "max_tokens": 3, "logit_bias": {"200000": 5}}),
    ("chat/completions", {"model": "glm-5.2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                          "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}),
    ("chat/completions", {"model": "glm-5.2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                          "tool_choice": "required", "tools": [{"type": "function", "function": {
                              "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}),
]


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    lost: int = 0  # no HTTP response at all (connection refused/reset before headers)
    truncated: int = 0  # a 200 stream that ended without [DONE] and without an error event
    stream_errors: int = 0  # a 200 stream that ended with an error event (reported, not silent)
    bad_shape: int = 0  # an error body not in the OpenAI shape
    client_timeouts: int = 0
    timings: list[tuple[float, float, int]] = field(default_factory=list)  # (sent at, seconds, status)
    notes: list[str] = field(default_factory=list)
    check: bool = True

    def fail(self, note: str) -> None:
        self.check = False
        self.notes.append(note)


def is_openai_error(raw: bytes) -> bool:
    try:
        err = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


def is_anthropic_error(raw: bytes) -> bool:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}} (/v1/messages, count_tokens)."""
    try:
        body = orjson.loads(raw)
        err = body.get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return body.get("type") == "error" and isinstance(err, dict) and isinstance(err.get("type"), str) \
        and isinstance(err.get("message"), str)


def error_shape(endpoint: str) -> Any:
    """The error shape of the API an endpoint belongs to."""
    return is_anthropic_error if endpoint.startswith("messages") else is_openai_error


# How a stream of each API ends: (a complete end, an in-band error) markers.
STREAM_ENDS = {"responses": ((b"response.completed", b"response.incomplete"), (b"event: error", b"response.failed")),
               "messages": ((b"event: message_stop",), (b"event: error",))}
OPENAI_STREAM_END = ((b"data: [DONE]",), (b'data: {"error"',))


def chat_body(i: int, stream: bool, max_tokens: int = 24) -> dict[str, Any]:
    group = i % 6
    return {"model": "glm-5.2", "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": f"You are agent {group}. " + "Rules. " * 300},
                         {"role": "user", "content": f"task {i}"}],
            **({"stream_options": {"include_usage": True}} if stream else {})}


async def send(client: httpx.AsyncClient, base: str, key: str, endpoint: str, body: Any, t: Tally,
               timeout: float = 30.0, raw: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request; the tally learns its outcome. Returns (status or -1, headers, body or collected stream)."""
    t.sent += 1
    sent_at = time.monotonic()
    code, headers, data = await _send(client, base, key, endpoint, body, t, timeout, raw, headers or {})
    t.timings.append((sent_at, time.monotonic() - sent_at, code))
    return code, headers, data


async def _send(client: httpx.AsyncClient, base: str, key: str, endpoint: str, body: Any, t: Tally,
                timeout: float, raw: bytes | None, extra: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    stream = isinstance(body, dict) and body.get("stream") is True
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {}), **extra}
    content = raw if raw is not None else orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY) \
        if not _has_nonfinite(body) else json.dumps(body).encode()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{base}/v1/{endpoint}", content=content, headers=headers) as r:
                data = b""
                try:
                    async for chunk in r.aiter_bytes():
                        data += chunk
                except httpx.HTTPError:
                    if r.status_code == 200 and stream:
                        t.truncated += 1
                        t.statuses["200-truncated"] += 1
                        return r.status_code, dict(r.headers), data
                    raise
    except TimeoutError:
        t.client_timeouts += 1
        t.statuses["client_timeout"] += 1
        return -1, {}, b""
    except httpx.HTTPError as e:
        t.lost += 1
        t.statuses[f"lost:{type(e).__name__}"] += 1
        return -1, {}, b""
    code = r.status_code
    done, failed = STREAM_ENDS.get(endpoint, OPENAI_STREAM_END)
    if code == 200 and stream:
        if any(m in data for m in done):
            t.ok += 1
            t.statuses["200"] += 1
        elif any(m in data for m in failed):
            t.stream_errors += 1
            t.statuses["200-stream-error-event"] += 1
        else:
            t.truncated += 1
            t.statuses["200-truncated"] += 1
    else:
        t.statuses[str(code)] += 1
        if code == 200:
            t.ok += 1
        elif not error_shape(endpoint)(data):
            t.bad_shape += 1
    return code, dict(r.headers), data


def _has_nonfinite(x: Any) -> bool:
    if isinstance(x, float):
        return x != x or x in (float("inf"), float("-inf"))
    if isinstance(x, dict):
        return any(_has_nonfinite(v) for v in x.values())
    if isinstance(x, list):
        return any(_has_nonfinite(v) for v in x)
    return False


async def steady(lb: LoadBalancer, client: httpx.AsyncClient, seconds: float, rate: float, t: Tally,
                 tenant: str = "steady", max_tokens: int = 24) -> None:
    """Open-loop Poisson traffic: chat streams, chat and completions, through the load balancer."""
    key = TENANTS[tenant][0]
    rng = random.Random(7)
    tasks = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        kind = rng.random()
        if kind < 0.5:
            tasks.append(asyncio.create_task(send(client, lb.pick(), key, "chat/completions", chat_body(i, True, max_tokens), t)))
        elif kind < 0.8:
            tasks.append(asyncio.create_task(send(client, lb.pick(), key, "chat/completions", chat_body(i, False, max_tokens), t)))
        else:
            tasks.append(asyncio.create_task(send(client, lb.pick(), key, "completions",
                                                  {"model": "glm-5.2", "prompt": f"ping {i}", "max_tokens": max_tokens}, t)))
        i += 1
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


def loss_checks(t: Tally) -> None:
    if t.lost:
        t.fail(f"{t.lost} requests lost before any response")
    if t.truncated:
        t.fail(f"{t.truncated} streams truncated without an error event")
    if t.bad_shape:
        t.fail(f"{t.bad_shape} errors not in the OpenAI shape")


async def admin(client: httpx.AsyncClient, base: str, method: str, path: str, body: Any = None) -> httpx.Response:
    return await client.request(method, f"{base}{path}", headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                                content=None if body is None else orjson.dumps(body), timeout=10)


async def sim_fault(client: httpx.AsyncClient, sim: str, **fault: Any) -> None:
    r = await client.post(f"{sim}/_sim/fault", content=orjson.dumps(fault), timeout=5)
    r.raise_for_status()


async def breaker_open(client: httpx.AsyncClient, stack: Stack) -> float:
    total = 0.0
    for u in stack.admin_urls:
        try:
            text = (await client.get(f"{u}/metrics", timeout=5)).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith("gateway_replica_circuit_open{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def every_replica_serves(client: httpx.AsyncClient, stack: Stack, t: Tally) -> None:
    """Each replica answers a normal request directly within 1 s, and the gateways serve normal traffic."""
    for u in stack.sim_urls:
        t0 = time.monotonic()
        code, _, _ = await send(client, u, "", "completions", {"model": "x", "prompt": "hello", "max_tokens": 4}, t,
                                timeout=5)
        took = time.monotonic() - t0
        if code != 200 or took > 1.0:
            t.fail(f"replica {u} answered {code} in {took:.2f} s")
    for u in stack.gw_urls:
        for i in range(6):
            code, _, _ = await send(client, u, TENANTS["steady"][0], "chat/completions", chat_body(i, i % 2 == 0), t,
                                    timeout=5)
            if code != 200:
                t.fail(f"gateway {u} answered {code} to a normal request")


# -- scenarios -----------------------------------------------------------------------------------------------------
async def sc_replica_kill(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    t = Tally()
    load = asyncio.create_task(steady(lb, client, a.fault_s * 3, a.rate, t))
    await asyncio.sleep(a.fault_s)
    await asyncio.to_thread(stack.kill_sim, 0)
    await asyncio.sleep(a.fault_s)
    await asyncio.to_thread(stack.restart_sim, 0)
    await load
    loss_checks(t)
    return t


async def sc_replica_hang(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    t = Tally()
    load = asyncio.create_task(steady(lb, client, a.fault_s * 3, a.rate, t))
    await asyncio.sleep(a.fault_s)
    hung_at = time.monotonic()
    await sim_fault(client, stack.sim_urls[1], kind="hang", count=100000)
    await asyncio.sleep(a.fault_s)
    await sim_fault(client, stack.sim_urls[1], kind="clear")
    await load
    loss_checks(t)
    # requests that arrived while the replica hung: how long until none waits on it (the ejection time)
    during = [(at - hung_at, took) for at, took, _ in t.timings if hung_at <= at <= hung_at + a.fault_s]
    slow = [at for at, took in during if took > 2.0]
    t.notes.append(f"{len(during)} requests while hung, {len(slow)} took > 2 s, the last of them sent "
                   f"{max(slow):.1f} s after the hang began" if slow else f"{len(during)} requests while hung, none > 2 s")
    # without ejection every request routed to the hung replica would wait the first-byte timeout (30 s here, 120 s in
    # the example config); with it, traffic must have left the replica within stall_s (5 s) plus a few seconds
    if slow and max(slow) > 10.0:
        t.fail("requests still waited on the hung replica 10 s after it hung")
    if t.client_timeouts:
        t.fail(f"{t.client_timeouts} requests waited past the client's 30 s timeout")
    return t


async def sc_replica_503(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    t = Tally()
    load = asyncio.create_task(steady(lb, client, a.fault_s * 2, a.rate, t))
    await asyncio.sleep(a.fault_s / 2)
    await sim_fault(client, stack.sim_urls[2], kind="status", status=503, count=1000)
    await asyncio.sleep(a.fault_s)
    await sim_fault(client, stack.sim_urls[2], kind="clear")
    await load
    loss_checks(t)
    if t.ok < t.sent:
        t.fail(f"{t.sent - t.ok} requests failed although two replicas were healthy")
    return t


async def usage_usd(client: httpx.AsyncClient, base: str, tenant: str) -> float:
    r = await admin(client, base, "GET", f"/admin/usage?tenant={tenant}")
    day = r.json()["tenants"][tenant].get("day") or {}
    return float(day.get("spent_usd", 0.0))


async def sc_redis_down(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    """Redis killed for `redis_down_s` and restarted from its AOF; a tenant without caps ("other") spends through the
    outage with non-streamed requests whose cost the gateway reports per response. Afterwards the ledger must equal
    what was served."""
    t = Tally()
    before = await usage_usd(client, stack.admin_urls[0], "other")
    served = 0.0

    async def spender() -> None:
        nonlocal served
        end = time.monotonic() + a.redis_down_s + 2 * a.fault_s
        i = 0
        while time.monotonic() < end:
            code, h, _ = await send(client, lb.pick(), TENANTS["other"][0], "chat/completions", chat_body(i, False), t)
            if code == 200:
                served += float(h.get("x-gateway-cost-usd", 0))
            i += 1
            await asyncio.sleep(0.05)

    load = asyncio.create_task(steady(lb, client, a.redis_down_s + 2 * a.fault_s, a.rate, t))
    spend = asyncio.create_task(spender())
    await asyncio.sleep(a.fault_s)
    stack.redis.kill(hard=True)  # a crash: only what the AOF fsynced survives
    await asyncio.sleep(a.redis_down_s)
    await asyncio.to_thread(stack.redis.start)
    await asyncio.gather(load, spend)
    loss_checks(t)
    deadline = time.monotonic() + 15
    ledger = 0.0
    while time.monotonic() < deadline:
        try:
            ledger = await usage_usd(client, stack.admin_urls[0], "other") - before
        except (httpx.HTTPError, KeyError, ValueError):
            ledger = -1.0
        if abs(ledger - served) <= 1e-9 + 1e-6 * served:
            break
        await asyncio.sleep(0.5)
    t.notes.append(f"served ${served:.6f}, ledger ${ledger:.6f}")
    if abs(ledger - served) > 1e-9 + 1e-6 * served:
        t.fail("the ledger does not equal the spend served during the outage")
    return t


async def sc_sigterm(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    """SIGTERM instance 1 while it carries streams; the load balancer follows /readyz. Readiness must turn 503 before
    the listener closes, and no in-flight stream may be dropped."""
    t = Tally()
    load = asyncio.create_task(steady(lb, client, a.fault_s * 3, a.rate, t, max_tokens=200))
    await asyncio.sleep(a.fault_s)
    term_at = time.monotonic()
    stack.sigterm_gateway(1)
    await load
    code = await asyncio.to_thread(stack.wait_gateway_exit, 1, 90)
    log = [(at - term_at, s) for at, i, s in lb.readiness_log if i == 1 and at >= term_at]
    first_503 = next((at for at, s in log if s == 503), None)
    first_refused = next((at for at, s in log if s == -1), None)
    t.notes.append(f"readyz 503 after {first_503 if first_503 is None else round(first_503, 2)} s, "
                   f"refused after {first_refused if first_refused is None else round(first_refused, 2)} s, exit {code}")
    if first_503 is None or (first_refused is not None and first_refused < first_503):
        t.fail("readiness did not fail before the listener closed")
    loss_checks(t)
    await asyncio.to_thread(stack.restart_gateway, 1)
    return t


async def sc_poison(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    t = Tally()
    steady_t = Tally()
    load = asyncio.create_task(steady(lb, client, a.fault_s * 2, a.rate, steady_t))
    for _ in range(3):
        for endpoint, body in POISON:
            code, _, _ = await send(client, lb.pick(), TENANTS["poison"][0], endpoint, body, t, timeout=20)
            if code >= 500 or code == -1:
                t.fail(f"poison {json.dumps(body)[:60]} -> {code}")
    await load
    t.notes.append(f"steady traffic meanwhile: {steady_t.ok}/{steady_t.sent} ok")
    if steady_t.ok < steady_t.sent:
        t.fail(f"{steady_t.sent - steady_t.ok} steady requests failed during the poison")
    await every_replica_serves(client, stack, t)
    loss_checks(t)
    return t


async def sc_content_failures(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    """Tenant 'poison' sends bodies that pass the gateway's edge but every engine refuses (out-of-vocabulary token
    ids, an invalid schema): they reach replicas. Each must come back as the client's 4xx naming the problem; tenant
    'steady' must keep succeeding on the same instance, and no breaker may open. (Content-caused 5xx are covered by
    tests/dispatch/test_blast_radius.py with injected engine faults.)"""
    t = Tally()
    base = stack.gw_urls[0]
    for i in range(8):
        endpoint, bad = ENGINE_REFUSED[i % len(ENGINE_REFUSED)]
        code, h, _ = await send(client, base, TENANTS["poison"][0], endpoint, bad, t, timeout=20)
        if not 400 <= code < 500 or "x-gateway-replica" not in h:
            t.fail(f"content-caused failure #{i} answered {code} ({h.get('x-gateway-replica', 'no replica')})")
        ok_code, _, _ = await send(client, base, TENANTS["steady"][0], "chat/completions", chat_body(i, False), t)
        if ok_code != 200:
            t.fail(f"tenant steady got {ok_code} after tenant poison's bad request #{i}")
    if await breaker_open(client, stack):
        t.fail("a circuit breaker opened")
    loss_checks(t)
    return t


def raw_http(port: int, data: bytes, timeout: float = 10.0) -> tuple[float, bytes]:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n\r\n" in out:
                    head, _, rest = out.partition(b"\r\n\r\n")
                    m = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                    if m and len(rest) >= int(m[0].split(b":")[1]):
                        break
        except TimeoutError:
            pass
    return time.monotonic() - t0, out


async def sc_edges(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    t = Tally()
    key = TENANTS["steady"][0]
    base = stack.gw_urls[0]
    deep: Any = "x"
    for _ in range(300):
        deep = [deep]
    cases = [("deep JSON", "chat/completions", {"model": "glm-5.2", "messages": [{"role": "user", "content": "x"}],
                                                 "metadata": deep, "max_tokens": 3}),
             ("deep JSON stream", "chat/completions", {"model": "glm-5.2", "messages": [{"role": "user", "content": "x"}],
                                                        "metadata": deep, "max_tokens": 3, "stream": True}),
             ("negative usage", "completions", {"model": "glm-5.2", "prompt": [""], "max_tokens": 3}),
             ("empty prompt lists", "completions", {"model": "glm-5.2", "prompt": [[], []], "max_tokens": 3})]
    for name, endpoint, body in cases:
        content = json.dumps(body).encode()
        code, _, data = await send(client, base, key, endpoint, None, t, raw=content)
        if code >= 500 or code == -1:
            t.fail(f"{name}: {code}")
    port = stack.gw_ports[0]
    auth = f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n".encode()
    body = b'{"model":"glm-5.2","prompt":"hi","max_tokens":2}'
    raws = {
        "negative Content-Length": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + auth + b"content-length: -5\r\n\r\n" + body,
        "duplicate Content-Length": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + auth +
                                    b"content-length: 10\r\ncontent-length: 49\r\n\r\n" + body,
        "Content-Length beyond the body": b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + auth +
                                          b"content-length: 4000\r\n\r\n" + body,
    }
    for name, data in raws.items():
        t.sent += 1
        took, out = await asyncio.to_thread(raw_http, port, data)
        status = out.split(b" ", 2)[1].decode() if out.startswith(b"HTTP/1.1 ") else "none"
        t.statuses[status] += 1
        body_part = out.partition(b"\r\n\r\n")[2]
        if not status.startswith("4") or not is_openai_error(body_part):
            t.fail(f"{name}: {status} {body_part[:60]!r}")
        if took > BODY_READ_S + 2.0:
            t.fail(f"{name}: held the connection {took:.1f} s (body-read timeout {BODY_READ_S} s)")
    return t


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at the same instant as a start closes first)."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    peak = now = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


async def replica_peak(client: httpx.AsyncClient, sim_urls: list[str], since: float) -> int:
    """The exact concurrency the replicas saw together for requests that started after `since`: each simulator keeps
    its requests' (start, end) on the host's monotonic clock, so nothing depends on a poll catching them in flight."""
    spans: list[tuple[float, float]] = []
    for u in sim_urls:
        state = (await client.get(f"{u}/_sim/state", params={"spans": 1}, timeout=30)).json()
        spans += [(a, b) for a, b in state["spans"] if a >= since]
    return max_overlap(spans)


async def sc_burst_concurrency(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    """100 concurrent requests from a tenant with max_concurrent 5: on one instance (scope instance), then split over
    both instances for a tenant whose cap is fleet-wide (scope fleet, through Redis). A request that finished frees
    its slot for a later one, so the check is the concurrency the replicas saw (their own request spans), not the
    number admitted."""
    t = Tally()
    for tenant, bases, what in (("capped", stack.gw_urls[:1], "per instance"), ("capped_fleet", stack.gw_urls, "fleet-wide")):
        long = {"max_tokens": 6000, "ignore_eos": True}
        t0 = time.monotonic()
        results = await asyncio.gather(*(send(client, bases[i % len(bases)], TENANTS[tenant][0], "chat/completions",
                                              {**chat_body(i, False), **long}, t, timeout=60) for i in range(100)))
        peak = await replica_peak(client, stack.sim_urls, t0)
        admitted = sum(1 for code, _, _ in results if code == 200)
        refused = [h for code, h, _ in results if code == 429]
        t.notes.append(f"{what}: {admitted} admitted over the burst, {len(refused)} refused, at most {peak} in flight "
                       f"at the replicas (cap 5)")
        if peak > 5:
            t.fail(f"{peak} in flight at once with max_concurrent 5 {what}")
        if admitted and not peak:
            t.fail(f"{what}: the replicas' in-flight count was never seen above 0 (the measurement failed)")
        if admitted + len(refused) != 100:
            t.fail(f"{what}: {100 - admitted - len(refused)} requests neither admitted nor refused with 429")
        if any("retry-after" not in h for h in refused):
            t.fail("a 429 without Retry-After")
    return t


async def sc_burst_redis_dies(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    """Redis SIGKILLed, then at once 100 concurrent requests split over both instances from a tenant whose
    max_concurrent 5 is fleet-wide: requests caught mid-call to Redis and those after fall back to the local cap, so
    the replicas never see more than 5 per instance (10) at once. Redis is then restarted from its AOF."""
    t = Tally()
    long = {"max_tokens": 6000, "ignore_eos": True}
    t0 = time.monotonic()
    stack.redis.kill(hard=True)
    try:
        results = await asyncio.gather(*(send(client, stack.gw_urls[i % 2], TENANTS["capped_fleet"][0], "chat/completions",
                                              {**chat_body(i, False), **long}, t, timeout=60) for i in range(100)))
    finally:
        await asyncio.to_thread(stack.redis.start)
    peak = await replica_peak(client, stack.sim_urls, t0)
    admitted = sum(1 for code, _, _ in results if code == 200)
    refused = sum(1 for code, _, _ in results if code == 429)
    t.notes.append(f"{admitted} admitted over the burst, {refused} refused, at most {peak} in flight at the replicas "
                   f"(local cap 5 per instance)")
    if peak > 10:
        t.fail(f"{peak} in flight at once as Redis died: more than the local cap per instance")
    if admitted + refused != 100:
        t.fail(f"{100 - admitted - refused} requests neither admitted nor refused with 429")
    loss_checks(t)
    return t


def fallback_lines(stack: Stack) -> int:
    """Log lines in which an instance says it fell back to its own limits or marked Redis away (it must not while
    Redis is up)."""
    n = 0
    for i in range(2):
        path = stack.logs / f"gateway-{i}.log"
        if path.exists():
            n += sum("fall back" in ln or '"event":"redis_away"' in ln
                     for ln in path.read_text(errors="replace").splitlines())
    return n


def log_offsets(stack: Stack) -> list[int]:
    """Where each instance's log ends now: `billed_in_logs` reads only what is written after."""
    return [(stack.logs / f"gateway-{i}.log").stat().st_size if (stack.logs / f"gateway-{i}.log").exists() else 0
            for i in range(2)]


def billed_in_logs(stack: Stack, tenant: str, offsets: list[int]) -> tuple[float, int]:
    """What the instances' request log lines since `offsets` bill `tenant`: (dollars, requests billed anything)."""
    usd, billed = 0.0, 0
    for i, start in enumerate(offsets):
        path = stack.logs / f"gateway-{i}.log"
        if not path.exists():
            continue
        with path.open("rb") as f:
            f.seek(start)
            for ln in f:
                if b'"event":"request"' not in ln:
                    continue
                try:
                    rec = orjson.loads(ln)
                except orjson.JSONDecodeError:
                    continue
                if rec.get("tenant") == tenant and rec.get("cost_usd"):
                    usd += float(rec["cost_usd"])
                    billed += 1
    return usd, billed


def reservation(body: dict[str, Any]) -> float:
    """What the gateway reserves for `body` at the chaos pool's prices: its usage bound (pipeline/budget.py), priced
    uncached — the most one request can be billed."""
    from gateway.config import UsageBounds
    from gateway.pipeline.usage import bound_for
    from gateway.pipeline.validation import validate

    u, p = UsageBounds(), validate(dict(body), "chat/completions")
    b = bound_for(body, p.prompt_tokens, p.max_output_tokens, None, u.prompt_factor, u.prompt_slack_tokens,
                  u.media_tokens, u.max_output_tokens)
    return (b.prompt * 1.0 + b.completion * 3.2) / 1e6


async def sc_budget_burst(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    """400 concurrent requests split across both instances against a budget whose cap fits ~200 of them, then
    200 and 400 against a 50/min rate limit (a fresh tenant for each size). Admitted spend may exceed the cap by at
    most one in-flight request's worst case per instance; the ledger must equal what was served; no instance may fall
    back to local limits while Redis is up."""
    t = Tally()
    logs_before = fallback_lines(stack)
    cap = float(TENANTS["budget"][1]["budget"]["usd_per_day"])
    worst = reservation(chat_body(0, False))
    before = await usage_usd(client, stack.admin_urls[0], "budget")
    offsets = log_offsets(stack)
    res_b = await asyncio.gather(*(send(client, stack.gw_urls[i % 2], TENANTS["budget"][0], "chat/completions",
                                        chat_body(i, False), t) for i in range(400)))
    served = sum(float(h.get("x-gateway-cost-usd", 0)) for code, h, _ in res_b if code == 200)
    admitted = sum(1 for code, _, _ in res_b if code == 200)
    await asyncio.sleep(1.0)  # the last settlements run after their responses
    ledger = await usage_usd(client, stack.admin_urls[1], "budget") - before
    logged, billed = billed_in_logs(stack, "budget", offsets)
    unseen = sum(1 for code, _, _ in res_b if code == -1)  # no answer at this client (its loop too busy to send)
    t.notes.append(f"budget: 400 at once, {admitted} admitted, served ${served:.6f} of a ${cap:.3f} cap (one "
                   f"reservation ${worst:.6f}), ledger ${ledger:.6f}, request log ${logged:.6f} over {billed}")
    if max(served, ledger) > cap + 2 * worst + 1e-12:
        t.fail("admitted spend above the cap plus one worst case per instance")
    # the ledger bills what the instances served, each request once: their request log lines are that record. The
    # client saw every one of those answers, but for a request whose connection broke after it was served
    if abs(ledger - logged) > 1e-9 + 1e-6 * logged:
        t.fail("ledger differs from the spend the instances logged")
    if served > ledger + 1e-9 + 1e-6 * ledger or billed - admitted > unseen:
        t.fail("ledger differs from the spend served")
    # the gateway's refusals; a request whose body did not arrive in time (408) or that never connected was not
    # refused by any limit (a machine too busy to send it), and is counted in its own column
    refusals = [d for code, _, d in res_b if code in (429, 503)]
    if admitted >= 400 or not all(b'"insufficient_quota"' in d for d in refusals):
        # how many get in depends on how fast the burst arrives against how fast its requests end (each holds its
        # worst case while it runs); what must hold is that the budget, and only the budget, cut it
        t.fail(f"{admitted} admitted: the burst was not cut by the budget alone")
    for burst, suffix in ((200, ""), (400, "400")):
        key_r = TENANTS["rate" + suffix][0]
        t0 = time.monotonic()
        res_r = await asyncio.gather(*(send(client, stack.gw_urls[i % 2], key_r, "completions",
                                            {"model": "glm-5.2", "prompt": f"r{i}", "max_tokens": 4}, t) for i in range(burst)))
        rate_elapsed = time.monotonic() - t0  # the bucket refills 50/min meanwhile (tenancy.md: bursts up to the limit)
        rate_ok = sum(1 for code, _, _ in res_r if code == 200)
        t.notes.append(f"rate: {burst} at once, {rate_ok} admitted at 50/min in {rate_elapsed:.1f} s")
        if rate_ok > 50 + rate_elapsed * 50 / 60:
            t.fail(f"{burst}: rate limit exceeded")
    fell_back = fallback_lines(stack) - logs_before
    if fell_back:
        t.fail(f"{fell_back} 'fall back' log lines while Redis was up")
    return t


async def usage_row(client: httpx.AsyncClient, base: str, tenant: str) -> dict[str, Any]:
    r = await admin(client, base, "GET", f"/admin/usage?tenant={tenant}")
    return dict(r.json()["tenants"][tenant].get("day") or {})


async def sc_reused_id(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    """Every request sends one x-request-id, alternating instances: `a.reuse` sequential against a budget whose cap
    stops them, the same number at once against a fleet-wide max_concurrent 5, and one from another tenant. The
    ledger must count every request served and bill each (spend within the cap plus one in-flight worst case per
    instance), the replicas must never see more than 5 at once, and the bystander must be billed to itself."""
    t = Tally()
    same = {"x-request-id": "chaos-same-id"}
    n = a.reuse
    cap = float(TENANTS["reuse"][1]["budget"]["usd_per_day"])
    worst = reservation(chat_body(0, False))
    before = await usage_row(client, stack.admin_urls[0], "reuse")
    served = 0
    spent = 0.0
    for i in range(n):
        code, h, _ = await send(client, stack.gw_urls[i % 2], TENANTS["reuse"][0], "chat/completions",
                                chat_body(i, False), t, headers=same)
        if code == 200:
            served += 1
            spent += float(h.get("x-gateway-cost-usd", 0))
        elif code != 429:
            t.fail(f"sequential #{i}: {code}")
    await asyncio.sleep(1.0)  # the last settlement runs after its response
    after = await usage_row(client, stack.admin_urls[1], "reuse")
    counted = after.get("requests", 0) - before.get("requests", 0)
    billed = after.get("spent_usd", 0.0) - before.get("spent_usd", 0.0)
    t.notes.append(f"sequential: {served} of {n} served, ledger {counted:.0f} requests ${billed:.6f} "
                   f"(cap ${cap:.2f}, served ${spent:.6f})")
    if counted != served or abs(billed - spent) > 1e-9 + 1e-6 * spent:
        t.fail("the ledger does not count and bill every request served")
    if billed > cap + 2 * worst + 1e-12:
        t.fail("spend above the cap plus one worst case per instance")
    # at once, against the fleet-wide cap: the replicas' own in-flight count is the check
    long = {"max_tokens": 6000, "ignore_eos": True}
    t0 = time.monotonic()
    before_f = await usage_row(client, stack.admin_urls[0], "reuse_fleet")
    results = await asyncio.gather(*(send(client, stack.gw_urls[i % 2], TENANTS["reuse_fleet"][0], "chat/completions",
                                          {**chat_body(i, False), **long}, t, timeout=60, headers=same)
                                     for i in range(n)))
    peak = await replica_peak(client, stack.sim_urls, t0)
    admitted = sum(1 for code, _, _ in results if code == 200)
    await asyncio.sleep(1.0)
    counted_f = (await usage_row(client, stack.admin_urls[0], "reuse_fleet")).get("requests", 0) - \
        before_f.get("requests", 0)
    t.notes.append(f"at once: {admitted} of {n} admitted over the burst, at most {peak} in flight at the replicas "
                   f"(fleet cap 5), ledger {counted_f:.0f} requests")
    if peak > 5:
        t.fail(f"{peak} in flight at once past a fleet-wide cap of 5")
    if counted_f != admitted:
        t.fail("the ledger does not count every request served at once")
    before_b = await usage_row(client, stack.admin_urls[0], "reuse_b")
    code, h, _ = await send(client, stack.gw_urls[1], TENANTS["reuse_b"][0], "chat/completions", chat_body(0, False), t,
                            headers=same)
    await asyncio.sleep(1.0)
    after_b = await usage_row(client, stack.admin_urls[0], "reuse_b")
    b_billed = after_b.get("spent_usd", 0.0) - before_b.get("spent_usd", 0.0)
    t.notes.append(f"another tenant with the same id: {code}, billed ${b_billed:.6f}")
    if code != 200 or after_b.get("requests", 0) - before_b.get("requests", 0) != 1 or \
            abs(b_billed - float(h.get("x-gateway-cost-usd", 0))) > 1e-9:
        t.fail("another tenant reusing the id was not billed to itself")
    loss_checks(t)
    return t


async def sc_header_flood(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    """Before any key: a 32 MiB header to each instance (431, connection closed, the instance's RSS unchanged), and
    `a.slowloris` connections trickling header lines (each cut with 408 by the header timeout), while steady traffic
    must all be served."""
    from loadtests.chaos_stack import HEADER_READ_S
    from loadtests.procs import rss_mib
    from loadtests.slowloris import slow_client

    t = Tally()
    for i, port in enumerate(stack.gw_ports):
        g = stack.gateways[i]
        assert g is not None
        rss0 = rss_mib(g.pid)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (32 * 1024 * 1024) + b"\r\n\r\n")
        try:
            await asyncio.wait_for(writer.drain(), 30)
        except (ConnectionError, OSError, TimeoutError):
            pass
        got = b""
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), 30):
                got += chunk
        except (ConnectionError, OSError, TimeoutError):
            pass
        writer.close()
        t.sent += 1
        status = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.1 ") else "none"
        t.statuses[status] += 1
        grew = rss_mib(g.pid) - rss0
        t.notes.append(f"instance {i}: 32 MiB header -> {status}, RSS {rss0:.0f} -> {rss0 + grew:.0f} MiB")
        if status != "431" or not is_openai_error(got.partition(b"\r\n\r\n")[2]):
            t.fail(f"instance {i}: a 32 MiB header answered {status}")
        if grew > 16:
            t.fail(f"instance {i}: RSS grew {grew:.0f} MiB")
    steady_t = Tally()
    load = asyncio.create_task(steady(lb, client, HEADER_READ_S * 2 + 2, a.rate, steady_t))
    deadline = time.monotonic() + HEADER_READ_S * 3 + 10
    ends = [how for how, _ in await asyncio.gather(*(slow_client(stack.gw_ports[k % 2], 0.5, deadline)
                                                       for k in range(a.slowloris)))]
    await load
    t.sent += len(ends)
    for how in ends:
        t.statuses[how] += 1
    t.notes.append(f"{a.slowloris} slowloris connections: {dict(Counter(ends))}; steady traffic meanwhile "
                   f"{steady_t.ok}/{steady_t.sent} served")
    if any(e != "408" for e in ends):
        t.fail("a slowloris connection was not cut with 408 by the header timeout")
    if steady_t.ok < steady_t.sent:
        t.fail(f"{steady_t.sent - steady_t.ok} steady requests failed during the flood")
    return t


FUZZ_MIX = (("chat/completions", 0.25), ("completions", 0.2), ("responses", 0.2), ("messages", 0.15),
            ("messages/count_tokens", 0.1))  # and the admin API with the rest


async def sc_fuzz(stack: Stack, lb: LoadBalancer, client: httpx.AsyncClient, a: argparse.Namespace) -> Tally:
    """Drawn bodies with type confusion on every endpoint: chat, completions, responses, messages, count_tokens and
    the admin API (with and without its token). No 5xx, no lost request, every error in its API's own shape
    (OpenAI's, or Anthropic's on /v1/messages), every stream ended by its API's end or error event; afterwards every
    replica and gateway serves normal traffic."""
    from loadtests.chaos_fuzz import (
        ADMIN,
        CHAT,
        COMPLETION,
        COUNT_TOKENS,
        MESSAGES,
        RESPONSES,
        TEMPLATES,
        confusions,
        draw,
    )

    t = Tally()
    n = a.fuzz
    strategies = {"chat/completions": CHAT, "completions": COMPLETION, "responses": RESPONSES, "messages": MESSAGES,
                  "messages/count_tokens": COUNT_TOKENS}
    bodies = {ep: draw(strategies[ep], int(n * share), seed=i) for i, (ep, share) in enumerate(FUZZ_MIX)}
    admins = draw(ADMIN, max(1, n - sum(len(b) for b in bodies.values())))
    confused = [(ep, b) for ep in strategies for b in confusions(ep)]
    if a.confusions is not None and a.confusions < len(confused):
        confused = random.Random(5).sample(confused, a.confusions)
    for ep, b in confused:
        bodies[ep].append(b)
    key = TENANTS["fuzz"][0]
    sem = asyncio.Semaphore(16)
    five: Counter[tuple[str, bytes]] = Counter()
    per_endpoint: dict[str, Tally] = {ep: Tally() for ep in [*strategies, "admin"]}

    async def one(endpoint: str, body: Any) -> None:
        async with sem:
            raw = json.dumps(body, allow_nan=True).encode()
            mine = per_endpoint[endpoint]
            code, _, data = await send(client, lb.pick(), key, endpoint, body, mine, timeout=30, raw=raw)
            if code >= 500:
                five[(endpoint, data[:100])] += 1

    async def admin_one(item: tuple[str, str, Any, bool]) -> None:
        route, name, body, with_token = item
        method, path = route.split(" ")
        mine = per_endpoint["admin"]
        async with sem:
            mine.sent += 1
            headers = {"authorization": f"Bearer {ADMIN_TOKEN}"} if with_token else {}
            try:
                adm = stack.admin_urls[mine.sent % len(stack.admin_urls)]  # the admin listeners, alternately
                r = await client.request(method, f"{adm}{path.format(name)}", headers=headers,
                                         content=json.dumps(body, allow_nan=True).encode(), timeout=10)
            except httpx.HTTPError:
                mine.lost += 1
                return
            mine.statuses[str(r.status_code)] += 1
            if r.status_code == 200:
                mine.ok += 1
            elif not is_openai_error(r.content):
                mine.bad_shape += 1
            if r.status_code >= 500:
                five[("admin", r.content[:100])] += 1

    async def models() -> None:
        for _ in range(max(1, n // 50)):
            t.sent += 1
            r = await client.get(f"{lb.pick()}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10)
            t.statuses[str(r.status_code)] += 1
            t.ok += r.status_code == 200

    async def template(endpoint: str) -> None:  # the valid body every confusion starts from: served
        code, _, data = await send(client, lb.pick(), key, endpoint, TEMPLATES[endpoint], t, timeout=30)
        if code != 200:
            t.fail(f"the valid {endpoint} template answered {code}: {data[:120]!r}")

    jobs = [one(ep, b) for ep, bs in bodies.items() for b in bs] + [admin_one(x) for x in admins] + [models()] + \
        [template(ep) for ep in strategies]
    random.Random(3).shuffle(jobs)
    with tqdm(total=len(jobs), desc="fuzz", unit="req", leave=False) as bar:
        for fut in asyncio.as_completed([asyncio.ensure_future(j) for j in jobs]):
            await fut
            bar.update(1)
    for ep, mine in per_endpoint.items():
        t.sent += mine.sent
        t.ok += mine.ok
        t.lost += mine.lost
        t.truncated += mine.truncated
        t.bad_shape += mine.bad_shape
        t.statuses.update(mine.statuses)
        fives = sum(v for k, v in mine.statuses.items() if k[:1] == "5")
        t.notes.append(f"{ep}: {mine.sent} sent, {mine.ok} ok, {fives} 5xx, {mine.bad_shape} off-shape, "
                       f"{mine.lost} lost, {mine.truncated} truncated")
    if sum(five.values()):
        (ep, body), _ = five.most_common(1)[0]
        t.fail(f"{sum(five.values())} 5xx, e.g. {ep}: {body!r}")
    loss_checks(t)
    # the fuzz may have set pool weights or tenant overrides through the admin API: put the fleet back, then check
    for u in stack.admin_urls[:1]:
        await admin(client, u, "DELETE", "/admin/pools/mi355x")
    after = Tally()
    await every_replica_serves(client, stack, after)
    if not after.check:
        t.fail("after the fuzz: " + "; ".join(after.notes))
    return t


SCENARIOS = {
    "replica_kill": sc_replica_kill, "replica_hang": sc_replica_hang, "replica_503": sc_replica_503,
    "redis_down": sc_redis_down, "instance_sigterm": sc_sigterm, "poison": sc_poison,
    "content_failures": sc_content_failures, "edges": sc_edges, "burst_concurrency": sc_burst_concurrency,
    "burst_redis_dies": sc_burst_redis_dies,
    "budget_burst": sc_budget_burst, "reused_id": sc_reused_id, "header_flood": sc_header_flood, "fuzz": sc_fuzz,
}


def table(results: dict[str, Tally]) -> str:
    rows = [("scenario", "sent", "ok", "failed by status", "lost", "truncated", "check")]
    for name, t in results.items():
        failed = ", ".join(f"{k}:{v}" for k, v in sorted(t.statuses.items()) if k not in ("200",))
        rows.append((name, str(t.sent), str(t.ok), failed or "-", str(t.lost), str(t.truncated),
                     ("ok" if t.check else "FAIL") + (f" ({'; '.join(t.notes)})" if t.notes else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for j, r in enumerate(rows):
        out.append(" | ".join(c.ljust(w) for c, w in zip(r, widths)) + " | " + r[-1])
        if j == 0:
            out.append("-+-".join("-" * w for w in widths) + "-+-------")
    return "\n".join(out)


async def run(a: argparse.Namespace, stack: Stack) -> dict[str, Tally]:
    results: dict[str, Tally] = {}
    # a pooled connection is dropped after 1 s idle, well before the servers' own keep-alive timeout (the simulated
    # replicas' 5 s, httpx's default expiry too): reusing one as the server closes it is a lost request in the table
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200, keepalive_expiry=1.0)
    # no client-side read timeout below the per-request one in `send` (httpx's default 5 s would call a slow answer lost)
    async with httpx.AsyncClient(limits=limits, trust_env=False,
                                 timeout=httpx.Timeout(60.0, connect=a.connect_timeout)) as client:
        lb = LoadBalancer(stack.gw_urls, client)
        lb.start()
        try:
            for name in tqdm(a.only, desc="chaos", unit="scenario"):
                results[name] = await SCENARIOS[name](stack, lb, client, a)
                tqdm.write(f"{name}: {'ok' if results[name].check else 'FAIL'} {results[name].notes}")
        finally:
            await lb.stop()
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shorter faults and a 600-request fuzz")
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    p.add_argument("--fuzz", type=int, default=None, help="fuzz requests (default 5000, quick 600)")
    p.add_argument("--confusions", type=int, default=None, help="type-confusion bodies sent by the fuzz (default all "
                   "~3,000: each field of a valid body per endpoint replaced by each kind of JSON value; quick 300)")
    p.add_argument("--rate", type=float, default=8.0, help="steady requests/s")
    p.add_argument("--connect-timeout", type=float, default=5.0,
                   help="the clients' connect timeout (s); the suite raises it, where other work may hold the cores")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    a.only = [s for s in a.only.split(",") if s]
    unknown = [s for s in a.only if s not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenarios {unknown}; known: {', '.join(SCENARIOS)}")
    a.fault_s = 3.0 if a.quick else 8.0
    a.redis_down_s = 5.0 if a.quick else 30.0
    a.fuzz = a.fuzz if a.fuzz is not None else (600 if a.quick else 5000)
    a.confusions = a.confusions if a.confusions is not None else (300 if a.quick else None)
    a.reuse = 100 if a.quick else 300
    a.slowloris = 100 if a.quick else 1000
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    stack = Stack()
    try:
        results = asyncio.run(run(a, stack))
    finally:
        stack.stop()
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps({k: {**v.__dict__, "statuses": dict(v.statuses)} for k, v in results.items()}, indent=1))
    return 0 if all(t.check for t in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
