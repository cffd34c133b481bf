"""Poison containment and fast ejection, over loopback against the simulator: a body that hangs replicas is tried on
at most two and then refused (shared through Redis); a replica that stops answering is taken out of routing within
seconds, while one slow request ejects nothing."""

import asyncio
import threading
import time

import httpx
import redis.asyncio as aioredis
from openai import OpenAI

from gateway.dispatch.quarantine import BodyPrint, Quarantine
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import RedisServer, start_sims, wait_until

AUTH = {"authorization": f"Bearer {KEY_A}"}
POISON = {"model": "glm-5.2", "messages": [{"role": "user", "content": "the body that freezes replicas"}], "max_tokens": 4}


def _metric(url: str, name: str) -> float:
    for ln in httpx.get(url + "/metrics").text.splitlines():
        if ln.startswith((name + " ", name + "{")):
            return float(ln.split()[-1])
    return 0.0


def _hang_all(urls: list[str], count: int = 1) -> None:
    for u in urls:
        httpx.post(u + "/_sim/fault", json={"kind": "hang", "count": count})


def _clear(urls: list[str]) -> None:
    for u in urls:
        httpx.post(u + "/_sim/fault", json={"kind": "clear"})


def test_a_body_that_hangs_two_replicas_is_quarantined_and_ejects_none():
    """Timed out on one replica -> tried on exactly one other -> quarantined: the next identical body (stream flag or
    user changed) is refused at once with an OpenAI-shaped 422; other bodies are served; no breaker opened."""
    sims, _ = start_sims(3)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"policy": "round_robin"},
                              timeouts={"first_byte": 0.5}))
    try:
        _hang_all(sims.urls)
        r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers=AUTH, json=POISON, timeout=10)
        assert r.status_code == 504 and r.headers["x-gateway-attempts"] == "2"  # at most one other replica
        assert "refused for" in r.json()["error"]["message"] and r.headers["x-should-retry"] == "false"
        _clear(sims.urls)
        again = httpx.post(gw.urls[0] + "/v1/chat/completions", headers=AUTH,
                           json={**POISON, "stream": True, "user": "someone-else"}, timeout=10)
        assert again.status_code == 422
        err = again.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "request_quarantined" and err["message"]
        assert again.headers["x-should-retry"] == "false"
        # refused before any attempt: no replica was tried, so no first-byte timeout could be spent
        assert again.headers.get("x-gateway-attempts", "0") == "0" and "x-gateway-replica" not in again.headers
        ok = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0).chat.completions.create(
            model="glm-5.2", messages=[{"role": "user", "content": "a normal request"}], max_tokens=4)
        assert ok.choices[0].message.content
        states = gw.call(lambda: {t.name: (t.breaker.state.value, t.healthy) for t in gw.app.state.gateway.registry.targets})
        assert all(s == ("closed", True) for s in states.values())
        assert _metric(gw.admin_url, "gateway_poison_quarantined_total") == 1
        assert _metric(gw.admin_url, "gateway_quarantine_refusals_total") == 1
        refused = [ln for ln in httpx.get(gw.admin_url + "/metrics").text.splitlines()
                   if ln.startswith("gateway_requests_total{") and 'status="422"' in ln]
        assert refused and all('reason="quarantined"' in ln for ln in refused), refused
    finally:
        gw.stop()
        sims.stop()


def test_quarantine_is_shared_across_instances_through_redis():
    redis = RedisServer()
    sims, _ = start_sims(2)
    cfg = config([sglang_pool("p", sims.urls)], routing={"policy": "round_robin", "redis_url": redis.url},
                 timeouts={"first_byte": 0.5})
    gw1, gw2 = start_gateway(cfg), start_gateway(cfg)
    try:
        _hang_all(sims.urls)
        r = httpx.post(gw1.urls[0] + "/v1/chat/completions", headers=AUTH, json=POISON, timeout=10)
        assert r.status_code == 504
        _clear(sims.urls)
        statuses = []

        def refused_on_gw2() -> bool:
            statuses.append(httpx.post(gw2.urls[0] + "/v1/chat/completions", headers=AUTH, json=POISON, timeout=10).status_code)
            return statuses[-1] == 422

        wait_until(refused_on_gw2, timeout=5, what="the other instance to refuse the quarantined body")
        assert _metric(gw2.admin_url, "gateway_poison_quarantined_total") == 0  # learned from Redis, not by itself
    finally:
        gw1.stop()
        gw2.stop()
        sims.stop()
        redis.stop()


def _stream(url: str, content: str, out: list, i: int) -> None:
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"model": "glm-5.2", "messages": [{"role": "user", "content": content}], "max_tokens": 3,
                            "stream": True}) as r:
        body = b"".join(r.iter_bytes())
        out[i] = (r.status_code, r.headers.get("x-gateway-replica"), b"[DONE]" in body, time.monotonic() - t0)


def test_a_hung_replica_is_ejected_within_seconds_not_a_first_byte_timeout_per_request():
    """Replica 0 stops answering (every request hangs; its liveness probe still passes). Streams routed to it are
    moved to replica 1 once two of them are overdue and it answered nothing for stall_s — long before the 10 s
    first-byte timeout — and it gets no new requests afterwards."""
    sims, _ = start_sims(2)
    # a first-byte timeout far beyond the clients' own 30 s: a stream that waited for it would never complete here
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"policy": "round_robin"},
                              timeouts={"first_byte": 600.0},
                              retry={"stall_s": 0.5, "stall_min_requests": 2},
                              circuit_breaker={"failure_threshold": 3, "cooldown_s": 60.0}))
    try:
        httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "hang", "count": 1000})
        out: list = [None] * 6
        threads = [threading.Thread(target=_stream, args=(gw.urls[0], f"hello {i}", out, i)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        # every stream completed on replica 1 (the ejection cut each wait short; the first-byte timeout is 600 s)
        assert all(o is not None and o[0] == 200 and o[1] == "p-1" and o[2] for o in out), out
        assert gw.call(lambda: gw.app.state.gateway.registry.get("p-0").breaker.reason) == "stalled"
        assert _metric(gw.admin_url, 'gateway_replica_ejections_total{pool="p",reason="stalled",replica="p-0"}') == 1
        for i in range(4):  # no new request goes to the hung replica
            r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers=AUTH, timeout=30,
                           json={"model": "glm-5.2", "messages": [{"role": "user", "content": f"after {i}"}], "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-gateway-replica"] == "p-1" and r.headers["x-gateway-attempts"] == "1"
    finally:
        gw.stop()
        sims.stop()


def test_the_trial_after_a_stall_ejection_costs_stall_s_not_a_first_byte_timeout():
    """Once the cooldown of a replica ejected for stalling has passed, the one trial request it gets has only stall_s
    to answer: still hung, the trial moves to another replica at once and the breaker opens again — no client waits a
    first-byte timeout each cooldown (the chaos suite's hung replica once cost two clients 30 s each this way)."""
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"policy": "round_robin"},
                              timeouts={"first_byte": 600.0},  # beyond every client timeout below
                              retry={"stall_s": 0.5, "stall_min_requests": 2},
                              circuit_breaker={"failure_threshold": 3, "cooldown_s": 0.5}))
    try:
        httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "hang", "count": 1000})
        out: list = [None] * 4
        threads = [threading.Thread(target=_stream, args=(gw.urls[0], f"hello {i}", out, i)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert gw.call(lambda: gw.app.state.gateway.registry.get("p-0").breaker.reason) == "stalled"
        for i in range(6):  # cooldowns pass meanwhile: some of these are the hung replica's trials
            time.sleep(0.3)
            r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers=AUTH, timeout=60,
                           json={"model": "glm-5.2", "messages": [{"role": "user", "content": f"later {i}"}], "max_tokens": 2})
            # a trial that waited out the 600 s first-byte timeout would raise a client timeout here
            assert r.status_code == 200 and r.headers["x-gateway-replica"] == "p-1", r.text
        tried = _metric(gw.admin_url, 'gateway_upstream_errors_total{kind="stalled",pool="p",replica="p-0"}')
        assert tried >= 1  # at least one trial went to the hung replica and was cut at stall_s
    finally:
        gw.stop()
        sims.stop()


def test_one_slow_request_ejects_no_replica():
    """A request that hangs on a replica which keeps answering others: that request fails over after its own
    first-byte timeout, and the replica stays in routing."""
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"policy": "round_robin"},
                              timeouts={"first_byte": 2.0}, retry={"stall_s": 0.3, "stall_min_requests": 2}))
    try:
        _hang_all(sims.urls)  # the next request on each replica hangs
        out: list = [None] * 6
        slow = threading.Thread(target=_stream, args=(gw.urls[0], "slow one", out, 0))
        slow.start()
        wait_until(lambda: sum(httpx.get(u + "/_sim/state").json()["inflight"] for u in sims.urls) >= 1, timeout=5,
                   what="the slow one hanging on a replica")
        for i in range(1, 6):  # other traffic, on both replicas
            _stream(gw.urls[0], f"normal {i}", out, i)
        slow.join(30)
        assert all(o is not None and o[0] == 200 and o[2] for o in out), out
        states = gw.call(lambda: {t.name: t.breaker.state.value for t in gw.app.state.gateway.registry.targets})
        assert set(states.values()) == {"closed"}
        assert _metric(gw.admin_url, "gateway_replica_ejections_total") == 0
    finally:
        gw.stop()
        sims.stop()


def test_quarantine_survives_redis_going_away():
    """Redis killed: a quarantine still holds on this instance, and adding to it neither raises nor waits long."""
    server = RedisServer()

    async def go():
        client = aioredis.from_url(server.url, socket_connect_timeout=0.2)
        q = Quarantine(60.0, client, "t:", timeout=0.2)
        first, second = BodyPrint({"model": "m", "prompt": "a"}), BodyPrint({"model": "m", "prompt": "b"})
        await q.add(first)
        assert await q.blocked(first)
        server.kill()
        await q.add(second)
        q._last_sync = float("-inf")  # force the next check to try Redis
        # with Redis gone both answers come from the local mirror (each Redis call is bounded by its 0.2 s timeout)
        assert await q.blocked(second) and await q.blocked(first)
        await client.aclose()

    try:
        asyncio.run(go())
    finally:
        server.stop()
