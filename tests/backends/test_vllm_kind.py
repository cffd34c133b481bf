"""vLLM as a pool kind (docs/engines.md): no /server_info or /v1/loads, load from /metrics, the release from
/version, its own preflight, KV-event publishers from /kv_event_sources; and a server that answers the start-up
read with a 404 is logged once and asked again with backoff, not on every poll. The server here is a loopback
FastAPI app answering what vLLM 0.32 answers (captured from a real one: tests/engines covers the real thing)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from gateway.backends import vllm_engine
from gateway.backends.engine_poller import BACKOFF_MAX, EnginePoller
from gateway.config import ConfigError, parse_config
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.upstreams import UpstreamRegistry
from tests.gateway_fixtures import config
from tests.support import ServerThread

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 128.0
"""


def fake_vllm(hits: Counter[str], details: bool = True) -> FastAPI:
    app = FastAPI()
    seen: list[str] = []

    @app.get("/version")
    async def version() -> dict[str, str]:
        hits["/version"] += 1
        return {"version": "0.32.0"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        hits["/metrics"] += 1
        return PlainTextResponse(METRICS)

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        hits["/server_info"] += 1
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    @app.post("/v1/chat/completions")
    async def chat(req: Request) -> dict[str, Any]:
        body = await req.json()
        text = body["messages"][-1]["content"]
        cached = 576 if text in seen else 0
        seen.append(text)
        usage: dict[str, Any] = {"prompt_tokens": 600, "completion_tokens": 1, "total_tokens": 601}
        if details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return {"id": "c", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}], "usage": usage}

    return app


def vllm_pool(urls: list[str], **kw: Any) -> dict[str, Any]:
    return {"name": "v", "kind": "vllm", "model": "tiny",
            "replicas": [{"name": f"v-{i}", "url": u} for i, u in enumerate(urls)], **kw}


def test_vllm_pool_config_and_targets() -> None:
    cfg = parse_config(config([vllm_pool(["http://127.0.0.1:9"], send_priority="always")]))
    reg = UpstreamRegistry(cfg)
    t = reg.targets[0]
    assert t.kind == "vllm" and t.api_base == "http://127.0.0.1:9/v1" and t.caps.engine_api == "vllm"
    assert t.caps.prefix_cache and t.caps.cache_salt and not t.caps.dp_ranks
    assert reg.servers() == {"v-0": [t]}
    # vLLM serves lower values first: the tenant's class is sent negated
    assert t.priority_for("high") == -10 and t.priority_for("low") == 10
    assert UpstreamRegistry(parse_config(config([vllm_pool(["http://h:1"])]))).targets[0].priority_for("high") is None
    with pytest.raises(ConfigError, match="dp_size"):
        parse_config(config([{**vllm_pool(["http://h:1"]), "replicas": [{"name": "a", "url": "http://h:1",
                                                                          "dp_size": 2}]}]))


def test_load_from_metrics() -> None:
    v = vllm_engine.load_from_metrics(METRICS)
    assert v is not None and v.inflight == 5.0 and v.queued_prefill_tokens == 0.0
    assert vllm_engine.load_from_metrics("sglang:num_running_reqs 3\n") is None


def test_kv_event_sources_endpoints() -> None:
    sources = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                     "replay_endpoint": "tcp://*:5558", "topic": ""},
               "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://10.0.0.2:5600"},
               "2": {"enable_kv_cache_events": False, "publisher": "zmq", "endpoint": "tcp://*:1"}}
    assert vllm_engine.endpoints_of(sources, "http://127.0.0.1:8000") == [
        (0, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", ""), (1, "tcp://10.0.0.2:5600", None, "")]
    assert vllm_engine.endpoints_of({}, "http://h:1") == []


def _poller(urls: list[str], pool: dict[str, Any]) -> tuple[EnginePoller, UpstreamRegistry, httpx.AsyncClient]:
    cfg = parse_config(config([pool]))
    reg = UpstreamRegistry(cfg)
    client = httpx.AsyncClient(trust_env=False)
    return EnginePoller(reg, client, MemoryPrefixIndex(), 256, 1.0, cfg), reg, client


def test_vllm_pool_load_and_preflight_over_http() -> None:
    hits: Counter[str] = Counter()
    srv = ServerThread([fake_vllm(hits)]).start()
    try:
        async def go() -> None:
            poller, reg, client = _poller(srv.urls, vllm_pool(srv.urls))
            try:
                for _ in range(3):
                    await poller.poll_once()
                    poller._n += 1
            finally:
                await client.aclose()
            t = reg.targets[0]
            assert t.state.engine_load is not None and t.state.engine_load.inflight == 5.0
            assert t.state.version == "0.32.0" and t.state.low_priority_values_first
            assert poller.reports["v-0"].ok, poller.reports["v-0"].findings
            assert hits["/version"] == 1 and hits["/metrics"] == 3 and hits["/server_info"] == 0

        asyncio.run(go())
    finally:
        srv.stop()


def test_vllm_preflight_names_a_missing_cache_report() -> None:
    hits: Counter[str] = Counter()
    srv = ServerThread([fake_vllm(hits, details=False)]).start()
    try:
        cfg = parse_config(config([vllm_pool(srv.urls)]))
        from gateway.preflight import check_config

        (rep,) = asyncio.run(check_config(cfg))
        assert rep.checks() == ["cache_report"] and "--enable-prompt-tokens-details" in rep.findings[0].message
    finally:
        srv.stop()


def test_a_server_answering_404_is_logged_once_and_backed_off(caplog: pytest.LogCaptureFixture) -> None:
    """A vLLM server configured as an sglang pool: /server_info answers 404. Before, the start-up read ran again on
    every poll, silently; now the reason is logged once and the read retried after 1, 2, 4, ... polls."""
    hits: Counter[str] = Counter()
    srv = ServerThread([fake_vllm(hits)]).start()
    try:
        async def go() -> None:
            poller, _reg, client = _poller(srv.urls, {"name": "p", "kind": "sglang", "model": "tiny",
                                                      "replicas": [{"name": "p-0", "url": srv.urls[0]}]})
            try:
                for _ in range(40):
                    await poller.poll_once()
                    poller._n += 1
            finally:
                await client.aclose()

        with caplog.at_level(logging.WARNING, logger="gateway.engine"):
            asyncio.run(go())
    finally:
        srv.stop()
    assert hits["/server_info"] == 6  # polls 0, 1, 3, 7, 15, 31 (not 40)
    said = [r.getMessage() for r in caplog.records if "start-up read failed" in r.getMessage()]
    assert len(said) == 1 and "404" in said[0] and "pool kind sglang" in said[0]
    assert BACKOFF_MAX >= 32
