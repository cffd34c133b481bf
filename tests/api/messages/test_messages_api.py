"""/v1/messages through the official anthropic SDK, over loopback, in front of simulated SGLang replicas (cache
report on): the SDK sees Anthropic's shapes, events, stop reasons, usage and error classes."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

FULL = {"ignore_eos": True}  # the simulator then generates exactly max_tokens
TOOL = {"name": "lookup", "description": "Look a topic up.",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
MSG = [{"role": "user", "content": "Tell me about prefix caches."}]


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(2, enable_cache_report=True)
    gw = start_gateway(config([sglang_pool("mi355x", sims.urls)],
                              models=[{"name": "glm-5.2", "pools": ["mi355x"]}, {"name": "hidden", "pools": ["mi355x"]}],
                              tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"]}]))
    yield {"gw": gw, "sims": sims, "url": gw.urls[0]}
    gw.stop()
    sims.stop()


@pytest.fixture
def client(stack):
    return anthropic.Anthropic(base_url=stack["url"], api_key=KEY_A, max_retries=0)


def test_create_non_stream(client):
    r = client.messages.with_raw_response.create(model="glm-5.2", max_tokens=10, messages=MSG, system="Be brief.",
                                                 extra_body=FULL)
    m = r.parse()
    assert m.type == "message" and m.role == "assistant" and m.model == "glm-5.2"
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 10
    assert [b.type for b in m.content] == ["text"] and len(m.content[0].text.split()) == 10
    assert m.usage.input_tokens > 0 and m.usage.cache_read_input_tokens is not None
    assert r.headers["x-gateway-replica"].startswith("mi355x-")


def test_repeated_prompt_reports_cache_read_tokens(client):
    long = [{"role": "user", "content": "cache this prompt please " * 120}]
    usages = [client.messages.create(model="glm-5.2", max_tokens=4, messages=long, extra_body=FULL).usage
              for _ in range(2)]
    assert usages[1].cache_read_input_tokens >= 512  # the prefix hash sent the repeat to the replica holding it
    total = usages[1].input_tokens + usages[1].cache_read_input_tokens
    assert total == usages[0].input_tokens + usages[0].cache_read_input_tokens


def test_a_conversations_next_turn_lands_on_the_replica_holding_the_last(client):
    """Each turn resends the conversation (the last answer, its tool results) plus a new question: the bridge
    renders the same prompt the chat path hashes, so turns 2-4 go to turn 1's replica and read ever more from its
    cache."""
    system = "You are a research agent. " + "Context the agent keeps for the whole session. " * 120
    history: list = [{"role": "user", "content": "Turn 1: what is a radix cache?"}]
    replicas, cached = [], []
    for turn in range(1, 5):
        r = client.messages.with_raw_response.create(model="glm-5.2", max_tokens=8, system=system, messages=history,
                                                     tools=[TOOL], extra_body=FULL)
        m = r.parse()
        replicas.append(r.headers["x-gateway-replica"])
        cached.append(m.usage.cache_read_input_tokens)
        results = [{"type": "tool_result", "tool_use_id": b.id, "content": f"result {turn} " * 40}
                   for b in m.content if b.type == "tool_use"]
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                    {"role": "user", "content": [*results, {"type": "text", "text": f"Turn {turn + 1}: and then?"}]}]
    assert len(set(replicas)) == 1
    assert cached[1] >= 1024 and cached[1] < cached[2] < cached[3]


def test_stream_events_and_final_message(client):
    with client.messages.stream(model="glm-5.2", max_tokens=8, messages=MSG, extra_body=FULL) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types
    assert "content_block_start" in types and "content_block_stop" in types and "text" in types
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert len(final.content[0].text.split()) == 8


def test_raw_stream_has_ping_and_named_events(stack):
    with httpx.stream("POST", stack["url"] + "/v1/messages", headers={"x-api-key": KEY_A, "anthropic-version": "2023-06-01"},
                      json={"model": "glm-5.2", "max_tokens": 3, "messages": MSG, "stream": True, **FULL}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = b"".join(r.iter_bytes()).decode()
    names = [ln[len("event: "):] for ln in body.splitlines() if ln.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]


def test_tool_use_round_trip(client):
    m1 = client.messages.create(model="glm-5.2", max_tokens=32, messages=MSG, tools=[TOOL],
                                tool_choice={"type": "tool", "name": "lookup"})
    assert m1.stop_reason == "tool_use"
    use = [b for b in m1.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "lookup" and isinstance(use[0].input, dict) and "query" in use[0].input
    m2 = client.messages.create(model="glm-5.2", max_tokens=12, tools=[TOOL], extra_body=FULL, messages=[
        *MSG, {"role": "assistant", "content": m1.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "KV reuse."}]}])
    assert m2.stop_reason == "max_tokens" and [b.type for b in m2.content] == ["text"]


def test_stream_tool_use_accumulates_input(client):
    with client.messages.stream(model="glm-5.2", max_tokens=32, messages=MSG, tools=[TOOL],
                                tool_choice={"type": "any"}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[-1].type == "tool_use" and "query" in final.content[-1].input


def test_count_tokens_matches_what_the_engine_counts(client):
    counted = client.messages.count_tokens(model="glm-5.2", messages=MSG, system="Be brief.", tools=[TOOL])
    m = client.messages.create(model="glm-5.2", max_tokens=2, messages=MSG, system="Be brief.", tools=[TOOL])
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    bigger = client.messages.count_tokens(model="glm-5.2", messages=[{"role": "user", "content": "x " * 400}])
    assert bigger.input_tokens > counted.input_tokens


def test_count_tokens_uses_the_models_tokenizer_where_the_gateway_loaded_one(tmp_path):
    """Precise routing with a real tokenizer (routing.kv_events.tokenizer kind hf): count_tokens renders the model's
    chat template and counts its ids, not the 4-characters rule; a message the template refuses is a 400 in
    Anthropic's shape (the stack above, with no tokenizer loaded, counts by the rule: the test before)."""
    from gateway.tokenizer import count_tokens, render_chat
    from gateway.tokenizers.real import HfTokenizer
    from tests.tokenizers.test_real_tokenizer import REFUSING, make_tokenizer_dir

    make_tokenizer_dir(tmp_path, template=REFUSING)
    sims, _ = start_sims(1)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"mode": "precise", "kv_events": {
        "tokenizer": {"kind": "hf", "path": str(tmp_path), "check_engine": False}}}))
    try:
        c = anthropic.Anthropic(base_url=gw.urls[0], api_key=KEY_A, max_retries=0)
        msgs = [{"role": "system", "content": "you are a helpful assistant"},
                {"role": "user", "content": "hello world, how are you today?"}]
        t = HfTokenizer.from_dir(str(tmp_path))
        want = len(t.tok.encode(t.render(msgs, None), add_special_tokens=False).ids)
        assert want != count_tokens(render_chat(msgs))  # the two paths disagree on this prompt
        counted = c.messages.count_tokens(model="glm-5.2", system=msgs[0]["content"], messages=msgs[1:])
        assert counted.input_tokens == want
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.count_tokens(model="glm-5.2", messages=[{"role": "user", "content": "refuse me"}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert "no refusals here" in e.value.body["error"]["message"]
    finally:
        gw.stop()
        sims.stop()


def test_error_classes(stack, client):
    bad_key = anthropic.Anthropic(base_url=stack["url"], api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad_key.messages.create(model="glm-5.2", max_tokens=4, messages=MSG)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=MSG)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="glm-5.2", max_tokens=0, messages=MSG)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="hidden", messages=MSG)  # a model this key may not use
    with pytest.raises(anthropic.AuthenticationError):
        bad_key.messages.count_tokens(model="glm-5.2", messages=MSG)


def test_bad_input_gets_anthropic_error_shape(stack):
    h = {"x-api-key": KEY_A}
    for raw in (b"{not json", b"[]"):
        r = httpx.post(stack["url"] + "/v1/messages", headers=h, content=raw)
        assert r.status_code == 400
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(stack["url"] + "/v1/messages", headers=h, json={
        "model": "glm-5.2", "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "document"}, {"type": "text", "text": "hi"}]}]})
    assert r.status_code == 200 and r.headers["x-gateway-dropped"] == "messages[0].content[0]=unknown_block"
    r = httpx.post(stack["url"] + "/v1/messages", headers=h,
                   json={"model": "glm-5.2", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": 5}]}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # Bearer works as well as x-api-key (same tenant keys)
    r = httpx.post(stack["url"] + "/v1/messages", headers={"authorization": f"Bearer {KEY_A}"},
                   json={"model": "glm-5.2", "max_tokens": 2, "messages": MSG})
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.post(stack["url"] + "/v1/messages", json={"model": "glm-5.2", "max_tokens": 2, "messages": MSG})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_mid_stream_failure_raises_in_the_sdk_and_is_an_error_event_on_the_wire(stack, client):
    urls = stack["sims"].urls
    for u in urls:
        httpx.post(u + "/_sim/fault", json={"kind": "reset_after_chunks", "n": 3, "count": 1})
    try:
        got = []
        with pytest.raises(anthropic.APIStatusError) as e, \
                client.messages.stream(model="glm-5.2", max_tokens=200, messages=MSG, extra_body=FULL) as s:
            for ev in s:
                got.append(ev.type)
        assert "message_start" in got and "message_stop" not in got
        assert e.value.body["error"]["type"] == "api_error"
        for u in urls:  # the same prompt goes to the same replica (affinity), whose one-shot fault is spent
            httpx.post(u + "/_sim/fault", json={"kind": "reset_after_chunks", "n": 3, "count": 1})
        with httpx.stream("POST", stack["url"] + "/v1/messages", headers={"x-api-key": KEY_A},
                          json={"model": "glm-5.2", "max_tokens": 200, "messages": MSG, "stream": True, **FULL}) as r:
            body = b"".join(r.iter_bytes()).decode()
    finally:
        for u in urls:
            httpx.post(u + "/_sim/fault", json={"kind": "clear"})
    events = [ln for ln in body.splitlines() if ln.startswith("event: ")]
    assert events[-1] == "event: error" and "message_stop" not in body


def test_tenant_limits_apply_through_the_bridge_as_rate_limit_error():
    """The bridge is the chat path: a tenant's requests/min cap refuses the third request, in Anthropic's shape, and
    the Responses API counts against the same bucket."""
    sims, _ = start_sims(1)
    gw = start_gateway(config([sglang_pool("mi355x", sims.urls)], tenants=[
        {"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"],
         "rate_limits": {"requests_per_minute": 2}}]))
    try:
        c = anthropic.Anthropic(base_url=gw.urls[0], api_key=KEY_A, max_retries=0)
        c.messages.create(model="glm-5.2", max_tokens=2, messages=MSG)
        httpx.post(gw.urls[0] + "/v1/responses", headers={"authorization": f"Bearer {KEY_A}"},
                   json={"model": "glm-5.2", "input": "x", "max_output_tokens": 2}).raise_for_status()
        with pytest.raises(anthropic.RateLimitError) as e:
            c.messages.create(model="glm-5.2", max_tokens=2, messages=MSG)
        assert e.value.body["error"]["type"] == "rate_limit_error"
        assert e.value.response.headers.get("retry-after")
    finally:
        gw.stop()
        sims.stop()


def test_overloaded_upstreams_are_529_overloaded_error_stream_or_not(stack, client):
    """Every replica answering 503: the chat path's 503 becomes Anthropic's 529 (the SDK's OverloadedError), also
    for a stream refused before its first byte."""
    for stream in (False, True):
        for u in stack["sims"].urls:
            httpx.post(u + "/_sim/fault", json={"kind": "status", "status": 503, "count": 10})
        try:
            with pytest.raises(anthropic.OverloadedError) as e:
                if stream:
                    with client.messages.stream(model="glm-5.2", max_tokens=4, messages=MSG) as s:
                        s.get_final_message()
                else:
                    client.messages.create(model="glm-5.2", max_tokens=4, messages=MSG)
        finally:
            for u in stack["sims"].urls:
                httpx.post(u + "/_sim/fault", json={"kind": "clear"})
        assert e.value.body["error"]["type"] == "overloaded_error"
        assert e.value.response.headers.get("retry-after")


def test_stop_sequences_end_the_answer_with_stop_sequence(client):
    """The engine stops on the request's stop_sequences (the simulator as SGLang does: matched_stop is the string):
    the Message says stop_reason stop_sequence and which one, streamed or not."""
    m = client.messages.create(model="glm-5.2", max_tokens=2000, messages=[{"role": "user", "content": "Answer, then END."}],
                               stop_sequences=["END", "STOP"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "END"
    with client.messages.stream(model="glm-5.2", max_tokens=2000, stop_sequences=["END"],
                                messages=[{"role": "user", "content": "Answer, then END."}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "END" and "END" not in final.content[0].text
