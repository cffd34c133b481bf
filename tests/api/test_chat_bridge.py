"""The Responses and Messages bridges run the chat path's stages unchanged (issue 15: tenancy, limits, budgets,
metrics, traces and the decision log apply): each bridged request is charged to its tenant's budget, has a request
span with one attempt span under it, and lands in the decision log with its routing explanation; a spent budget
refuses each API in its own error shape. Over HTTP through the official SDKs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, start_sims, wait_until

ADMIN = {"authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def sims() -> Iterator[ServerThread]:
    s, _ = start_sims(1)
    yield s
    s.stop()


def _gateway(sims: ServerThread, usd_per_day: float, exporter: InMemorySpanExporter | None = None) -> Any:
    cfg = config([sglang_pool("p", sims.urls)], admin={"token_hashes": [hash_key("admin-secret")]},
                 tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"],
                           "budget": {"usd_per_day": usd_per_day}}])
    return start_gateway(cfg, span_exporter=exporter) if exporter else start_gateway(cfg)


def _day(gw: Any) -> dict[str, Any]:
    r = httpx.get(gw.admin_url + "/admin/usage?tenant=tenant-a", headers=ADMIN)
    return r.json()["tenants"]["tenant-a"]["day"]  # type: ignore[no-any-return]


def test_bridged_requests_are_charged_traced_and_logged(sims: ServerThread) -> None:
    exporter = InMemorySpanExporter()
    gw = _gateway(sims, 100.0, exporter)
    try:
        r = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0).responses.create(
            model="glm-5.2", input="hello from the responses api " * 20, max_output_tokens=4)
        m = anthropic.Anthropic(base_url=gw.urls[0], api_key=KEY_A, max_retries=0).messages.create(
            model="glm-5.2", max_tokens=4, messages=[{"role": "user", "content": "hello from the messages api " * 20}])
        assert r.status in ("completed", "incomplete") and m.stop_reason in ("max_tokens", "end_turn")
        wait_until(lambda: _day(gw)["requests"] == 2, what="both bridged requests settled")
        day = _day(gw)
        assert day["spent_usd"] > 0 and day["reserved_usd"] == pytest.approx(0, abs=1e-12)
        assert day["prompt_tokens"] >= r.usage.input_tokens + m.usage.input_tokens > 0

        log = httpx.get(gw.admin_url + "/admin/decisions?limit=10", headers=ADMIN).json()["decisions"]
        assert len(log) == 2 and all(d["status"] == "200" and d["served_by"] == "p-0" for d in log)
        assert all(d["decision"]["chosen"] == "p-0" and d["decision"]["candidates"] for d in log)

        wait_until(lambda: len([s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]) >= 2,
                   what="the request spans", timeout=15)
        spans = exporter.get_finished_spans()
        servers = [s for s in spans if s.kind == SpanKind.SERVER]
        clients = [s for s in spans if s.kind == SpanKind.CLIENT]
        assert len(servers) == 2 and len(clients) == 2
        for srv in servers:  # each bridged request: one attempt span under its request span
            kids = [c for c in clients if c.parent is not None and c.parent.span_id == srv.context.span_id]
            assert len(kids) == 1 and kids[0].attributes is not None and kids[0].attributes["gateway.replica"] == "p-0"
    finally:
        gw.stop()


def test_a_spent_budget_refuses_each_bridge_in_its_own_shape(sims: ServerThread) -> None:
    """A budget below one request's worst-case cost: refused before any upstream work, 429 in both APIs' shapes."""
    gw = _gateway(sims, 1e-9)
    try:
        with pytest.raises(openai.RateLimitError) as oe:
            OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0).responses.create(
                model="glm-5.2", input="hi", max_output_tokens=4)
        assert oe.value.status_code == 429 and oe.value.code == "insufficient_quota"
        with pytest.raises(anthropic.RateLimitError) as ae:
            anthropic.Anthropic(base_url=gw.urls[0], api_key=KEY_A, max_retries=0).messages.create(
                model="glm-5.2", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        body = ae.value.body
        assert ae.value.status_code == 429 and isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "rate_limit_error" and "budget" in body["error"]["message"]
        assert _day(gw)["requests"] == 0 and _day(gw)["spent_usd"] == 0
    finally:
        gw.stop()
