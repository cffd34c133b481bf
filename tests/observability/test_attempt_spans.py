"""One CLIENT span per upstream attempt, a child of the request span, and W3C traceparent sent upstream."""

import openai
import pytest
from openai import OpenAI
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, start_sims, wait_until


def test_attempt_spans_and_traceparent():
    """A request served by an SGLang replica and one failed by the hosted pool (500): each has one CLIENT attempt
    span under its request span (status 200; error status and type), and the upstream saw a traceparent naming its
    attempt span."""
    fake = FakeOpenAI()
    fake.status = 500
    hosted = ServerThread([fake.app()]).start()
    sims, _ = start_sims(1)
    exporter = InMemorySpanExporter()
    pools = [{"name": "hosted", "kind": "openai", "model": "hosted-glm", "base_url": hosted.urls[0] + "/v1"},
             sglang_pool("p", sims.urls)]
    gw = start_gateway(config(pools, health={"enabled": False}, routing={"policy": "round_robin"}), span_exporter=exporter)
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        msg = [{"role": "user", "content": "hi"}]
        c.chat.completions.with_raw_response.create(model="glm-5.2", messages=msg, max_tokens=2,
                                                    extra_headers={"x-gateway-pool": "p"})
        with pytest.raises(openai.InternalServerError):  # the hosted pool answers 500
            c.chat.completions.create(model="glm-5.2", messages=msg, max_tokens=2, extra_headers={"x-gateway-pool": "hosted"})
        wait_until(lambda: len([s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]) >= 2,
                   what="request spans", timeout=15)
        spans = exporter.get_finished_spans()
        servers = [s for s in spans if s.kind == SpanKind.SERVER]
        clients = [s for s in spans if s.kind == SpanKind.CLIENT]
        assert len(clients) == 2
        for srv in servers:  # each request's attempt span is its child
            kids = [s for s in clients if s.parent is not None and s.parent.span_id == srv.context.span_id]
            assert len(kids) == 1 and kids[0].context.trace_id == srv.context.trace_id
        ok = next(s for s in clients if s.attributes["gateway.pool"] == "p")
        assert ok.attributes["server.address"] == "127.0.0.1" and ok.attributes["gateway.replica"] == "p-0"
        assert ok.attributes["http.response.status_code"] == 200 and ok.status.status_code != StatusCode.ERROR
        bad = next(s for s in clients if s.attributes["gateway.pool"] == "hosted")
        assert bad.status.status_code == StatusCode.ERROR and bad.attributes["error.type"] == "500"
        assert bad.attributes["http.response.status_code"] == 500
        # the hosted upstream saw a W3C traceparent naming that attempt's span
        version, trace_id, span_id, _ = fake.headers[-1]["traceparent"].split("-")
        assert version == "00" and span_id == format(bad.context.span_id, "016x")
        assert trace_id == format(bad.context.trace_id, "032x")
    finally:
        gw.stop()
        sims.stop()
        hosted.stop()


def test_traceparent_reaches_an_sglang_server_over_the_lean_http_client():
    """SGLang pools go through backends/h1.py, not httpx: the same W3C traceparent names the attempt span there."""
    fake = FakeOpenAI()  # records the headers it receives; stands in for an SGLang server's /v1/chat/completions
    server = ServerThread([fake.app()]).start()
    exporter = InMemorySpanExporter()
    gw = start_gateway(config([sglang_pool("p", server.urls)], health={"enabled": False}), span_exporter=exporter)
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        for stream in (False, True):
            r = c.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          stream=stream)
            if stream:
                list(r)
        wait_until(lambda: len([s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT]) >= 2,
                   what="attempt spans", timeout=15)
        clients = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT]
        sent = {tuple(h["traceparent"].split("-")[1:3]) for h in fake.headers}
        assert sent == {(format(s.context.trace_id, "032x"), format(s.context.span_id, "016x")) for s in clients}
    finally:
        gw.stop()
        server.stop()
