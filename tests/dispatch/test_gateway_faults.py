"""Faults are tested, not assumed: dead replica, mid-stream failure, client disconnect, SIGTERM."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import yaml
from openai import OpenAI

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import env_without_proxies, free_port, start_sims, wait_http, wait_until

MSG = [{"role": "user", "content": "fault tolerance please"}]


def test_refused_connections_are_served_by_another_replica():
    """A replica whose port refuses connections costs the client nothing: every request lands elsewhere."""
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)]))
    try:
        sims.stop_one(0)
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        replicas = set()
        for i in range(6):
            r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=MSG, max_tokens=3, stream=i % 2 == 1)
            replicas.add(r.headers["x-gateway-replica"])
            if i % 2:
                list(r.parse())
        assert replicas == {"p-1"}
        # out of routing: at once if a request met the refused connection, else at the health checker's next probes
        # (cold placement may have sent all six requests to p-1 without ever trying p-0)
        wait_until(lambda: gw.call(lambda: gw.app.state.gateway.registry.get("p-0").healthy) is False, 5,
                   "p-0 marked unhealthy")
    finally:
        gw.stop()
        sims.stop()


def test_failure_before_first_token_fails_over_transparently():
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"policy": "round_robin"}))
    try:
        # replica 0 drops the next two connections right after the status line (a crash), before any event
        httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "reset_before_headers", "count": 2})
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        attempts = []
        for stream in (True, False):
            r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=MSG, max_tokens=5, stream=stream,
                                                            extra_body={"ignore_eos": True})
            body = r.parse()
            last = list(body)[-1] if stream else body
            assert last.choices[0].finish_reason == "length"
            assert r.headers["x-gateway-replica"] == "p-1"
            attempts.append(int(r.headers["x-gateway-attempts"]))
        assert max(attempts) >= 2
    finally:
        gw.stop()
        sims.stop()


def test_mid_stream_failure_is_an_error_event_not_a_truncated_success():
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"policy": "round_robin"}))
    try:
        for u in sims.urls:
            httpx.post(u + "/_sim/fault", json={"kind": "reset_after_chunks", "n": 3, "count": 1})
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        got = []
        with pytest.raises(openai.APIError) as e:
            for ch in c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=200, stream=True,
                                                      extra_body={"ignore_eos": True}):
                got.append(ch)
        assert "mid-stream" in str(e.value)
        assert 1 <= len(got) <= 4
        # on the wire (the other replica's one-shot fault): an error event and no [DONE]
        with httpx.stream("POST", gw.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                          json={"model": "glm-5.2", "messages": MSG, "max_tokens": 200, "stream": True,
                                "ignore_eos": True}) as r:
            body = b"".join(r.iter_bytes())
        assert b"[DONE]" not in body
        assert body.rstrip().endswith(b'"code":"upstream_error"}}')
    finally:
        gw.stop()
        sims.stop()


def test_client_disconnect_cancels_upstream():
    """A client that leaves mid-stream (or before the first token) frees the replica's request at once."""
    sims, reps = start_sims(1, time_scale=5.0)
    gw = start_gateway(config([sglang_pool("p", sims.urls)]))
    try:
        def inflight():
            return sims.call(lambda: len(reps[0]._inflight))

        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        s = c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=5000, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(s))
        assert inflight() == 1
        s.close()
        wait_until(lambda: inflight() == 0, timeout=5, what="the upstream request released")
        aborted = sims.call(lambda: reps[0].ranks[0].rank.counters.aborted)
        assert aborted >= 1

        # before the first token: a long queue wait, client gives up
        httpx.post(sims.urls[0] + "/pause_generation")
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gw.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                       json={"model": "glm-5.2", "messages": MSG, "max_tokens": 5}, timeout=0.5)
        wait_until(lambda: inflight() == 0, timeout=5, what="the upstream request released")
        httpx.post(sims.urls[0] + "/continue_generation")
    finally:
        gw.stop()
        sims.stop()


def test_sigterm_lets_inflight_streams_finish(tmp_path):
    sims, _ = start_sims(1, time_scale=10.0)
    port = free_port()
    cfg_path = tmp_path / "gw.yaml"
    cfg_path.write_text(yaml.safe_dump(config([sglang_pool("p", sims.urls)])))
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg_path), "--port", str(port), "--admin-port", str(free_port()),
                             "--drain-delay", "0"],
                            env=env_without_proxies(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc)
        c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY_A, max_retries=0)
        result = {}
        first = threading.Event()

        def consume():
            chunks = []
            for ch in c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=300, stream=True,
                                                 extra_body={"ignore_eos": True}):
                chunks.append(ch)
                first.set()
            result["chunks"] = chunks

        t = threading.Thread(target=consume)
        t.start()
        assert first.wait(10)
        os.kill(proc.pid, signal.SIGTERM)
        t.join(30)
        chunks = result["chunks"]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert len("".join(ch.choices[0].delta.content or "" for ch in chunks).split()) == 300
        assert proc.wait(20) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/healthz")
    finally:
        if proc.poll() is None:
            proc.kill()
        sims.stop()


def test_breaker_opens_and_recovers():
    """Three consecutive 503s open a replica's breaker; after the cooldown a trial request closes it."""
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], health={"enabled": False}, routing={"policy": "round_robin"}))
    try:
        httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "status", "status": 503, "count": 3})
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        for _ in range(6):
            c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=2)
        st = gw.call(lambda: gw.app.state.gateway.registry.get("p-0").breaker.state.value)
        assert st == "open"
        time.sleep(1.2)
        for _ in range(4):
            c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=2)
        assert gw.call(lambda: gw.app.state.gateway.registry.get("p-0").breaker.state.value) == "closed"
    finally:
        gw.stop()
        sims.stop()
