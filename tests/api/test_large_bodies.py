"""Large bodies (real gateway over loopback, simulated SGLang replicas): each API has its own body limit, and the
CPU steps of a large body run on the bounded pool — served while the event loop answers everything else, refused
with a 503 in the API's own shape while the pool is full."""

from __future__ import annotations

import asyncio
import sys
import threading

import httpx
import orjson
import pytest

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until

AUTH = {"authorization": f"Bearer {KEY_A}"}


def chat(size: int) -> bytes:
    return orjson.dumps({"model": "glm-5.2", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * size}]})


def responses(size: int) -> bytes:
    return orjson.dumps({"model": "glm-5.2", "max_output_tokens": 4, "store": False, "input": "y" * size})


def messages(size: int) -> bytes:
    return orjson.dumps({"model": "glm-5.2", "max_tokens": 4, "messages": [{"role": "user", "content": "z" * size}]})


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(1)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], max_body_bytes=16_384,
                              body_limits={"responses": 200_000, "messages": 100_000},
                              offload={"min_body_bytes": 8192, "threads": 1, "max_queued": 1}))
    yield gw
    gw.stop()
    sims.stop()


def post(gw, path: str, body: bytes) -> httpx.Response:
    return httpx.post(gw.urls[0] + path, content=body, headers=AUTH, timeout=30)


def test_each_api_has_its_own_body_limit(stack):
    """Raising the Responses and Messages limits leaves chat/completions at `max_body_bytes`: one API's large
    histories do not open every API to large bodies; each refusal is a 413 in its API's shape."""
    assert post(stack, "/v1/responses", responses(150_000)).status_code == 200
    assert post(stack, "/v1/messages", messages(80_000)).status_code == 200
    r = post(stack, "/v1/chat/completions", chat(20_000))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post(stack, "/v1/responses", responses(250_000))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post(stack, "/v1/messages", messages(120_000))
    assert r.status_code == 413 and r.json()["type"] == "error"


def test_large_body_steps_run_on_the_pool_and_a_full_pool_answers_503(stack):
    """While the pool's one slot is held, the event loop still answers probes and small requests (their steps run
    inline; the GIL switch interval is shortened meanwhile), and a large body is refused at once with 503 +
    Retry-After (529 in Anthropic's shape) instead of queueing; once the slot is free the same large body is served,
    its steps counted as offloaded."""
    st = stack.app.state.gateway
    idle = sys.getswitchinterval()
    release = threading.Event()
    held = stack.call(lambda: asyncio.ensure_future(st.cpu.run(1 << 20, release.wait, 30)))
    try:
        wait_until(lambda: stack.call(lambda: st.cpu.queued) == 1, what="the pool's slot held")
        assert sys.getswitchinterval() == pytest.approx(0.001)  # offload.switch_interval_ms while steps run        assert httpx.get(stack.urls[0] + "/healthz", timeout=5).status_code == 200
        assert post(stack, "/v1/chat/completions", chat(100)).status_code == 200  # small: inline
        r = post(stack, "/v1/chat/completions", chat(10_000))
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        assert "retry-after" in r.headers
        r = post(stack, "/v1/responses", responses(10_000))
        assert r.status_code == 503 and "retry-after" in r.headers
        r = post(stack, "/v1/messages", messages(10_000))
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    finally:
        release.set()
    wait_until(lambda: held.done() and stack.call(lambda: st.cpu.queued) == 0, what="the slot released")
    assert sys.getswitchinterval() == idle  # the interpreter's own again once idle
    before = st.metrics.offload_steps.labels("offloaded")._value.get()
    assert post(stack, "/v1/chat/completions", chat(10_000)).status_code == 200
    assert st.metrics.offload_steps.labels("offloaded")._value.get() >= before + 3  # parse, validate, hash
    assert st.metrics.offload_steps.labels("refused")._value.get() == 3
