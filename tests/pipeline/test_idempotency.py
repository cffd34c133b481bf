"""`Idempotency-Key` (pipeline/idempotency.py): the client's explicit key, per tenant. A repeat of a request that was
served gets its outcome again, not a second serving and a second bill; a repeat while it runs is a 409, with another
body a 422; a request that failed keeps nothing. Real gateways over loopback in front of a fake hosted provider that
counts what it serves; two instances share keys through a real Redis."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from gateway.config import hash_key
from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import KEY_A, KEY_B, config, start_gateway
from tests.support import ServerThread, wait_until

BODY = {"model": "glm-5.2", "messages": [{"role": "user", "content": "charge my card once"}], "max_tokens": 3}


def tenants() -> list[dict]:
    return [{"name": n, "api_key_hashes": [hash_key(k)], "models": ["glm-5.2"], "budget": {"usd_per_day": 100.0}}
            for n, k in (("tenant-a", KEY_A), ("tenant-b", KEY_B))]


def pool(url: str) -> dict:
    return {"name": "h", "kind": "openai", "model": "m", "base_url": url + "/v1",
            "pricing": {"type": "per_token", "input_per_mtok": 1.0, "output_per_mtok": 1.0}}


@pytest.fixture
def stack():
    fake = FakeOpenAI()
    up = ServerThread([fake.app()]).start()
    gw = start_gateway(config([pool(up.urls[0])], tenants=tenants()))
    yield fake, gw
    gw.stop()
    up.stop()


def post(gw: ServerThread, key: str | None, body: dict = BODY, api_key: str = KEY_A) -> httpx.Response:
    headers = {"authorization": f"Bearer {api_key}", **({"idempotency-key": key} if key else {})}
    return httpx.post(gw.urls[0] + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def requests_billed(gw: ServerThread, tenant: str) -> int:
    st = gw.app.state.gateway
    return int(asyncio.run_coroutine_threadsafe(st.budget.usage(tenant), gw.loop).result(5)["day"]["requests"])


def test_a_repeat_gets_the_first_answer_and_is_neither_served_nor_billed_again(stack):
    fake, gw = stack
    first = post(gw, "order-42")
    wait_until(lambda: requests_billed(gw, "tenant-a") == 1, what="the first billed")
    again = post(gw, "order-42")
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert again.headers["x-gateway-cost-usd"] == first.headers["x-gateway-cost-usd"]
    assert len(fake.bodies) == 1
    assert post(gw, None).status_code == 200  # a request settled after the replay would have been: a barrier
    wait_until(lambda: requests_billed(gw, "tenant-a") >= 2, what="the barrier billed")
    assert requests_billed(gw, "tenant-a") == 2  # the first and the barrier; the replay never was
    same_order_other_body = post(gw, "order-42", {**BODY, "max_tokens": 4})
    assert same_order_other_body.status_code == 422
    assert same_order_other_body.json()["error"]["code"] == "idempotency_key_reused"
    other_tenant = post(gw, "order-42", api_key=KEY_B)  # keys are per tenant
    assert other_tenant.status_code == 200 and "idempotent-replayed" not in other_tenant.headers
    assert len(fake.bodies) == 3
    without = [post(gw, None) for _ in range(2)]  # no key: every request is its own (x-request-id is no key)
    assert all(r.status_code == 200 for r in without) and len(fake.bodies) == 5


def test_a_repeat_while_the_first_runs_is_409_and_a_failed_first_keeps_nothing(stack):
    fake, gw = stack
    fake.delay = 1.0
    first: list[httpx.Response] = []
    t = threading.Thread(target=lambda: first.append(post(gw, "slow-1")))
    t.start()
    wait_until(lambda: len(fake.bodies) == 1, what="the first at the provider")
    during = post(gw, "slow-1")
    t.join(30)
    assert during.status_code == 409 and during.json()["error"]["code"] == "idempotency_key_in_use"
    assert first[0].status_code == 200
    fake.delay = 0.0
    fake.status = 500
    assert post(gw, "fails-1").status_code == 502
    fake.status = 200
    retry = post(gw, "fails-1")  # the failure kept nothing: served now
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    assert post(gw, "x" * 256).status_code == 400


def test_a_completed_stream_is_replayed_as_the_events_it_sent(stack):
    fake, gw = stack
    body = {**BODY, "stream": True, "stream_options": {"include_usage": True}}

    def stream() -> tuple[httpx.Response, bytes]:
        with httpx.stream("POST", gw.urls[0] + "/v1/chat/completions", json=body, timeout=30,
                          headers={"authorization": f"Bearer {KEY_A}", "idempotency-key": "stream-1"}) as r:
            return r, b"".join(r.iter_bytes())

    r1, data1 = stream()
    wait_until(lambda: requests_billed(gw, "tenant-a") == 1, what="the stream settled")
    r2, data2 = stream()
    assert r1.status_code == r2.status_code == 200 and data2 == data1 and data1.endswith(b"data: [DONE]\n\n")
    assert r2.headers["idempotent-replayed"] == "true" and len(fake.bodies) == 1


def test_keys_are_shared_by_instances_on_redis(redis_server):
    fake = FakeOpenAI()
    up = ServerThread([fake.app()]).start()
    cfg = config([pool(up.urls[0])], tenants=tenants(),
                 routing={"redis_url": redis_server.url, "redis_prefix": f"idem{time.monotonic_ns()}:"})
    a, b = start_gateway(cfg), start_gateway(cfg)
    try:
        first = post(a, "shared-1")
        wait_until(lambda: post(b, "shared-1").headers.get("idempotent-replayed") == "true", what="the replay on B")
        assert post(b, "shared-1").json() == first.json() and len(fake.bodies) == 1
    finally:
        a.stop()
        b.stop()
        up.stop()


def test_the_bridged_apis_honour_the_key_too(stack):
    """/v1/messages and /v1/responses reach the chat path, key and all: a repeat is answered from the kept chat
    answer (translated again), not served twice."""
    fake, gw = stack
    h = {"authorization": f"Bearer {KEY_A}", "idempotency-key": "bridged-1"}
    msg = {"model": "glm-5.2", "max_tokens": 3, "messages": [{"role": "user", "content": "once"}]}
    first, again = (httpx.post(gw.urls[0] + "/v1/messages", json=msg, headers=h, timeout=30) for _ in range(2))
    assert first.status_code == again.status_code == 200
    assert again.json()["content"] == first.json()["content"] and len(fake.bodies) == 1
    h["idempotency-key"] = "bridged-2"
    body = {"model": "glm-5.2", "input": "once", "max_output_tokens": 3, "store": False}
    r1, r2 = (httpx.post(gw.urls[0] + "/v1/responses", json=body, headers=h, timeout=30) for _ in range(2))
    assert r1.status_code == r2.status_code == 200  # translated again: the bridge's own ids are new
    assert r2.json()["output"][0]["content"] == r1.json()["output"][0]["content"] and len(fake.bodies) == 2
