"""The log stream an on-call reads: every line one JSON object with an ISO 8601 UTC timestamp, a level and an event
kind; one `request` line per request with its request id (and trace/span ids when tracing is on); each state change
its own line — breaker open / half_open / closed, ejection, drain, override, pool override, policy reload, error and
recovery, Redis away and back. The lines are read as the stream's formatter writes them, from a real gateway."""

from __future__ import annotations

import io
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config import hash_key
from gateway.observability.logging import JsonLines
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import RedisServer, start_sims, wait_until

ADMIN = "admin-log-token"
ADMIN_H = {"authorization": f"Bearer {ADMIN}", "x-admin-actor": "oncall"}
AUTH = {"authorization": f"Bearer {KEY_A}"}
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


class Stream:
    """What the gateway writes to its log stream, as text lines (the stream's own formatter)."""

    def __init__(self) -> None:
        self.buf = io.StringIO()
        self.handler = logging.StreamHandler(self.buf)
        self.handler.setFormatter(JsonLines())
        self.handler.setLevel(logging.DEBUG)

    def lines(self) -> list[dict[str, Any]]:
        text = self.buf.getvalue()
        return [orjson.loads(ln) for ln in text.splitlines()]  # each line alone is a JSON object

    def events(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [ln for ln in self.lines() if ln["event"] == kind and all(ln.get(k) == v for k, v in match.items())]


@pytest.fixture
def stream() -> Iterator[Stream]:
    s = Stream()
    logger = logging.getLogger("gateway")
    logger.addHandler(s.handler)
    yield s
    logger.removeHandler(s.handler)
    for line in s.lines():  # whatever the test did: every line well formed
        assert ISO.match(line["ts"]) and line["level"] in ("debug", "info", "warning", "error", "critical"), line
        assert isinstance(line["event"], str)


def chat(gw: Any, text: str = "hi", stream: bool = False) -> httpx.Response:
    return httpx.post(gw.urls[0] + "/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"model": "glm-5.2", "messages": [{"role": "user", "content": text}], "max_tokens": 2,
                            "stream": stream})


def test_a_traceback_is_folded_into_one_line():
    """An exception logged anywhere in the gateway is one line: the traceback is the `exc` field."""
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(JsonLines())
    log = logging.getLogger("gateway.test")
    log.addHandler(h)
    try:
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            log.exception("it failed")
    finally:
        log.removeHandler(h)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    line = orjson.loads(lines[0])
    assert line["event"] == "log" and line["level"] == "error" and line["msg"] == "it failed"
    assert line["logger"] == "gateway.test" and "ValueError: boom" in line["exc"] and "Traceback" in line["exc"]


def test_a_line_logged_with_an_event_in_its_extras_is_an_event_line():
    """`log.warning(msg, extra={"event": ...})` (the outlier detector's ejections) is an event line carrying the
    extras as fields and the message as `msg`."""
    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.setFormatter(JsonLines())
    log = logging.getLogger("gateway.test")
    log.addHandler(h)
    try:
        log.warning("replica %s ejected", "p-2", extra={"event": "replica_ejected", "replica": "p-2", "ejected_s": 30})
    finally:
        log.removeHandler(h)
    line = orjson.loads(buf.getvalue())
    assert (line["event"], line["replica"], line["ejected_s"], line["msg"]) == ("replica_ejected", "p-2", 30,
                                                                               "replica p-2 ejected")
    assert line["level"] == "warning" and ISO.match(line["ts"]) and "args" not in line and "lineno" not in line


def test_one_request_line_with_its_request_and_trace_ids(stream):
    """A request line per request: timestamp, level, request id, and the trace and span ids of its span (the ids
    the exported span has), so a line leads to its trace; a refusal is a request line too."""
    sims, _ = start_sims(1)
    spans = InMemorySpanExporter()
    gw = start_gateway(config([sglang_pool("p", sims.urls)]), span_exporter=spans)
    try:
        r = chat(gw)
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        wait_until(lambda: stream.events("request", request_id=rid), what="its request line")
        (line,) = stream.events("request", request_id=rid)
        assert line["level"] == "info" and line["status"] == "200" and line["tenant"] == "tenant-a"
        gw.call(lambda: gw.app.state.gateway.tracer_provider.force_flush())
        span = next(s for s in spans.get_finished_spans() if s.attributes.get("gateway.request_id") == rid)
        assert line["trace_id"] == f"{span.context.trace_id:032x}" and line["span_id"] == f"{span.context.span_id:016x}"
        bad = httpx.post(gw.urls[0] + "/v1/chat/completions", headers={"authorization": "Bearer sk-nope"}, json={})
        wait_until(lambda: stream.events("request", request_id=bad.headers["x-request-id"]), what="the refusal's line")
        (refused,) = stream.events("request", request_id=bad.headers["x-request-id"])
        assert refused["status"] == "401" and refused["trace_id"] is None
    finally:
        gw.stop()
        sims.stop()


def write_policies(root: Path, a_yaml: str) -> None:
    (root / "tenants").mkdir(parents=True, exist_ok=True)
    (root / "defaults.yaml").write_text("models: [glm-5.2]\n")
    (root / "tenants" / "tenant-a.yaml").write_text(a_yaml)


def test_every_state_change_is_its_own_event_line(stream, tmp_path):
    """Drive each state change through the real surfaces (the admin API, the policy directory, a replica's faults,
    Redis going away) and find each as its own line with what changed."""
    sims, _ = start_sims(2)
    redis = RedisServer()
    good = f"api_key_hashes: [{hash_key(KEY_A)}]\n"
    write_policies(tmp_path, good)
    cfg = config([sglang_pool("p", sims.urls), sglang_pool("q", sims.urls[1:])],
                 models=[{"name": "glm-5.2", "pools": ["p", "q"]}],
                 admin={"token_hashes": [hash_key(ADMIN)]}, policies={"dir": str(tmp_path), "watch_interval_s": 0.1},
                 routing={"policy": "round_robin", "redis_url": redis.url, "redis_prefix": f"log{time.monotonic_ns()}:",
                          "redis_timeout_s": 0.5},
                 circuit_breaker={"failure_threshold": 2, "cooldown_s": 0.5}, health={"enabled": False})
    del cfg["tenants"]
    gw = start_gateway(cfg)
    adm = lambda m, p, **kw: httpx.request(m, gw.admin_url + p, headers=ADMIN_H, timeout=10, **kw)  # noqa: E731
    try:
        # drain and undrain
        assert adm("POST", "/admin/replicas/p-0/drain").status_code == 200
        assert adm("POST", "/admin/replicas/p-0/undrain").status_code == 200
        wait_until(lambda: len(stream.events("drain", replica="p-0")) == 2, what="two drain lines")
        assert [e["drained"] for e in stream.events("drain", replica="p-0")] == [True, False]
        # a tenant override, set then cleared; a pool override
        assert adm("PUT", "/admin/tenants/tenant-a/override", json={"ttl_s": 60, "pin_pool": "q"}).status_code == 200
        assert adm("DELETE", "/admin/tenants/tenant-a/override").status_code == 200
        wait_until(lambda: len(stream.events("override", name="tenant-a")) == 2, what="two override lines")
        first, cleared = stream.events("override", name="tenant-a")
        assert first["override"]["pin_pool"] == "q" and first["was"] is None
        assert cleared["override"] is None and cleared["was"]["pin_pool"] == "q"
        assert adm("PUT", "/admin/pools/q", json={"weight": 2}).status_code == 200
        wait_until(lambda: stream.events("pool_override", name="q"), what="the pool override line")
        assert stream.events("pool_override", name="q")[0]["override"] == {"weight": 2.0}
        # a bad policy edit, then reverted: an error line, then a recovery line (no manual reload)
        (tmp_path / "tenants" / "tenant-a.yaml").write_text("api_key_hashes: [oops\n")
        wait_until(lambda: stream.events("policy_error"), what="the policy error line")
        err = stream.events("policy_error")[0]
        assert err["level"] == "error" and "tenants/tenant-a.yaml" in err["error"]
        (tmp_path / "tenants" / "tenant-a.yaml").write_text(good)
        wait_until(lambda: stream.events("policy_recovered"), what="the recovery line")
        assert adm("GET", "/admin/policies").json()["last_error"] is None
        (tmp_path / "tenants" / "tenant-a.yaml").write_text(good + "ttft_sla_ms: 5000\n")
        wait_until(lambda: stream.events("policy_reload"), what="the reload line")
        # replica p-0 answers 500 where another replica serves the same body: its breaker opens; after the cooldown a trial closes it again
        httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "status", "status": 500, "count": 2})
        for i in range(6):
            assert chat(gw, f"b{i}").status_code == 200  # failed over to the other replica
        wait_until(lambda: stream.events("breaker", replica="p-0", state="open"), what="the breaker opening")
        wait_until(lambda: chat(gw, "after").status_code == 200 and bool(
            stream.events("breaker", replica="p-0", state="closed")), timeout=10, what="the breaker closing")
        states = [e["state"] for e in stream.events("breaker", replica="p-0")]
        assert states[:3] == ["open", "half_open", "closed"], states
        # Redis goes away and comes back
        redis.kill()
        wait_until(lambda: chat(gw, "r").status_code == 200 and bool(stream.events("redis_away")), timeout=10,
                   what="a redis_away line")
        redis.start()
        wait_until(lambda: chat(gw, "r2").status_code == 200 and bool(stream.events("redis_back")), timeout=15,
                   what="a redis_back line")
        away = stream.events("redis_away")
        assert away[0]["level"] == "warning" and away[0]["what"] and away[0]["reason"]
    finally:
        gw.stop()
        sims.stop()
        redis.stop()


def test_an_ejection_is_an_event_line(stream):
    """A replica that stops answering is ejected: an `ejection` line naming it, and its breaker's `open` line with
    the reason `stalled`."""
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"policy": "round_robin"},
                              retry={"stall_s": 0.5, "stall_min_requests": 2},
                              circuit_breaker={"failure_threshold": 3, "cooldown_s": 60.0}, health={"enabled": False}))
    try:
        httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "hang", "count": 1000})
        threads = [threading.Thread(target=chat, args=(gw, f"hello {i}", True)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        wait_until(lambda: stream.events("ejection", replica="p-0"), what="the ejection line")
        (ej,) = stream.events("ejection", replica="p-0")
        assert ej["pool"] == "p" and ej["reason"] == "stalled" and ej["overdue_requests"] >= 2
        assert stream.events("breaker", replica="p-0", state="open", reason="stalled")
    finally:
        httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "clear"})
        gw.stop()
        sims.stop()


def test_a_refusal_is_recorded_alike_inside_and_outside_the_pipeline(stream):
    """One mechanism for refusals (pipeline/refusal.py, `Accounting.refused`): a bad key refused by the pipeline
    (`/v1/chat/completions`) and one refused before the pipeline is reached (`/v1/models`) give the same request-line
    fields (the latter adds the method, its path being any path) and the same `gateway_requests_total` series shape,
    so a log query or a dashboard written for one kind of refusal sees the other."""
    gw = start_gateway(config([sglang_pool("p", ["http://127.0.0.1:9"])]))
    bad = {"authorization": "Bearer sk-nope"}
    try:
        inside = httpx.post(gw.urls[0] + "/v1/chat/completions", headers=bad, json={})
        outside = httpx.get(gw.urls[0] + "/v1/models", headers=bad)
        assert inside.status_code == outside.status_code == 401
        rids = [inside.headers["x-request-id"], outside.headers["x-request-id"]]
        wait_until(lambda: all(stream.events("request", request_id=rid) for rid in rids), what="both refusal lines")
        (a,), (b,) = (stream.events("request", request_id=rid) for rid in rids)
        assert set(a) | {"method"} == set(b) and b["method"] == "GET"
        assert (a["status"], a["reason"], a["tenant"], a["pool"]) == (b["status"], b["reason"], b["tenant"], b["pool"]) \
            == ("401", "auth", "none", "none")
        registry = gw.app.state.gateway.metrics.registry
        for model, api in (("none", "chat"), ("unknown", "other")):
            labels = {"model": model, "pool": "none", "tenant": "none", "status": "401", "reason": "auth", "api": api}
            assert registry.get_sample_value("gateway_requests_total", labels) == 1.0, labels
    finally:
        gw.stop()
