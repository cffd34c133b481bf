"""SIGTERM as a load balancer sees it (issue 17 build 4): readiness fails first while every request is still served,
the listener closes only after the drain delay, and no in-flight stream is dropped."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import httpx
import pytest
import redis
import yaml
from openai import OpenAI

from tests.gateway_fixtures import KEY_A, config, sglang_pool
from tests.support import (
    env_without_proxies,
    free_port,
    start_sims,
    wait_http,
    wait_until,
)

MSG = [{"role": "user", "content": "drain me gently"}]
DRAIN_DELAY = 1.5
STREAMS = 6
TOKENS = 500  # long enough (time scale 1) to outlive the drain delay


def test_sigterm_fails_readiness_for_the_drain_delay_then_closes_and_finishes_streams(tmp_path):
    sims, _ = start_sims(2, time_scale=1.0)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg_path = tmp_path / "gw.yaml"
    cfg_path.write_text(yaml.safe_dump(config([sglang_pool("p", sims.urls)], shutdown={"readiness_drain_s": DRAIN_DELAY})))
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg_path), "--port", str(port), "--admin-port", str(free_port())],
                            env=env_without_proxies(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_http(f"{base}/healthz", proc=proc)
        assert httpx.get(f"{base}/readyz").status_code == 200
        c = OpenAI(base_url=f"{base}/v1", api_key=KEY_A, max_retries=0)
        results: dict[int, list] = {}
        ended: dict[int, float] = {}
        errors: list[BaseException] = []
        started = threading.Barrier(STREAMS + 1)

        def consume(i: int) -> None:
            try:
                chunks = []
                for ch in c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=TOKENS, stream=True,
                                                     extra_body={"ignore_eos": True}):
                    if not chunks:
                        started.wait(20)
                    chunks.append(ch)
                results[i] = chunks
                ended[i] = time.monotonic()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        streams = [threading.Thread(target=consume, args=(i,)) for i in range(STREAMS)]
        for t in streams:
            t.start()
        started.wait(20)  # every stream has its first chunk: all are in flight

        # the load balancer's view: /readyz on a fresh connection every 50 ms
        polls: list[tuple[float, float, str]] = []  # (sent, answered, status)
        stop_polling = threading.Event()

        def poll() -> None:
            while not stop_polling.is_set():
                sent = time.monotonic()
                try:
                    status = str(httpx.get(f"{base}/readyz", timeout=2).status_code)
                except httpx.ConnectError:
                    status = "refused"
                polls.append((sent, time.monotonic(), status))
                time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        wait_until(lambda: len(polls) >= 2, timeout=20, what="the poller's first answers")
        t_term = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        # new requests during the drain delay are still served
        wait_until(lambda: any(s == "503" for _, _, s in polls), timeout=10, what="the drain delay under way")
        served_while_draining = c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=3)
        for t in streams:
            t.join(60)
        assert proc.wait(30) == 0
        stop_polling.set()
        poller.join(5)

        assert not errors, errors
        assert served_while_draining.choices[0].message.content
        # 0 dropped in-flight streams: each ran to its full length
        assert len(results) == STREAMS
        for chunks in results.values():
            assert chunks[-1].choices[0].finish_reason == "length"
            assert len("".join(ch.choices[0].delta.content or "" for ch in chunks).split()) == TOKENS
        # A poll's connection was made somewhere between its `sent` and `answered` times, so every bound below takes
        # the end of that interval that holds however long a busy machine stalls the poller between the two.
        before = [s for _, answered, s in polls if answered < t_term]
        assert before and set(before) == {"200"}
        first_503 = min(sent for sent, _, s in polls if s == "503")
        assert "200" not in [s for sent, _, s in polls if sent > first_503], "ready again after readiness failed"
        draining = [sent - t_term for sent, _, s in polls if s == "503"]
        refused = [answered - t_term for sent, answered, s in polls if s == "refused" and sent > t_term]
        assert draining and refused, polls
        assert max(draining) < min(refused), "the listener closes only after readiness has failed"
        assert min(refused) >= DRAIN_DELAY - 0.1, f"listener closed {min(refused):.2f} s after SIGTERM"
        # the streams were still running when the listener closed: they finished on the draining server
        first_refused_sent = min(sent - t_term for sent, _, s in polls if s == "refused" and sent > t_term)
        assert max(ended.values()) - t_term > first_refused_sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        sims.stop()


def test_a_second_signal_skips_the_drain_delay(tmp_path):
    """On-call who really wants it gone sends the signal twice: the listener closes without waiting the delay."""
    sims, _ = start_sims(1)
    port = free_port()
    cfg_path = tmp_path / "gw.yaml"
    cfg_path.write_text(yaml.safe_dump(config([sglang_pool("p", sims.urls)])))
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg_path), "--port", str(port), "--admin-port", str(free_port()),
                             "--drain-delay", "60"], env=env_without_proxies(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc)
        os.kill(proc.pid, signal.SIGTERM)
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 503, timeout=10,
                   what="readiness failing (draining)")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0  # well before the 60 s delay
        assert b"draining" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        sims.stop()


def test_streams_past_the_drain_timeout_end_with_an_error_event_and_are_billed_for_what_was_delivered(
        tmp_path, redis_server):
    """Streams still running when the drain timeout ends used to be cut silently: a closed connection, a log line
    saying `200 ok` with 0 tokens, nothing billed. Each must end with an error event the SDK raises, be logged as
    cut (reason `shutdown`) with the tokens it delivered, and that spend must reach the shared ledger before exit."""
    sims, _ = start_sims(1, time_scale=1.0)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    prefix = f"cut{time.monotonic_ns()}:"
    cfg = config([sglang_pool("p", sims.urls)], shutdown={"readiness_drain_s": 0},
                 routing={"redis_url": redis_server.url, "redis_prefix": prefix})
    cfg["tenants"][0]["budget"] = {"usd_per_day": 100.0}  # a budget: its ledger must hold the cut streams' spend
    cfg_path = tmp_path / "gw.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg_path), "--port",
                             str(port), "--admin-port", str(free_port()), "--drain-timeout", "2"], env=env_without_proxies(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        wait_http(f"{base}/healthz", proc=proc)
        c = OpenAI(base_url=f"{base}/v1", api_key=KEY_A, max_retries=0)
        delivered: dict[int, int] = {}
        errors: dict[int, BaseException] = {}
        started = threading.Barrier(4 + 1)

        def consume(i: int) -> None:
            n = 0
            try:
                for _ch in c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=20_000, stream=True,
                                                     extra_body={"ignore_eos": True}):
                    if n == 0:
                        started.wait(20)
                    n += 1
            except BaseException as e:  # noqa: BLE001 - asserted below
                errors[i] = e
            delivered[i] = n

        streams = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        for t in streams:
            t.start()
        started.wait(20)
        os.kill(proc.pid, signal.SIGTERM)
        for t in streams:
            t.join(60)
        assert proc.wait(30) == 0
        out = proc.stdout.read().decode()
        # the SDK raised the error event (an APIError naming the shutdown), not a connection error
        assert len(errors) == 4 and all("shutting down" in str(e) for e in errors.values()), errors
        log = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]  # the JSON log stream
        lines = [ln for ln in log if ln["event"] == "request"]
        assert [ln["count"] for ln in log if ln["event"] == "streams_cut"] == [4]
        cut = [ln for ln in lines if ln["reason"] == "shutdown"]
        assert len(cut) == 4 and all(ln["status"] == "200" for ln in cut)
        assert all(ln["completion_tokens"] > 0 and ln["cost_usd"] > 0 for ln in cut), cut
        assert sum(ln["completion_tokens"] for ln in cut) <= sum(delivered.values())  # a lower bound: chunks relayed
        day = {k.decode(): v.decode() for k, v in redis.Redis.from_url(redis_server.url).hgetall(
            f"{prefix}budget:tenant-a:{datetime.now(UTC).strftime('%Y-%m-%d')}").items()}
        assert int(day["requests"]) == 4
        assert float(day["spent"]) == pytest.approx(sum(ln["cost_usd"] for ln in cut), abs=4e-8)  # logged to 8 places
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        sims.stop()
