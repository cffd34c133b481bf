"""The start's preflight: every server that answers has its facts (its incarnation above all) known before serving."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pytest
from openai import OpenAI

from gateway_lab.sim.profiles import for_version, profile
from gateway_lab.sim.replica import Replica
from gateway_lab.sim.server import create_sim_app
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, free_port, start_sims, wait_until


class NotReadyAtFirst:
    """An ASGI wrapper answering /server_info 503 for its first `for_s` seconds (a server still starting, or one
    too busy to answer the preflight in time)."""

    def __init__(self, app: Any, for_s: float) -> None:
        self.app, self.until = app, time.monotonic() + for_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/server_info" and time.monotonic() < self.until:
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self.app(scope, receive, send)


def _send(url: str, messages: list[dict[str, str]]) -> httpx.Headers:
    c = OpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
    r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=messages, max_tokens=2)
    return r.headers


def test_a_server_not_ready_at_the_start_is_asked_again_before_serving() -> None:
    """Left to the poll loop (a second later), the incarnation arrived after the first request had written its index
    entries under the unknown one, and they were dropped as a restart's: the next turn went cold (a CI run's
    flake). The start asks again within its bound, so the second turn finds the first's prefix."""
    cfg = for_version(profile("mi355x-glm52-tp4"), "0.5.23").with_overrides(
        time_scale=20.0, enable_cache_report=True, report_incarnation=True)
    slow = ServerThread([NotReadyAtFirst(create_sim_app(Replica(cfg, name="slow")), 0.6)]).start()
    try:
        gw = start_gateway(config([sglang_pool("p", slow.urls)]))
        try:
            target = gw.app.state.gateway.registry.servers()["p-0"][0]
            system = {"role": "system", "content": "the agent's long context " * 400}
            _send(gw.urls[0], [system, {"role": "user", "content": "turn 1"}])
            wait_until(lambda: httpx.get(slow.urls[0] + "/server_info").status_code == 200, what="the server ready")
            want = str(httpx.get(slow.urls[0] + "/server_info").json()["incarnation"])
            wait_until(lambda: target.incarnation == want, timeout=5, what="the poller to know the incarnation")
            h = _send(gw.urls[0], [system, {"role": "user", "content": "turn 2"}])
            assert h["x-gateway-route"] == "prefix_hit"
        finally:
            gw.stop()
    finally:
        slow.stop()


def test_a_refused_server_does_not_hold_the_start(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listening is down for sure: the start does not wait its bound out for it."""
    sims, _ = start_sims(1)
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        caplog.set_level(logging.WARNING, "gateway.engine")
        gw = start_gateway(config([sglang_pool("p", [sims.urls[0], dead])]))
        try:
            want = str(httpx.get(sims.urls[0] + "/server_info").json()["incarnation"])
            assert gw.app.state.gateway.registry.servers()["p-0"][0].incarnation == want
            assert not any("took over" in r.getMessage() for r in caplog.records)
        finally:
            gw.stop()
    finally:
        sims.stop()
