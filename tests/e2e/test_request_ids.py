"""What keys money and slots is the gateway's own id, never the client's x-request-id (issue: 300 requests reusing
one id against a $0.01 budget were all served and the ledger recorded one; 100 concurrent ones passed a fleet cap of
5 31 times; tenant B reusing A's id was served and never billed).

Two gateway instances share one real Redis in front of a hosted fake provider that reports a fixed usage, so each
served request costs exactly COST. Every request below sends the same x-request-id. The invariants: the ledger counts
every request served and bills every one of them; spend stays within the cap (plus one in-flight worst case per
instance); a fleet-wide concurrency cap is never passed; another tenant reusing the id is billed to itself."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import redis

from gateway.config import hash_key
from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import config, start_gateway
from tests.support import ServerThread, wait_until

SAME_ID = "client-chosen-id-1"
IN, OUT = 1.0, 1000.0  # $/Mtok: the fake's usage (7 prompt, 3 completion) costs ~$0.003, a reservation ~$0.0036
COST = (7 * IN + 3 * OUT) / 1e6
CAP = 0.5  # fits ~140 reservations at once, ~166 requests' cost in sequence: well under the 300 sent
KEYS = {t: f"sk-ids-{t}" for t in ("seq", "burst", "conc", "a", "b")}
BODY = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def ids_config(hosted_url: str, redis_url: str, prefix: str) -> dict[str, Any]:
    policies = {"seq": {"budget": {"usd_per_day": CAP}},
                "burst": {"budget": {"usd_per_day": CAP}},
                "conc": {"max_concurrent": 5, "max_concurrent_scope": "fleet"},
                "a": {}, "b": {}}
    tenants = [{"name": t, "api_key_hashes": [hash_key(KEYS[t])], "models": ["glm-5.2"], **extra}
               for t, extra in policies.items()]
    cfg = config([{"name": "h", "kind": "openai", "model": "hosted-glm", "base_url": hosted_url + "/v1",
                   "pricing": {"type": "per_token", "input_per_mtok": IN, "output_per_mtok": OUT}}], tenants=tenants)
    cfg["routing"] = {"redis_url": redis_url, "redis_prefix": prefix}
    return cfg


@pytest.fixture
def fleet(redis_server):
    fake = FakeOpenAI()
    up = ServerThread([fake.app()]).start()
    prefix = f"ids{time.monotonic_ns()}:"
    cfg = ids_config(up.urls[0], redis_server.url, prefix)
    gws = [start_gateway(cfg), start_gateway(cfg)]
    r = redis.Redis.from_url(redis_server.url)
    yield fake, [g.urls[0] for g in gws], r, prefix
    for g in gws:
        g.stop()
    up.stop()
    r.close()


def ledger(r: redis.Redis, prefix: str, tenant: str) -> tuple[int, float, float]:
    """(requests, spent, reserved) in today's period, as Redis holds them."""
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    h = {k.decode(): v.decode() for k, v in r.hgetall(f"{prefix}budget:{tenant}:{day}").items()}
    return int(h.get("requests", 0)), float(h.get("spent", 0.0)), float(h.get("reserved", 0.0))


async def send_all(urls: list[str], tenant: str, n: int, concurrent: bool) -> list[httpx.Response]:
    headers = {"authorization": f"Bearer {KEYS[tenant]}", "x-request-id": SAME_ID}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n), headers=headers) as c:
        if concurrent:
            return list(await asyncio.gather(*(c.post(urls[i % 2] + "/v1/chat/completions", json=BODY)
                                               for i in range(n))))
        return [await c.post(urls[i % 2] + "/v1/chat/completions", json=BODY) for i in range(n)]


def served(responses: list[httpx.Response]) -> int:
    assert {r.status_code for r in responses} <= {200, 429}, {r.status_code for r in responses}
    assert all(r.headers["x-request-id"] == SAME_ID for r in responses)  # echoed: a correlation field
    return sum(r.status_code == 200 for r in responses)


def worst_case() -> float:
    """One request's reservation: its usage bound (the prompt tokens an upstream may claim for it, max_tokens of
    output), no cache hit."""
    from gateway.config import UsageBounds
    from gateway.pipeline.usage import bound_for
    from gateway.pipeline.validation import validate

    u, p = UsageBounds(), validate(dict(BODY), "chat/completions")
    b = bound_for(BODY, p.prompt_tokens, p.max_output_tokens, None, u.prompt_factor, u.prompt_slack_tokens,
                  u.media_tokens, u.max_output_tokens)
    return (b.prompt * IN + b.completion * OUT) / 1e6


def test_sequential_reuse_of_one_id_is_billed_for_every_request(fleet):
    fake, urls, r, prefix = fleet
    responses = asyncio.run(send_all(urls, "seq", 300, concurrent=False))
    n = served(responses)
    wait_until(lambda: ledger(r, prefix, "seq")[0] == n, timeout=10, what="every served request in the ledger")
    requests, spent, _ = ledger(r, prefix, "seq")
    print(f"sequential: {n} served of 300, ledger {requests} requests ${spent:.4f}, cap ${CAP:.2f}")
    assert 100 < n < 300  # the cap stopped it: the budget is not bypassed by the reused id
    assert spent == pytest.approx(n * COST)
    assert spent <= CAP + 1e-9
    refused = [x for x in responses if x.status_code == 429]
    assert all(x.json()["error"]["code"] == "insufficient_quota" for x in refused)
    upstream_ids = [h["x-request-id"] for h in fake.headers]
    assert len(set(upstream_ids)) == len(upstream_ids) == n and SAME_ID not in upstream_ids  # minted per request


def test_concurrent_reuse_of_one_id_keeps_the_budget(fleet):
    fake, urls, r, prefix = fleet
    fake.delay = 0.3  # every request of the burst is in flight together
    responses = asyncio.run(send_all(urls, "burst", 300, concurrent=True))
    n = served(responses)
    wait_until(lambda: ledger(r, prefix, "burst")[0] == n, timeout=10, what="every served request in the ledger")
    requests, spent, reserved = ledger(r, prefix, "burst")
    print(f"concurrent: {n} served of 300, ledger {requests} requests ${spent:.4f} (reserved ${reserved:.4f}), "
          f"cap ${CAP:.2f}")
    assert 100 < n < 300
    assert spent == pytest.approx(n * COST)
    assert spent <= CAP + 2 * worst_case() + 1e-9  # the cap, plus one in-flight worst case per instance
    wait_until(lambda: ledger(r, prefix, "burst")[2] < 1e-9, what="every reservation released")


def test_concurrent_reuse_of_one_id_cannot_pass_a_fleet_cap(fleet):
    fake, urls, r, prefix = fleet
    fake.delay = 1.0  # longer than the burst takes to arrive
    responses = asyncio.run(send_all(urls, "conc", 300, concurrent=True))
    n = served(responses)
    print(f"fleet cap 5: {n} served of 300, at most {fake.max_inflight} at once upstream")
    assert fake.max_inflight == 5  # the cap, exactly: neither passed nor starved by the shared id
    wait_until(lambda: ledger(r, prefix, "conc")[0] == n, timeout=10, what="every served request in the ledger")
    wait_until(lambda: r.zcard(f"{prefix}conc:conc") == 0, what="every fleet slot released")


def test_another_tenant_reusing_an_id_is_billed_to_itself(fleet):
    _, urls, r, prefix = fleet
    for tenant in ("a", "b"):
        assert served(asyncio.run(send_all(urls, tenant, 1, concurrent=False))) == 1
    for tenant in ("a", "b"):
        wait_until(lambda tenant=tenant: ledger(r, prefix, tenant)[0] == 1, what=f"tenant {tenant} billed")
        assert ledger(r, prefix, tenant)[1] == pytest.approx(COST)
