"""The request path end to end (real gateway over loopback, simulated SGLang replicas, a fake hosted provider, the
openai SDK and raw sockets as clients): every request is counted and logged, whatever happened to it; the end of a
request releases shared state whatever failed; upstream usage cannot break a served response."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import httpx
import orjson
import pytest
from openai import OpenAI
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import hash_key
from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, start_sims, wait_until

HOSTED = {"name": "h", "kind": "openai", "model": "hosted-glm", "base_url": "",
          "pricing": {"type": "per_token", "input_per_mtok": 1.0, "cached_input_per_mtok": 0.2, "output_per_mtok": 3.0}}
SECRET = "confidential prompt about project nightingale"
MSG = [{"role": "user", "content": SECRET}]


def tenant(name: str, key: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "api_key_hashes": [hash_key(key)], "models": ["glm-5.2", "glm-hosted"], **kw}


def stack_config(sim_urls: list[str], hosted_url: str, **extra: Any) -> dict[str, Any]:
    return config(
        [sglang_pool("p", sim_urls), {**HOSTED, "base_url": hosted_url + "/v1"}],
        models=[{"name": "glm-5.2", "pools": ["p"]}, {"name": "glm-hosted", "pools": ["h"]}],
        tenants=[tenant("tenant-a", KEY_A),
                 tenant("limited", "sk-limited", rate_limits={"requests_per_minute": 1}),
                 tenant("shedder", "sk-shedder", ttft_sla_ms=0.001, on_sla_miss="shed")],
        max_body_bytes=4096, **extra)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(orjson.loads(record.getMessage()))


@pytest.fixture(scope="module")
def stack():
    sims, reps = start_sims(2)
    fake = FakeOpenAI()
    hosted = ServerThread([fake.app()]).start()
    spans = InMemorySpanExporter()
    gw = start_gateway(stack_config(sims.urls, hosted.urls[0], timeouts={"client_stall": 0.5}), span_exporter=spans)
    lines = Lines()
    logger = logging.getLogger("gateway.requests")
    logger.addHandler(lines)
    yield {"gw": gw, "sims": sims, "reps": reps, "fake": fake, "lines": lines, "url": gw.urls[0], "admin": gw.admin_url, "spans": spans}
    logger.removeHandler(lines)
    gw.stop()
    hosted.stop()
    sims.stop()


def metric(admin_url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(admin_url + "/metrics").text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def post(url: str, body: Any, key: str | None = KEY_A, path: str = "/v1/chat/completions", **headers: str) -> httpx.Response:
    h = {"content-type": "application/json", **headers}
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(url + path, content=content, headers=h, timeout=20)


def chat(model: str = "glm-5.2", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": MSG, "max_tokens": 3, **kw}


def loads_now(gw: Any) -> dict[str, Any]:
    st = gw.app.state.gateway
    names = [t.name for t in st.registry.targets]
    return asyncio.run_coroutine_threadsafe(st.loads.snapshot(names), gw.loop).result(5)


def idle(gw: Any) -> bool:
    return all(v.inflight == 0 and v.queued_prefill_tokens == 0 for v in loads_now(gw).values())


class Broken:
    """A metric that refuses every value, like a Prometheus counter handed a negative amount."""

    def labels(self, *a: Any) -> Broken:
        return self

    def inc(self, *a: Any) -> None:
        raise ValueError("Counters can only be incremented by non-negative amounts.")


def test_every_refusal_is_counted_with_a_reason_and_logged(stack):
    """On-call must see an auth storm or a client sending garbage: each kind of refusal shows in
    gateway_requests_total with its status and a bounded reason, and in one log line — never a key or prompt."""
    u, lines = stack["url"], stack["lines"]
    sent = {
        ("401", "auth"): post(u, chat(), key="sk-wrong-key-123"),
        ("404", "model_not_found"): post(u, chat(model="no-such-model-" + SECRET[:8])),
        ("400", "invalid_request"): post(u, {"model": "glm-5.2", "messages": "x"}),
        ("400", "malformed_json"): post(u, b'{"model": "glm-5.2", "messages": [' + SECRET.encode()),
        ("413", "body_too_large"): post(u, chat(messages=[{"role": "user", "content": SECRET * 200}])),
        ("403", "pool_not_allowed"): post(u, chat(), **{"x-gateway-pool": "h"}),
        ("503", "shed"): post(u, chat(), key="sk-shedder"),
    }
    post(u, chat(), key="sk-limited")
    sent[("429", "rate_limit")] = post(u, chat(), key="sk-limited")
    for (status, _), r in sent.items():
        assert str(r.status_code) == status, (status, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    wait_until(lambda: all(any(ln["request_id"] == r.headers["x-request-id"] for ln in lines.records)
                           for r in sent.values()), what="a log line per refusal")
    for (status, reason), r in sent.items():
        assert metric(stack["admin"], "gateway_requests_total", status=status, reason=reason) >= 1, (status, reason)
        line = next(ln for ln in lines.records if ln["request_id"] == r.headers["x-request-id"])
        assert (line["status"], line["reason"]) == (status, reason)
    unknown = [s for s in text_string_to_metric_families(httpx.get(stack["admin"] + "/metrics").text) if s.name == "gateway_requests"]
    models = {s.labels["model"] for s in unknown[0].samples}
    assert models <= {"glm-5.2", "glm-hosted", "unknown", "none"}  # client-chosen names never become label values
    everything = httpx.get(stack["admin"] + "/metrics").text + str(lines.records)
    assert "sk-wrong-key-123" not in everything and "nightingale" not in everything


def test_refusals_on_every_other_endpoint_are_counted_and_logged(stack):
    """Not only the chat path: a bad key on /v1/models, an unknown /v1 path, the Responses and Messages bridges
    (before they reach the chat path), malformed JSON there, and the admin API — each is counted with its status and
    reason and logged once, with no key in either. Chat-path refusals through a bridge are counted once, not twice."""
    u, lines = stack["url"], stack["lines"]
    bad = "sk-storm-key-0987"
    sent = {
        ("401", "auth", "v1/models"): httpx.get(u + "/v1/models", headers={"authorization": f"Bearer {bad}"}),
        ("401", "auth", "v1"): httpx.get(u + "/v1/nope", headers={"authorization": f"Bearer {bad}"}),
        ("404", "not_found", "v1"): httpx.get(u + "/v1/nope", headers={"authorization": f"Bearer {KEY_A}"}),
        ("401", "auth", "v1/responses"): post(u, {"model": "glm-5.2", "input": "x"}, key=bad, path="/v1/responses"),
        ("400", "invalid_request", "v1/responses"): post(u, b'{"model": ', path="/v1/responses"),
        ("400", "invalid_request", "v1/messages"): post(u, b'{"model": ', path="/v1/messages"),
        ("401", "auth", "v1/messages/count_tokens"): httpx.post(u + "/v1/messages/count_tokens", headers={"x-api-key": bad},
                                                               json={"model": "glm-5.2", "messages": []}),
        ("401", "auth", "admin"): httpx.get(stack["admin"] + "/admin/state", headers={"authorization": f"Bearer {bad}"}),
    }
    for (status, _, _), r in sent.items():
        assert str(r.status_code) == status, (status, r.text)
    wait_until(lambda: all(any(ln["request_id"] == r.headers["x-request-id"] for ln in lines.records)
                           for r in sent.values()), what="a log line per refusal")
    for (status, reason, endpoint), r in sent.items():
        line = [ln for ln in lines.records if ln["request_id"] == r.headers["x-request-id"]]
        assert len(line) == 1 and (line[0]["status"], line[0]["reason"], line[0]["endpoint"]) == (status, reason, endpoint)
        assert metric(stack["admin"], "gateway_requests_total", status=status, reason=reason) >= 1, (status, reason)
    # a refusal the chat path made for a bridged request (bad model) is logged once, by the chat path
    r = post(u, {"model": "no-such", "input": "x"}, path="/v1/responses")
    assert r.status_code == 404
    wait_until(lambda: any(ln["request_id"] == r.headers["x-request-id"] for ln in lines.records), what="its log line")
    assert len([ln for ln in lines.records if ln["request_id"] == r.headers["x-request-id"]]) == 1
    everything = httpx.get(stack["admin"] + "/metrics").text + str(lines.records)
    assert bad not in everything


def test_upstream_usage_is_clamped_counted_and_never_fatal(stack):
    """A provider reporting cached_tokens: -64 (the simulator once did) still gets its client a 200, with the usage
    clamped; the anomaly is counted per pool and kind; the request is accounted like any other."""
    u, fake, lines = stack["url"], stack["fake"], stack["lines"]
    fake.usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": -64}}
    before = metric(stack["admin"], "gateway_upstream_usage_anomalies_total", pool="h", kind="negative")
    try:
        c = OpenAI(base_url=u + "/v1", api_key=KEY_A, max_retries=0)
        r = c.chat.completions.with_raw_response.create(model="glm-hosted", messages=MSG, max_tokens=3)
        assert r.status_code == 200 and r.parse().usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(c.chat.completions.create(model="glm-hosted", messages=MSG, max_tokens=3, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
        rid = r.headers["x-request-id"]
        wait_until(lambda: metric(stack["admin"], "gateway_upstream_usage_anomalies_total", pool="h", kind="negative") == before + 2,
                   what="both anomalies counted")
        line = next(ln for ln in lines.records if ln["request_id"] == rid)
        assert line["status"] == "200" and line["cached_tokens"] == 0 and line["prompt_tokens"] == 5
    finally:
        fake.usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2}}


def test_an_upstream_claiming_a_trillion_tokens_is_billed_at_the_request_bound(stack):
    """A provider reporting 10^12 prompt and completion tokens for a `max_tokens: 5` request (one reported 10^8 and a
    $0.01 budget was overrun 34,000x) is billed at the request's bound: 5 completion tokens, and the gateway's own
    prompt count times `usage_bounds.prompt_factor` plus the slack. The client sees the same usage; the correction is
    counted per kind and named in the request's log line."""
    from gateway.config import UsageBounds
    from gateway.pipeline.validation import validate

    u, fake, lines = stack["url"], stack["fake"], stack["lines"]
    fake.usage = {"prompt_tokens": 10**12, "completion_tokens": 10**12, "total_tokens": 2 * 10**12}
    before = {k: metric(stack["admin"], "gateway_upstream_usage_anomalies_total", pool="h", kind=k)
              for k in ("prompt_over_bound", "completion_over_bound")}
    try:
        body = chat(model="glm-hosted", max_tokens=5)
        r = post(u, body)
    finally:
        fake.usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2}}
    assert r.status_code == 200
    b = UsageBounds()
    own = validate(dict(body), "chat/completions").prompt_tokens
    prompt_bound = int(own * b.prompt_factor + b.prompt_slack_tokens)
    assert (r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]) == (prompt_bound, 5)
    billed = (prompt_bound * 1.0 + 5 * 3.0) / 1e6  # the pool's $/Mtok: input 1.0, output 3.0
    assert float(r.headers["x-gateway-cost-usd"]) == pytest.approx(billed, abs=1e-8)
    rid = r.headers["x-request-id"]
    wait_until(lambda: any(ln["request_id"] == rid for ln in lines.records), what="logged")
    line = next(ln for ln in lines.records if ln["request_id"] == rid)
    assert line["cost_usd"] == pytest.approx(billed, abs=1e-8) and line["completion_tokens"] == 5
    assert {"prompt_over_bound", "completion_over_bound"} <= set(line["usage_anomalies"])
    for k, v in before.items():
        assert metric(stack["admin"], "gateway_upstream_usage_anomalies_total", pool="h", kind=k) == v + 1


@pytest.mark.parametrize("raw", [b"garbage line\n\n", b"event: ping\n\n", b"data: not json\n\n"])
def test_a_malformed_upstream_stream_ends_with_an_error_event(stack, raw):
    """Garbage from an upstream mid-stream (a line that is no SSE field, an event without data, a payload that is no
    JSON object) used to be skipped or relayed, and the stream ended as a success. It ends with an error event, no
    [DONE], and is logged as a stream error."""
    u, fake, lines = stack["url"], stack["fake"], stack["lines"]
    fake.inject = (1, raw)
    try:
        with httpx.stream("POST", u + "/v1/chat/completions", json=chat(model="glm-hosted", stream=True),
                          headers={"authorization": f"Bearer {KEY_A}"}, timeout=20) as r:
            data = b"".join(r.iter_bytes())
    finally:
        fake.inject = None
    assert r.status_code == 200 and b"data: [DONE]" not in data
    events = [orjson.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1]["error"]["type"] == "server_error" and "malformed" in events[-1]["error"]["message"]
    assert b"garbage" not in data and b"not json" not in data and b"ping" not in data
    rid = r.headers["x-request-id"]
    wait_until(lambda: any(ln["request_id"] == rid for ln in lines.records), what="logged")
    assert next(ln for ln in lines.records if ln["request_id"] == rid)["reason"] == "stream_error"


def test_token_metrics_add_up(stack):
    """type = uncached_prompt | cached_prompt | completion are disjoint: summing by type is the upstream's total."""
    u = stack["url"]
    kinds = ("uncached_prompt", "cached_prompt", "completion")
    before = {k: metric(stack["admin"], "gateway_tokens_total", pool="h", type=k) for k in kinds}
    r = post(u, chat(model="glm-hosted"))
    assert r.status_code == 200
    usage = r.json()["usage"]  # the fake's: 7 prompt (2 cached), 3 completion
    after = {k: metric(stack["admin"], "gateway_tokens_total", pool="h", type=k) for k in kinds}
    delta = {k: after[k] - before[k] for k in kinds}
    assert delta == {"uncached_prompt": 5, "cached_prompt": 2, "completion": 3}
    assert sum(delta.values()) == usage["total_tokens"]


def test_a_failing_accounting_step_changes_no_response_and_skips_no_other_step(stack):
    """An exception inside accounting (here the cost counter refuses its value) never turns a served 200 into a
    500; a stream still ends with [DONE] and its connection still serves the next request; the failure is counted,
    and the steps after it (the log line) still run."""
    u, gw, lines = stack["url"], stack["gw"], stack["lines"]
    m = gw.app.state.gateway.metrics
    real = m.cost
    failures = metric(stack["admin"], "gateway_accounting_failures_total", step="metrics")
    m.cost = Broken()
    try:
        with httpx.Client(base_url=u, headers={"authorization": f"Bearer {KEY_A}"}, timeout=20) as c:
            r1 = c.post("/v1/chat/completions", json=chat())
            assert r1.status_code == 200 and r1.json()["choices"]
            with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as s:
                body = b"".join(s.iter_bytes())
            assert s.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
            r3 = c.post("/v1/chat/completions", json=chat())  # the same keep-alive connection
            assert r3.status_code == 200
        wait_until(lambda: metric(stack["admin"], "gateway_accounting_failures_total", step="metrics") >= failures + 3,
                   what="the failures counted")
        ids = {r1.headers["x-request-id"], s.headers["x-request-id"], r3.headers["x-request-id"]}
        wait_until(lambda: ids <= {ln["request_id"] for ln in lines.records}, what="still logged")
    finally:
        m.cost = real
    wait_until(lambda: idle(gw), what="load released")


def test_upstream_rejection_is_logged_with_who_answered(stack):
    """A request the upstream refused with a 4xx was served by someone: the log and metrics name the pool, the
    replica and the attempts, not pool "none" / attempts 0."""
    u, fake, lines = stack["url"], stack["fake"], stack["lines"]
    fake.status, fake.error_body = 400, {"error": {"message": "bad tool schema", "type": "invalid_request_error"}}
    try:
        r = post(u, chat(model="glm-hosted"))
    finally:
        fake.status = 200
    assert r.status_code == 400
    assert (r.headers["x-gateway-pool"], r.headers["x-gateway-replica"], r.headers["x-gateway-attempts"]) == ("h", "h", "1")
    rid = r.headers["x-request-id"]
    wait_until(lambda: any(ln["request_id"] == rid for ln in lines.records), what="logged")
    line = next(ln for ln in lines.records if ln["request_id"] == rid)
    assert (line["pool"], line["replica"], line["attempts"], line["reason"]) == ("h", "h", 1, "upstream_rejected")
    assert metric(stack["admin"], "gateway_requests_total", pool="h", status="400", reason="upstream_rejected") >= 1
    # the request span: SERVER, error status, the provider and model as served; the attempt span is its child
    gw = stack["gw"]
    gw.call(lambda: gw.app.state.gateway.tracer_provider.force_flush())
    finished = stack["spans"].get_finished_spans()
    span = next(s for s in finished if s.attributes.get("gateway.request_id") == rid)
    assert span.kind == SpanKind.SERVER and span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "400" and span.attributes["gen_ai.provider.name"] == "openai"
    assert span.attributes["gen_ai.response.model"] == "hosted-glm" and "gen_ai.request.max_tokens" in span.attributes
    children = [s for s in finished if s.parent is not None and s.parent.span_id == span.context.span_id]
    assert children and all(s.kind == SpanKind.CLIENT for s in children)


def test_sla_is_judged_for_non_streamed_requests_too(stack):
    """Non-streamed responses count towards SLA attainment (TTFT estimated as response time minus decode time)."""
    u = stack["url"]
    before = metric(stack["admin"], "gateway_sla_requests_total", tenant="tenant-a")
    assert post(u, chat(max_tokens=5)).status_code == 200
    assert metric(stack["admin"], "gateway_sla_requests_total", tenant="tenant-a") == before + 1


def test_stream_cost_is_in_the_final_usage_chunk(stack):
    """Streams have no x-gateway-cost-usd header (the headers left before the usage was known): the cost is an
    extension field of the usage chunk the client asked for, equal to what the request log records."""
    u, lines = stack["url"], stack["lines"]
    c = OpenAI(base_url=u + "/v1", api_key=KEY_A, max_retries=0)
    with c.chat.completions.with_streaming_response.create(model="glm-5.2", messages=MSG, max_tokens=4, stream=True,
                                                           stream_options={"include_usage": True}) as r:
        rid = r.headers["x-request-id"]
        chunks = list(r.parse())
    last = chunks[-1]
    assert not last.choices and last.usage.completion_tokens > 0
    cost = last.usage.model_extra["cost_usd"]
    assert cost > 0
    wait_until(lambda: any(ln["request_id"] == rid for ln in lines.records), what="logged")
    assert next(ln for ln in lines.records if ln["request_id"] == rid)["cost_usd"] == pytest.approx(cost, abs=1e-8)  # the log rounds to 8 places


def test_client_that_stops_reading_is_cut_and_its_upstream_cancelled(stack):
    """A client that stops reading a stream (its socket buffers full) must not keep a replica generating until the
    total timeout: past timeouts.client_stall the gateway cuts it, closes the upstream (the replica aborts the
    request) and releases the load."""
    u, gw, reps, sims, lines = stack["url"], stack["gw"], stack["reps"], stack["sims"], stack["lines"]
    body = orjson.dumps(chat(max_tokens=200_000, stream=True, ignore_eos=True))
    host, port = u.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              + f"authorization: Bearer {KEY_A}\r\nx-request-id: stall-test-1\r\ncontent-length: {len(body)}\r\n\r\n".encode()
              + body)
    try:
        assert s.recv(256).startswith(b"HTTP/1.1 200")  # then never read again
        wait_until(lambda: any(ln["request_id"] == "stall-test-1" for ln in lines.records), timeout=30,
                   what="the stalled stream accounted")
        line = next(ln for ln in lines.records if ln["request_id"] == "stall-test-1")
        assert line["reason"] == "client_stall" and line["completion_tokens"] < 200_000
        wait_until(lambda: sims.call(lambda: sum(x["num_running_reqs"] for r in reps for x in r.loads())) == 0,
                   timeout=5, what="the replica's request cancelled")
        wait_until(lambda: idle(gw), what="load released")
    finally:
        s.close()


def _mix(u: str, fake: FakeOpenAI, sim_urls: list[str], gw: Any) -> None:
    """Successes, upstream errors before and after the first byte, upstream 4xx, client disconnects (stream and
    not), upstream garbage usage and an accounting step that raises — every way a request can end."""
    c = OpenAI(base_url=u + "/v1", api_key=KEY_A, max_retries=0)
    for stream in (False, True):
        for _ in range(3):
            r = c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=3, stream=stream)
            if stream:
                list(r)
    for sim in sim_urls:  # 5xx before the first byte (retried elsewhere, or all attempts fail)
        httpx.post(sim + "/_sim/fault", json={"kind": "status", "status": 500, "count": 2})
    for _ in range(3):
        post(u, chat())
    for sim in sim_urls:  # the connection dropped mid-stream
        httpx.post(sim + "/_sim/fault", json={"kind": "reset_after", "n": 2, "count": 1})
    for _ in range(2):
        with httpx.stream("POST", u + "/v1/chat/completions", json=chat(stream=True, max_tokens=20, ignore_eos=True),
                          headers={"authorization": f"Bearer {KEY_A}"}, timeout=20) as s:
            b"".join(s.iter_bytes())
    fake.status = 400  # refused upstream
    post(u, chat(model="glm-hosted"))
    fake.status = 200
    fake.usage = {"prompt_tokens": 3, "completion_tokens": -2, "prompt_tokens_details": {"cached_tokens": -64}}
    post(u, chat(model="glm-hosted"))
    list(c.chat.completions.create(model="glm-hosted", messages=MSG, stream=True, stream_options={"include_usage": True}))
    fake.usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 2}}
    for _ in range(3):  # the client leaves: mid-stream, and while a non-streamed answer is generated
        with httpx.stream("POST", u + "/v1/chat/completions", json=chat(stream=True, max_tokens=3000, ignore_eos=True),
                          headers={"authorization": f"Bearer {KEY_A}"}, timeout=20) as s:
            next(s.iter_bytes())
        with pytest.raises(httpx.TimeoutException):
            post_timeout = httpx.post(u + "/v1/chat/completions", json=chat(max_tokens=3000, ignore_eos=True),
                                      headers={"authorization": f"Bearer {KEY_A}"}, timeout=0.2)
            assert post_timeout is None
    m = gw.app.state.gateway.metrics
    real, m.tokens = m.tokens, Broken()  # an accounting step that raises: 300 requests, 30 at a time
    try:
        statuses = asyncio.run(_broken_burst(u))
        assert statuses == [200] * 300
    finally:
        m.tokens = real


async def _broken_burst(u: str, n: int = 300) -> list[int]:
    sem = asyncio.Semaphore(30)
    async with httpx.AsyncClient(base_url=u, headers={"authorization": f"Bearer {KEY_A}"}, timeout=30) as c:
        async def one(i: int) -> int:
            async with sem:
                if i % 2:
                    async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as s:
                        body = b"".join([b async for b in s.aiter_bytes()])
                        return s.status_code if body.endswith(b"data: [DONE]\n\n") else -1
                return (await c.post("/v1/chat/completions", json=chat())).status_code

        return list(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.mark.parametrize("shared", ["memory", "redis"])
def test_load_view_returns_to_zero_after_any_mix_of_outcomes(shared, redis_server):
    """The load view's invariant: whatever a request's end (success, upstream error, disconnect, garbage usage,
    a failing accounting step), the shared load view returns to 0 in flight on every replica — in this instance's
    memory, and in Redis as every instance sums it — and normal traffic is then routed on cache and cold placement,
    not as if the fleet were saturated."""
    sims, _ = start_sims(2)
    fake = FakeOpenAI()
    hosted = ServerThread([fake.app()]).start()
    extra: dict[str, Any] = {"routing": {"redis_url": redis_server.url, "redis_prefix": f"inv{time.monotonic_ns()}:"}} \
        if shared == "redis" else {}
    cfg = stack_config(sims.urls, hosted.urls[0], **extra)
    # every server of this test shares one process: on a busy machine its 30-wide burst can keep a connect waiting
    # past the suite's 1 s, a 502 this test is not about
    cfg["timeouts"] = {**cfg["timeouts"], "connect": 15.0, "first_byte": 30.0, "total": 60.0}
    gws = [start_gateway(cfg) for _ in range(2 if shared == "redis" else 1)]
    try:
        for gw in gws:
            _mix(gw.urls[0], fake, sims.urls, gw)
        for gw in gws:
            wait_until(lambda gw=gw: idle(gw), timeout=10, what=f"{shared} load view back to 0")
        prompt = [{"role": "user", "content": "a fresh prompt about routing " * 80}]
        routes = [post(gws[-1].urls[0], chat(messages=prompt)).headers["x-gateway-route"] for _ in range(2)]
        # a cold prompt placed on its ring, or away from a replica whose own answers ran over twice their
        # prediction (`slow_replica`: on a busy machine one of the two in-process simulators can be), never as if
        # the fleet were full; the second turn finds the first's prefix
        assert routes[0] in ("cold_ring", "slow_replica") and routes[1] == "prefix_hit", routes
    finally:
        for gw in gws:
            gw.stop()
        hosted.stop()
        sims.stop()


def test_span_reports_max_tokens_only_when_the_client_set_it(stack):
    """gen_ai.request.max_tokens is the client's; absent, it is omitted (not reported as 0); a success has no error."""
    u, gw = stack["url"], stack["gw"]
    r = post(u, {"model": "glm-hosted", "messages": MSG})
    assert r.status_code == 200
    gw.call(lambda: gw.app.state.gateway.tracer_provider.force_flush())
    span = next(s for s in stack["spans"].get_finished_spans()
                if s.attributes.get("gateway.request_id") == r.headers["x-request-id"])
    assert "gen_ai.request.max_tokens" not in span.attributes and span.status.status_code == StatusCode.UNSET
    assert span.attributes["gen_ai.usage.cache_read.input_tokens"] == 2 and span.attributes["gen_ai.usage.input_tokens"] == 7


def test_a_client_that_leaves_while_sending_its_body_is_counted_not_an_error(stack, caplog):
    """A client gone before its body arrived is a client_disconnect (499) in the metrics and the log, never an
    'unhandled error' with a traceback."""
    u, lines = stack["url"], stack["lines"]
    before = metric(stack["admin"], "gateway_requests_total", status="499", reason="client_disconnect")
    host, port = u.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"authorization: Bearer {KEY_A}\r\nx-request-id: gone-early-1\r\ncontent-length: 100\r\n\r\n".encode()
                  + b'{"model":')
        time.sleep(0.2)
    wait_until(lambda: any(ln["request_id"] == "gone-early-1" for ln in lines.records), what="logged")
    line = next(ln for ln in lines.records if ln["request_id"] == "gone-early-1")
    assert (line["status"], line["reason"]) == ("499", "client_disconnect")
    assert metric(stack["admin"], "gateway_requests_total", status="499", reason="client_disconnect") == before + 1
    assert not [r for r in caplog.records if r.name == "gateway.errors"]
