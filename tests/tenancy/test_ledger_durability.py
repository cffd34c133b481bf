"""The budget ledger survives Redis going away (issue #18): a private redis-server with an AOF is killed (SIGKILL,
a crash) while two gateway instances keep serving, then restarted on the same directory. What was settled before
comes back from the AOF; what was served during the outage was queued and is replayed, once; and while Redis was
away each instance spent only its share of what remained."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pytest

from gateway.config import hash_key
from tests.gateway_fixtures import config, sglang_pool, start_gateway
from tests.support import RedisServer, start_sims, wait_until

ADMIN = "admin-durability-token"
PER_TOKEN = {"type": "per_token", "input_per_mtok": 1.0, "cached_input_per_mtok": 0.2, "output_per_mtok": 3.2}


def tenant(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "api_key_hashes": [hash_key(f"sk-{name}")], "models": ["glm-5.2"], **kw}


def cost(u: dict[str, Any]) -> float:
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (u["prompt_tokens"] - cached) * 1e-6 + cached * 0.2e-6 + u["completion_tokens"] * 3.2e-6


def ask(gw: Any, name: str, i: int) -> tuple[int, dict[str, Any]]:
    body = {"model": "glm-5.2", "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{name} {i:04d} " + "y" * 400}]}
    r = httpx.post(gw.urls[0] + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer sk-{name}"},
                   timeout=30)
    return r.status_code, r.json()


def usage(gw: Any, name: str) -> dict[str, Any]:
    r = httpx.get(gw.admin_url + f"/admin/usage?tenant={name}", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    return r.json()["tenants"][name]["day"]


@pytest.fixture(scope="module")
def fleet():
    sims, reps = start_sims(2, time_scale=200.0)
    yield sims, reps
    sims.stop()


def test_redis_crash_and_restart_the_ledger_equals_all_spend_served(fleet, caplog):
    sims, _ = fleet
    srv = RedisServer(appendonly=True)
    worst = 140e-6 + 4 * 3.2e-6  # a generous bound on one request's cost (~110 prompt tokens, 4 out)
    cap = 10 * worst
    cfg = config([{**sglang_pool("p", sims.urls), "pricing": PER_TOKEN}],
                 tenants=[tenant("open", budget={"usd_per_day": 100.0}), tenant("capped", budget={"usd_per_day": cap}),
                          tenant("rated", rate_limits={"requests_per_minute": 20})],
                 admin={"token_hashes": [hash_key(ADMIN)]},
                 routing={"redis_url": srv.url, "redis_prefix": "dur:"},
                 # reservations at the gateway's own prompt count (the simulator counts exactly as the gateway does):
                 # the shares below are sized in those requests
                 usage_bounds={"prompt_factor": 1.0, "prompt_slack_tokens": 0})
    a, b = start_gateway(cfg), start_gateway(cfg)
    gws = (a, b)
    caplog.set_level(logging.WARNING)
    served: dict[str, list[float]] = {"open": [], "capped": []}
    try:
        # each instance learns that it has one peer (its share of a budget while Redis is away: a half)
        wait_until(lambda: all(g.call(lambda g=g: g.app.state.gateway.budget.share.instances) == 2 for g in gws),
                   timeout=5, what="both instances to count each other")
        for i in range(4):
            for name in ("open", "capped"):
                status, body = ask(gws[i % 2], name, i)
                assert status == 200
                served[name].append(cost(body["usage"]))
        wait_until(lambda: usage(a, "open")["requests"] == 4 and usage(a, "capped")["requests"] == 4, what="settled")
        assert usage(a, "capped")["spent_usd"] == pytest.approx(sum(served["capped"]), rel=1e-9)
        time.sleep(1.2)  # appendfsync everysec: what was written a second ago is on disk

        srv.kill(hard=True)
        during = {"open": 0, "capped": [0, 0]}
        for i in range(10):  # the outage: every request still served, the open tenant's spend queued
            status, body = ask(gws[i % 2], "open", 100 + i)
            assert status == 200
            served["open"].append(cost(body["usage"]))
            during["open"] += 1
        for i in range(16):  # the capped tenant: only each instance's share of the remaining budget
            status, body = ask(gws[i % 2], "capped", 100 + i)
            assert status in (200, 429)
            if status == 200:
                served["capped"].append(cost(body["usage"]))
                during["capped"][i % 2] += 1
            else:
                assert body["error"]["code"] == "insufficient_quota"
        assert all(n >= 1 for n in during["capped"]) and sum(during["capped"]) < 16
        assert sum(served["capped"]) <= cap  # the shares held the cap without Redis
        t0, rated = time.monotonic(), [0, 0]
        for i in range(30):  # 20/min shared by two instances: each admits its half, not a whole minute's worth
            status, body = ask(gws[i % 2], "rated", i)
            assert status in (200, 429)
            rated[i % 2] += status == 200
        assert all(10 <= n <= 10 + (time.monotonic() - t0) * 10 / 60 + 1 for n in rated), rated
        assert any(getattr(r, "fields", {}).get("event") == "redis_away" and r.fields["what"] == "budgets"
                   for r in caplog.records)  # the on-call's line: budgets fell back to this instance
        assert sum(g.call(lambda g=g: len(g.app.state.gateway.budget.pending)) for g in gws) >= 10

        srv.start()  # same directory: the AOF brings back what was settled before the crash
        for name in ("open", "capped"):
            wait_until(lambda name=name: all(usage(g, name)["requests"] == len(served[name])
                                             and usage(g, name)["pending_settlements"] == 0 for g in gws),
                       timeout=10, what=f"{name}: the queued settlements replayed")
            day = usage(b, name)
            assert day["spent_usd"] == pytest.approx(sum(served[name]), rel=1e-9)
            assert day["reserved_usd"] == pytest.approx(0, abs=1e-12)
        assert sum(g.call(lambda g=g: g.app.state.gateway.budget.replayed) for g in gws) >= 10
        time.sleep(1.5)  # another replay round: nothing counted twice
        assert usage(a, "open")["spent_usd"] == pytest.approx(sum(served["open"]), rel=1e-9)
    finally:
        a.stop()
        b.stop()
        srv.stop()


def test_without_persistence_a_restart_forgets_the_ledger(fleet):
    """The contrast that makes the deploy stack's AOF necessary: the same restart on a Redis without persistence
    starts every budget from zero."""
    sims, _ = fleet
    srv = RedisServer(appendonly=False)
    cfg = config([{**sglang_pool("p", sims.urls), "pricing": PER_TOKEN}],
                 tenants=[tenant("open", budget={"usd_per_day": 100.0})], admin={"token_hashes": [hash_key(ADMIN)]},
                 routing={"redis_url": srv.url, "redis_prefix": "dur:"})
    gw = start_gateway(cfg)
    try:
        assert ask(gw, "open", 1)[0] == 200
        wait_until(lambda: usage(gw, "open")["requests"] == 1, what="settled")
        srv.kill()
        srv.start()
        wait_until(lambda: usage(gw, "open").get("shared", True), timeout=5, what="Redis answering again")
        assert usage(gw, "open")["requests"] == 0
    finally:
        gw.stop()
        srv.stop()
