"""The gateway through the official openai SDK, unchanged but for base_url and api_key, in front of simulated
SGLang replicas over loopback."""

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.config import hash_key
from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import KEY_A, KEY_B, config, sglang_pool, start_gateway
from tests.support import ServerThread, start_sims


@pytest.fixture(scope="module")
def stack():
    sims, reps = start_sims(2)
    fake = FakeOpenAI()
    hosted = ServerThread([fake.app()]).start()
    cfg = config(
        [sglang_pool("mi355x", sims.urls),
         {"name": "hosted", "kind": "openai", "model": "hosted-glm", "base_url": hosted.urls[0] + "/v1",
          "pricing": {"type": "per_token", "input_per_mtok": 1.0, "cached_input_per_mtok": 0.2, "output_per_mtok": 3.0}}],
        models=[{"name": "glm-5.2", "pools": ["mi355x"]}, {"name": "glm-hosted", "pools": ["hosted"]},
                {"name": "secret-model", "pools": ["mi355x"]}],
        tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2", "glm-hosted"],
                  "max_concurrent": 50},
                 {"name": "tenant-b", "api_key_hashes": [hash_key(KEY_B)], "models": ["secret-model"], "max_concurrent": 1}],
        max_body_bytes=200_000,
    )
    gw = start_gateway(cfg)
    yield {"gw": gw, "sims": sims, "reps": reps, "fake": fake, "base": gw.urls[0] + "/v1"}
    gw.stop()
    hosted.stop()
    sims.stop()


@pytest.fixture
def client(stack):
    return OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)


MSG = [{"role": "user", "content": "Tell me about prefix caches."}]
FULL = {"ignore_eos": True}  # the simulator then generates exactly max_tokens


def test_chat_non_stream(client):
    r = client.chat.completions.with_raw_response.create(model="glm-5.2", messages=MSG, max_tokens=12, extra_body=FULL)
    c = r.parse()
    assert c.model == "glm-5.2"  # the client's name, not the upstream's
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 12
    assert r.headers["x-gateway-pool"] == "mi355x" and r.headers["x-gateway-replica"].startswith("mi355x-")
    assert float(r.headers["x-gateway-cost-usd"]) > 0


def test_chat_stream_relays_every_chunk_and_hides_usage_unless_asked(client):
    chunks = list(client.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=20, stream=True,
                                                 extra_body=FULL))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.choices for ch in chunks), "usage chunk must be stripped when include_usage was not asked"
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert len(text.split()) == 20
    assert all(ch.model == "glm-5.2" for ch in chunks)


def test_stream_usage_with_cached_tokens(client):
    """Usage chunk shown when asked; a repeated prompt reports cached tokens (round-robin over 2 replicas,
    so the third send lands where the first did)."""
    prompt = [{"role": "user", "content": "cache me " * 400}]
    usages = []
    for _ in range(3):
        chunks = list(client.chat.completions.create(model="glm-5.2", messages=prompt, max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True}, extra_body=FULL))
        assert chunks[-1].choices == []
        usages.append(chunks[-1].usage)
    assert usages[0].prompt_tokens == usages[2].prompt_tokens > 800
    assert max(u.prompt_tokens_details.cached_tokens for u in usages) >= 768


def test_completions_stream_and_non_stream(client):
    r = client.completions.create(model="glm-5.2", prompt="Once upon a time", max_tokens=7, extra_body=FULL)
    assert r.object == "text_completion" and r.usage.completion_tokens == 7
    chunks = list(client.completions.create(model="glm-5.2", prompt="Once upon a time", max_tokens=7, stream=True,
                                             extra_body=FULL))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text.split()) for c in chunks) == 7


def test_tools_and_n(client):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
    r = client.chat.completions.create(model="glm-5.2", messages=MSG, tools=tools, tool_choice="required", max_tokens=16)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.name == "search"
    chunks = list(client.chat.completions.create(model="glm-5.2", messages=MSG, tools=tools, tool_choice="required",
                                                 max_tokens=16, stream=True))
    calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls and calls[0].choices[0].delta.tool_calls[0].function.name == "search"
    many = client.chat.completions.create(model="glm-5.2", messages=MSG, n=3, max_tokens=5)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]


def test_content_parts_and_unknown_fields_pass_through_untouched(stack):
    c = OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)
    fake = stack["fake"]
    fake.bodies.clear()
    c.chat.completions.create(model="glm-hosted", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                              max_completion_tokens=5, extra_body={"ignore_eos": True, "custom_thing": {"a": [1, 2]}},
                              user="u-42", seed=7)
    body = fake.bodies[-1]
    assert body["model"] == "hosted-glm"
    assert body["custom_thing"] == {"a": [1, 2]} and body["ignore_eos"] is True and body["user"] == "u-42"
    assert body["messages"][0]["content"] == [{"type": "text", "text": "hi"}] and body["seed"] == 7
    assert "authorization" not in {k.lower() for k in fake.headers[-1]} or KEY_A not in str(fake.headers[-1])


def test_hosted_pool_stream_requests_usage_upstream(stack):
    c = OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)
    fake = stack["fake"]
    chunks = list(c.chat.completions.create(model="glm-hosted", messages=MSG, stream=True))
    assert fake.bodies[-1]["stream_options"] == {"include_usage": True}
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "hi there friend"
    assert all(ch.choices for ch in chunks)


def test_request_id_round_trip(client):
    r = client.chat.completions.with_raw_response.create(model="glm-5.2", messages=MSG, max_tokens=2,
                                                         extra_headers={"x-request-id": "req-abc-123"})
    assert r.headers["x-request-id"] == "req-abc-123"
    assert r.parse()._request_id == "req-abc-123"
    auto = client.chat.completions.with_raw_response.create(model="glm-5.2", messages=MSG, max_tokens=2)
    assert len(auto.headers["x-request-id"]) >= 16


def test_models_lists_only_what_the_key_may_use(stack):
    a = OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)
    assert sorted(m.id for m in a.models.list()) == ["glm-5.2", "glm-hosted"]
    assert a.models.retrieve("glm-5.2").id == "glm-5.2"
    with pytest.raises(openai.NotFoundError):
        a.models.retrieve("secret-model")


# -- error statuses -> SDK exception classes --------------------------------------------------------------------
def test_400_invalid_fields(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="glm-5.2", messages=[], max_tokens=2)
    assert e.value.status_code == 400 and e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=-3)


def test_400_malformed_json_and_non_object(stack):
    for raw in (b"{nope", b"[1,2]", b""):
        r = httpx.post(stack["base"] + "/chat/completions", content=raw,
                       headers={"authorization": f"Bearer {KEY_A}", "content-type": "application/json"})
        assert r.status_code == 400
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_400_from_upstream_keeps_status_and_message(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="glm-5.2", prompt=[[]], max_tokens=2)
    assert "empty" in str(e.value).lower()


def test_401(stack):
    bad = OpenAI(base_url=stack["base"], api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="glm-5.2", messages=MSG)
    r = httpx.get(stack["base"] + "/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_403_pool_pin_not_allowed(client):
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="glm-5.2", messages=MSG, extra_headers={"x-gateway-pool": "hosted"})


def test_404_unknown_and_foreign_models_look_the_same(client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model", messages=MSG)
    with pytest.raises(openai.NotFoundError) as foreign:
        client.chat.completions.create(model="secret-model", messages=MSG)
    assert unknown.value.body["code"] == foreign.value.body["code"] == "model_not_found"
    assert "secret-model" not in str(unknown.value) and "tenant-b" not in str(foreign.value)


def test_413_body_too_large(client):
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "x" * 300_000}])
    assert e.value.status_code == 413


def test_429_with_retry_after(stack):
    """tenant-b may have one request in flight; a second concurrent one gets 429 + Retry-After."""
    import threading

    b = OpenAI(base_url=stack["base"], api_key=KEY_B, max_retries=0)
    started = threading.Event()

    def slow():
        s = b.chat.completions.create(model="secret-model", messages=MSG, max_tokens=400, stream=True, extra_body=FULL)
        for _ in s:
            started.set()

    t = threading.Thread(target=slow)
    t.start()
    assert started.wait(10)
    with pytest.raises(openai.RateLimitError) as e:
        b.chat.completions.create(model="secret-model", messages=MSG, max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1"
    t.join(30)


def test_502_when_every_upstream_fails(stack):
    fake = stack["fake"]
    fake.status = 500
    try:
        c = OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="glm-hosted", messages=MSG)
        assert e.value.status_code == 502
        assert e.value.response.headers["x-should-retry"] == "false"
        assert "provider says no" in str(e.value)
    finally:
        fake.status = 200


def test_upstream_429_everywhere_becomes_503_with_retry_after(stack):
    fake = stack["fake"]
    fake.status = 429
    try:
        c = OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="glm-hosted", messages=MSG, stream=True)
        assert e.value.status_code == 503 and "retry-after" in e.value.response.headers
    finally:
        fake.status = 200


def test_504_first_byte_timeout():
    fake = FakeOpenAI()
    fake.delay = 3.0
    up = ServerThread([fake.app()]).start()
    gw = start_gateway(config([{"name": "slow", "kind": "openai", "model": "m", "base_url": up.urls[0] + "/v1"}],
                              timeouts={"first_byte": 0.5}))
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            c.chat.completions.create(model="glm-5.2", messages=MSG)
        assert e.value.status_code == 504 and e.value.body["code"] == "timeout"
    finally:
        gw.stop()
        up.stop()


def test_inband_upstream_error_mid_stream_is_an_error_event(stack):
    fake = stack["fake"]
    fake.inband_error_after = 1
    try:
        c = OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)
        got = []
        with pytest.raises(openai.APIError) as e:
            for ch in c.chat.completions.create(model="glm-hosted", messages=MSG, stream=True):
                got.append(ch)
        assert "overloaded" in str(e.value)
        assert got  # something was relayed before the failure
    finally:
        fake.inband_error_after = None


def test_metrics_endpoint(stack, client):
    client.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=2)
    text = httpx.get(stack["gw"].admin_url + "/metrics").text
    for name in ("gateway_requests_total", "gateway_ttft_seconds_bucket", "gateway_request_duration_seconds",
                 "gateway_inflight_requests", "gateway_tokens_total", "gateway_cost_usd_total",
                 "gateway_routing_decisions_total"):
        assert name in text
    assert KEY_A not in text and "prefix caches" not in text


def test_health_and_ready(stack):
    u = stack["gw"].urls[0]
    assert httpx.get(u + "/healthz").json() == {"status": "ok"}
    assert httpx.get(u + "/readyz").status_code == 200
    nf = httpx.get(u + "/nope")
    assert nf.status_code == 404 and nf.json()["error"]["type"] == "invalid_request_error"
