"""A streamed request's trace exported over OTLP/HTTP, as a collector receives it: the gateway configured with
`observability.tracing_exporter: otlp` and the standard OTEL_EXPORTER_OTLP_ENDPOINT, a loopback sink taking
`POST /v1/traces` (protobuf). The request span (SERVER, GenAI attributes) and its attempt span (CLIENT child) arrive."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from openai import OpenAI

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the `otlp` extra is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class Sink:
    """A minimal OTLP/HTTP trace receiver on loopback: keeps every decoded export request."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[tuple[str, str]] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's method name
                body = self.rfile.read(int(self.headers["content-length"]))
                sink.paths.append((self.path, self.headers.get("content-type", "")))
                msg = ExportTraceServiceRequest()
                msg.ParseFromString(body)
                sink.requests.append(msg)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[dict[str, Any], Span]]:
        """(resource attributes, span) for every span received."""
        out = []
        for req in self.requests:
            for rs in req.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                out += [(resource, s) for ss in rs.scope_spans for s in ss.spans]
        return out

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def attrs(span: Span) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in span.attributes}


def test_one_streamed_request_reaches_an_otlp_collector_with_its_attempt_span(monkeypatch):
    sink = Sink()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", sink.url)  # the exporter posts to <endpoint>/v1/traces
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s rather than at shutdown
    sims, _ = start_sims(1, enable_cache_report=True)
    cfg = config([sglang_pool("p", sims.urls, model="zai-org/GLM-5.2")], health={"enabled": False},
                 observability={"tracing_exporter": "otlp", "service_name": "gw-otlp-test"})
    gw = start_gateway(cfg)
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        stream = c.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=4, stream=True, stream_options={"include_usage": True})
        usage = [ch.usage for ch in stream if ch.usage is not None][-1]
        wait_until(lambda: any(s.kind == Span.SPAN_KIND_SERVER for _, s in sink.spans()), timeout=15,
                   what="the request span at the sink")
    finally:
        gw.stop()  # flushes anything still queued
        sims.stop()
        sink.stop()
    assert {p for p, _ in sink.paths} == {"/v1/traces"} and all(ct == "application/x-protobuf" for _, ct in sink.paths)
    spans = sink.spans()
    (resource, server), = [(r, s) for r, s in spans if s.kind == Span.SPAN_KIND_SERVER]
    assert resource["service.name"] == "gw-otlp-test"
    assert server.name == "chat glm-5.2" and server.status.code != server.status.STATUS_CODE_ERROR
    a = attrs(server)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "glm-5.2"
    assert a["gen_ai.provider.name"] == "sglang" and a["gen_ai.response.model"] == "zai-org/GLM-5.2"  # as served
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert "gen_ai.usage.cache_read.input_tokens" in a and a["gateway.replica"] == "p-0"
    attempts = [s for _, s in spans if s.kind == Span.SPAN_KIND_CLIENT]
    assert len(attempts) == 1
    attempt = attempts[0]
    assert attempt.trace_id == server.trace_id and attempt.parent_span_id == server.span_id  # a child of the request
    b = attrs(attempt)
    assert b["gen_ai.request.model"] == "zai-org/GLM-5.2" and b["http.response.status_code"] == 200
    assert b["gateway.replica"] == "p-0" and b["server.address"] == "127.0.0.1"
