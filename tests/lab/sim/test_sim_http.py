"""The simulator's HTTP surface: SGLang's shapes, errors, cache reporting and faults, over real loopback HTTP."""

import json

import httpx
import pytest

from gateway.preflight import PROBE_HEADER
from tests.support import start_sims, wait_until


def sse_events(text):
    return [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]


def chat(url, **kw):
    body = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **kw}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_chat_non_stream_shape(sims):
    st, _ = sims
    r = chat(st.urls[0])
    assert r.status_code == 200
    b = r.json()
    assert b["object"] == "chat.completion" and len(b["id"]) == 32
    assert b["model"] == "glm-5.2"
    ch = b["choices"][0]
    assert ch["message"]["role"] == "assistant" and ch["finish_reason"] == "length"
    assert b["usage"]["completion_tokens"] == 8
    assert b["usage"]["prompt_tokens_details"] == {"cached_tokens": 0} or b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_chat_stream_order_and_usage_chunk(sims):
    st, _ = sims
    r = chat(st.urls[0], stream=True, stream_options={"include_usage": True}, max_tokens=10)
    ev = sse_events(r.text)
    assert ev[-1] == "[DONE]"
    chunks = [json.loads(e) for e in ev[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["choices"][0]["delta"]["content"] == ""
    finish = chunks[-2]
    assert finish["choices"][0]["finish_reason"] == "length" and "content" not in finish["choices"][0]["delta"]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:-2])
    assert len(text.split()) == 10


def test_stream_without_include_usage_has_no_usage_chunk(sims):
    st, _ = sims
    ev = sse_events(chat(st.urls[0], stream=True).text)
    assert all(json.loads(e)["choices"] for e in ev[:-1])


def test_completions_stream_puts_finish_on_last_text_chunk(sims):
    st, _ = sims
    r = httpx.post(f"{st.urls[0]}/v1/completions", json={"prompt": "abc", "max_tokens": 9, "stream": True}, timeout=30)
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["text"]


def test_completions_default_max_tokens_16_and_token_id_prompt(sims):
    st, _ = sims
    r = httpx.post(f"{st.urls[0]}/v1/completions", json={"prompt": list(range(100)), "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 16
    assert r.json()["usage"]["prompt_tokens"] == 100


def test_content_parts_tools_unknown_fields_accepted(sims):
    st, _ = sims
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    r = chat(st.urls[0], messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
             tools=tools, tool_choice="required", max_completion_tokens=12, ignore_eos=True, cache_salt="s",
             some_unknown_field={"x": 1})
    assert r.status_code == 200
    msg = r.json()["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    assert msg["message"]["tool_calls"][0]["function"]["name"] == "lookup"


def test_n_choices(sims):
    st, _ = sims
    b = chat(st.urls[0], n=3, ignore_eos=True).json()
    assert [c["index"] for c in b["choices"]] == [0, 1, 2]
    assert b["usage"]["completion_tokens"] == 24


def test_cached_tokens_exact(sims):
    """A resend is cached up to the last full page; another cache_salt gets nothing; flush resets."""
    st, _ = sims
    url = st.urls[1]
    prompt = list(range(5000, 5000 + 1000))  # 1,000 token ids: 15 full pages of 64

    def cached(**kw):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, **kw}, timeout=30)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached() == 0
    assert cached() == 960
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-b") == 960
    assert httpx.post(f"{url}/flush_cache").status_code == 200
    assert cached() == 0


def test_lru_eviction_under_capacity_pressure():
    """With a 4,096-token KV pool, a second large prompt evicts the first one's least-recent pages."""
    st, _ = start_sims(1, max_total_num_tokens=4096)
    try:
        url = st.urls[0]

        def send(p):
            r = httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 4}, timeout=30)
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        a, b = list(range(2048)), list(range(50_000, 53_000))
        send(a)
        send(b)
        assert send(a) == (32 - 15) * 64
        state = httpx.get(f"{url}/_sim/state").json()
        assert state["ranks"][0]["evicted_pages"] >= 15
    finally:
        st.stop()


def test_models_and_info_endpoints(sims):
    st, _ = sims
    u = st.urls[0]
    m = httpx.get(f"{u}/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == "zai-org/GLM-5.2" and m["data"][0]["owned_by"] == "sglang"
    assert httpx.get(f"{u}/v1/models/zai-org/GLM-5.2").status_code == 200
    nf = httpx.get(f"{u}/v1/models/nope")
    assert nf.status_code == 404 and nf.json()["error"]["code"] == "model_not_found"
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{u}{path}").json()
        assert info["max_total_num_tokens"] == 2_400_000 and info["page_size"] == 64 and info["status"] == "ready"
        assert info["incarnation"]
    for path in ("/model_info", "/get_model_info"):
        assert httpx.get(f"{u}{path}").json()["model_type"] == "glm_moe_dsa"
    loads = httpx.get(f"{u}/v1/loads", params={"include": "all"}).json()
    assert loads["loads"][0]["max_running_requests"] == 48 and "queues" in loads["loads"][0]
    assert httpx.get(f"{u}/get_load").status_code == 404  # removed in 0.5.23 (see test_sglang_versions.py)
    assert httpx.get(f"{u}/ping").status_code == 200


def test_health_takes_a_simulated_second(sims):
    st, reps = sims
    r = httpx.get(f"{st.urls[0]}/health", timeout=10)
    assert r.status_code == 200 and r.content == b""
    assert r.elapsed.total_seconds() >= 1.0 / reps[0].cfg.time_scale * 0.9


def test_metrics_exposition(sims):
    st, _ = sims
    chat(st.urls[0])
    text = httpx.get(f"{st.urls[0]}/metrics").text
    for name in ("# TYPE sglang:num_running_reqs gauge", "# TYPE sglang:prompt_tokens_total counter",
                 "# TYPE sglang:time_to_first_token_seconds histogram", "sglang:cached_tokens_total{cache_source=\"device\"",
                 "# TYPE sglang:inter_token_latency_seconds histogram", "sglang:realtime_tokens_total"):
        assert name in text, name


@pytest.mark.parametrize(
    "path,body,fragment",
    [
        ("/v1/chat/completions", b"{bad json", "JSON decode error"),
        ("/v1/chat/completions", b'{"model": "m"}', "messages"),
        ("/v1/chat/completions", b'{"messages": []}', "Messages cannot be empty."),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', "tools"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "model": "m:lora"}', "LoRA"),
        ("/v1/chat/completions", b'[1, 2]', "dictionary"),
        ("/v1/completions", b'{"prompt": ""}', "Prompt cannot be empty"),
        ("/v1/completions", b'{"model": "m"}', "prompt"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ("/v1/completions", b'{"prompt": [1.5, 2]}', "prompt"),
    ],
)
def test_bad_input_is_400_sglang_envelope(sims, path, body, fragment):
    st, _ = sims
    r = httpx.post(f"{st.urls[0]}{path}", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    b = r.json()
    assert b["object"] == "error" and b["code"] == 400 and fragment in b["message"]


def test_wrong_content_type_is_400(sims):
    st, _ = sims
    r = httpx.post(f"{st.urls[0]}/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["object"] == "error"


def test_context_too_long_is_400():
    st, _ = start_sims(1, context_length=1000)
    try:
        r = httpx.post(f"{st.urls[0]}/v1/completions", json={"prompt": list(range(1200))}, timeout=30)
        assert r.status_code == 400 and "longer than the model's context length" in r.json()["message"]
        r = httpx.post(f"{st.urls[0]}/v1/completions", json={"prompt": list(range(900)), "max_tokens": 500}, timeout=30)
        assert r.status_code == 400 and "maximum context length" in r.json()["message"]
    finally:
        st.stop()


def test_slow_fault_slows_one_phase_until_cleared(sims):
    """The gray-failure switch: prefill alone (TTFT) or decode alone (inter-token latency) k times slower, lasting
    until `clear`; the other phase keeps its speed."""
    st, reps = sims
    u = st.urls[1]
    ranks = [r.rank for r in reps[1].ranks]
    try:
        assert httpx.post(f"{u}/_sim/fault", json={"kind": "slow", "phase": "decode", "factor": 6}).json() == \
            {"slow": {"prefill": 1.0, "decode": 6.0}}
        assert httpx.post(f"{u}/_sim/fault", json={"kind": "slow", "phase": "prefill", "factor": 4}).json() == \
            {"slow": {"prefill": 4.0, "decode": 6.0}}
        assert all((r.prefill_slow, r.decode_slow) == (4.0, 6.0) for r in ranks)
    finally:
        httpx.post(f"{u}/_sim/fault", json={"kind": "clear"}).raise_for_status()
    assert all((r.prefill_slow, r.decode_slow) == (1.0, 1.0) for r in ranks)


def test_bad_input_on_control_and_info_endpoints(sims):
    st, _ = sims
    u = st.urls[0]
    assert httpx.get(f"{u}/v1/loads", params={"include": "bogus"}).status_code == 400
    assert httpx.get(f"{u}/v1/loads", params={"dp_rank": "x"}).status_code == 400
    assert httpx.post(f"{u}/_sim/config", json={"no_such": 1}).status_code == 400
    assert httpx.post(f"{u}/_sim/config", json={"slow_factor": -1}).status_code == 400
    assert httpx.post(f"{u}/_sim/config", content=b"{x").status_code == 400
    assert httpx.post(f"{u}/_sim/fault", json={"kind": "meteor"}).status_code == 400
    for bad in ({"phase": "vision", "factor": 6}, {"phase": "prefill", "factor": 0}, {"phase": "decode", "factor": True},
                {"phase": "both", "factor": 1e9}, {"phase": "both", "factor": "6"}):
        r = httpx.post(f"{u}/_sim/fault", json={"kind": "slow", **bad})
        assert r.status_code == 400 and ("factor" in r.text or "phase" in r.text), bad
    assert httpx.post(f"{u}/abort_request", content=b"nope", headers={"content-type": "application/json"}).status_code == 400
    assert httpx.get(f"{u}/no/such/path").status_code == 404
    assert httpx.get(f"{u}/v1/chat/completions").status_code == 405
    bad_fault = httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                           headers={"x-sim-fault": "meteor"})
    assert bad_fault.status_code == 400
    bad_rank = httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                          headers={"x-data-parallel-rank": "abc"})
    assert bad_rank.status_code == 400


def test_api_key_required_when_set():
    st, _ = start_sims(1, api_key="sekret")
    try:
        u = st.urls[0]
        r = httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        ok = httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                        headers={"authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert httpx.get(f"{u}/health", timeout=10).status_code == 200  # /health needs no key
    finally:
        st.stop()


def test_fault_status_header_and_one_shot(sims):
    st, _ = sims
    u = st.urls[0]
    r = chat(u, ) if False else httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                                            headers={"x-sim-fault": "status=503"})
    assert r.status_code == 503 and r.json()["code"] == 503
    httpx.post(f"{u}/_sim/fault", json={"kind": "status", "status": 500, "count": 1})
    assert chat(u).status_code == 500
    assert chat(u).status_code == 200


def test_a_gateway_probe_never_consumes_a_queued_fault(sims):
    """A test queues a one-shot fault for the next client request; a gateway's preflight probe that lands in between
    (it runs in the background at start, marked x-gateway-probe) is served and leaves the fault queued."""
    st, _ = sims
    u = st.urls[0]
    httpx.post(f"{u}/_sim/fault", json={"kind": "status", "status": 500, "count": 1})
    body = {"messages": [{"role": "user", "content": "gateway preflight probe"}], "max_tokens": 1}
    assert httpx.post(f"{u}/v1/chat/completions", json=body, headers={PROBE_HEADER: "preflight"}).status_code == 200
    assert chat(u).status_code == 500  # still there for the client's request
    assert chat(u).status_code == 200


def test_fault_reset_mid_stream(sims):
    st, _ = sims
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", f"{st.urls[0]}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "stream": True},
                          headers={"x-sim-fault": "reset_after=3"}, timeout=30) as r:
            for _ in r.iter_bytes():
                pass


def test_fault_hang_and_disconnect_frees_request(sims):
    st, reps = sims
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{st.urls[0]}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                   headers={"x-sim-fault": "hang"}, timeout=0.5)
    wait_until(lambda: st.call(lambda: len(reps[0]._inflight)) == 0, timeout=5, what="the hung request freed")


def test_queue_full_503():
    st, _ = start_sims(1, max_queued_requests=0)
    try:
        r = httpx.post(f"{st.urls[0]}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["message"] == "The request queue is full."
        s = httpx.post(f"{st.urls[0]}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True})
        assert s.status_code == 200 and '"code":503' in s.text and s.text.endswith("data: [DONE]\n\n")
    finally:
        st.stop()


def test_restart_clears_cache_and_changes_incarnation():
    st, _ = start_sims(1)
    try:
        u = st.urls[0]
        before = httpx.get(f"{u}/server_info").json()["incarnation"]
        p = {"prompt": list(range(700)), "max_tokens": 2}
        httpx.post(f"{u}/v1/completions", json=p, timeout=30)
        assert httpx.post(f"{u}/v1/completions", json=p, timeout=30).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 640
        assert httpx.post(f"{u}/_sim/fault", json={"kind": "restart"}).status_code == 200

        def restarted() -> bool:
            info = httpx.get(f"{u}/server_info").json()
            return info["incarnation"] != before and info["status"] == "ready"

        wait_until(restarted, timeout=5, what="the restarted replica ready")
        assert httpx.post(f"{u}/v1/completions", json=p, timeout=30).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        st.stop()


def test_old_sse_style_has_all_nulls():
    st, _ = start_sims(1, sse_style="0.5.9")
    try:
        r = httpx.post(f"{st.urls[0]}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}, timeout=30)
        first = json.loads(sse_events(r.text)[0])
        assert first["usage"] is None and first["choices"][0]["delta"]["tool_calls"] is None
    finally:
        st.stop()


def test_dp_ranks_pinning():
    st, _ = start_sims(1, dp_size=2)
    try:
        u = st.urls[0]
        p = {"prompt": list(range(300)), "max_tokens": 2}
        httpx.post(f"{u}/v1/completions", json={**p, "data_parallel_rank": 1}, timeout=30)
        again = httpx.post(f"{u}/v1/completions", json=p, headers={"x-data-parallel-rank": "1"}, timeout=30)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        other = httpx.post(f"{u}/v1/completions", json={**p, "data_parallel_rank": 0}, timeout=30)
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert 'dp_rank="1"' in httpx.get(f"{u}/metrics").text
    finally:
        st.stop()


def test_state_reports_each_client_requests_span_for_exact_concurrency(sims):
    """`GET /_sim/state?spans=1` lists each finished client request's (start, end) on the host's monotonic clock:
    three requests sent together overlap in all three, one after another in one (what the chaos suite's concurrency
    checks count, instead of polling for requests in flight)."""
    import threading
    import time

    from loadtests.chaos import max_overlap

    st, _ = sims
    url = st.urls[0]
    t0 = time.monotonic()
    # the server runs 50x slower until all three are in flight together, whatever this machine's load
    httpx.post(f"{url}/_sim/config", json={"slow_factor": 50.0}).raise_for_status()
    threads = [threading.Thread(target=chat, args=(url,), kwargs={"max_tokens": 64, "ignore_eos": True})
               for _ in range(3)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: httpx.get(f"{url}/_sim/state").json()["inflight"] == 3, timeout=60, what="three in flight")
    finally:
        httpx.post(f"{url}/_sim/config", json={"slow_factor": 1.0}).raise_for_status()
    for t in threads:
        t.join(60)
    together = [tuple(s) for s in httpx.get(f"{url}/_sim/state", params={"spans": 1}).json()["spans"] if s[0] >= t0]
    assert len(together) == 3 and max_overlap(together) == 3
    t1 = time.monotonic()
    for _ in range(2):
        assert chat(url).status_code == 200
    apart = [tuple(s) for s in httpx.get(f"{url}/_sim/state", params={"spans": 1}).json()["spans"] if s[0] >= t1]
    assert len(apart) == 2 and max_overlap(apart) == 1
    assert httpx.get(f"{url}/_sim/state").json()["spans"] is None  # only when asked
