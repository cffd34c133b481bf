"""Traces carry GenAI attribute names; no key or prompt text reaches logs, metrics or traces."""

import logging

import httpx
from openai import OpenAI
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until

SECRET_PROMPT = "my confidential prompt about project nightingale"


def test_spans_logs_and_metrics_hold_no_secrets():
    sims, _ = start_sims(1)
    exporter = InMemorySpanExporter()
    gw = start_gateway(config([sglang_pool("p", sims.urls)]), span_exporter=exporter)
    records = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("gateway.requests")
    h = Grab()
    logger.addHandler(h)
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        c.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": SECRET_PROMPT}], max_tokens=3)
        list(c.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": SECRET_PROMPT}],
                                       max_tokens=3, stream=True))
        # a stream is accounted (log line, span end) when the response closes, which may be after the client
        # read [DONE]: wait for it rather than race it
        wait_until(lambda: len(records) == 2, what="both requests accounted")
        gw.call(lambda: gw.app.state.gateway.tracer_provider.force_flush())
        spans = exporter.get_finished_spans()
        server = [s for s in spans if s.kind == SpanKind.SERVER]  # one per request; attempt spans are its children
        assert len(server) == 2
        attrs = dict(server[0].attributes)
        assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "glm-5.2"
        assert attrs["gen_ai.usage.output_tokens"] == 3 and attrs["gen_ai.usage.input_tokens"] > 0
        # per the GenAI conventions: the provider, the model as served (not the client's alias), cache reads
        assert attrs["gen_ai.provider.name"] == "sglang" and attrs["gen_ai.response.model"] == "zai-org/GLM-5.2"
        assert attrs["gen_ai.request.max_tokens"] == 3 and "gen_ai.usage.cache_read.input_tokens" in attrs
        assert server[0].status.status_code == StatusCode.UNSET
        metrics = httpx.get(gw.admin_url + "/metrics").text
        everything = " ".join(records) + str([dict(s.attributes) for s in spans]) + metrics
        assert len(records) == 2 and '"status":"200"' in records[0]
        assert KEY_A not in everything and "nightingale" not in everything
    finally:
        logger.removeHandler(h)
        gw.stop()
        sims.stop()
