"""A budget reservation lives as long as its request. It used to carry a fixed deadline (`timeouts.total` + 60 s)
while `total` bounds only the time to the first byte: a stream that outlived it lost its hold, and requests admitted
meanwhile passed the cap (1.82x with a $0.30 budget). Now a reservation is a lease its instance renews until the
request is settled; here the lease is 1 s and `total` 2 s, and one stream runs for several seconds past both."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import httpx
import pytest
import redis

from gateway.config import hash_key
from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import config, start_gateway
from tests.support import ServerThread, wait_until

KEY = "sk-lease"
IN, OUT = 1.0, 1000.0  # $/Mtok: a 300-token max output reserves ~$0.30; the fake's usage (7 + 3 tokens) ~$0.003
CAP = 0.35  # one such reservation fits, two do not


def test_a_stream_longer_than_the_request_timeout_keeps_its_reservation(redis_server):
    fake = FakeOpenAI()
    fake.words = ["w"] * 28
    fake.chunk_delay = 0.25  # ~7 s of stream
    up = ServerThread([fake.app()]).start()
    prefix = f"lease{time.monotonic_ns()}:"
    cfg = config([{"name": "h", "kind": "openai", "model": "hosted-glm", "base_url": up.urls[0] + "/v1",
                   "pricing": {"type": "per_token", "input_per_mtok": IN, "output_per_mtok": OUT}}],
                 tenants=[{"name": "long", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"],
                           "budget": {"usd_per_day": CAP}}],
                 timeouts={"connect": 1.0, "first_byte": 2.0, "idle": 5.0, "total": 2.0},
                 routing={"redis_url": redis_server.url, "redis_prefix": prefix, "budget_lease_s": 1.0})
    gw = start_gateway(cfg)
    r = redis.Redis.from_url(redis_server.url)
    holds = f"{prefix}budget:long:{datetime.now(UTC).strftime('%Y-%m-%d')}:holds"
    body = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "stream": True}
    try:
        async def run() -> tuple[bytes, list[httpx.Response]]:
            headers = {"authorization": f"Bearer {KEY}"}
            async with httpx.AsyncClient(timeout=30, headers=headers) as c:
                async with c.stream("POST", gw.urls[0] + "/v1/chat/completions", json=body) as s:
                    assert s.status_code == 200
                    chunks = s.aiter_bytes()
                    data = await chunks.__anext__()
                    began = time.monotonic()
                    # past the request timeout plus two leases: a fixed deadline or an unrenewed lease is gone by now
                    await asyncio.sleep(max(0.0, began + 2.0 + 2 * 1.0 - time.monotonic()))
                    now_ms = int(time.time() * 1000)
                    assert r.zcount(holds, now_ms, "+inf") == 1  # still held, its deadline ahead
                    others = [await c.post(gw.urls[0] + "/v1/chat/completions", json={**body, "stream": False})
                              for _ in range(3)]
                    async for chunk in chunks:
                        data += chunk
            return data, others

        data, others = asyncio.run(run())
        assert b"data: [DONE]" in data  # the long stream was still running when the others were refused
        assert [o.status_code for o in others] == [429] * 3
        assert all(o.json()["error"]["code"] == "insufficient_quota" for o in others)
        day = f"{prefix}budget:long:{datetime.now(UTC).strftime('%Y-%m-%d')}"
        wait_until(lambda: r.hget(day, "requests") == b"1", what="the stream settled")
        spent = float(r.hget(day, "spent") or 0)
        assert spent == pytest.approx((7 * IN + 3 * OUT) / 1e6) and spent <= CAP
        assert r.zcard(holds) == 0  # released once settled, not renewed any longer
    finally:
        gw.stop()
        up.stop()
        r.close()
