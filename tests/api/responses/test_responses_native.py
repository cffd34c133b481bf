"""Native pass-through (`responses: native`): /v1/responses forwarded to a pool's own /v1/responses (FakeOpenAI
standing in for a hosted provider that serves it), through the official openai SDK, with the chat path's tenancy,
rate limits, budgets and usage accounting applied, and the conversation kept by the gateway (upstream store=false)."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.config import ConfigError, hash_key, parse_config
from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import KEY_A, KEY_B, config, start_gateway
from tests.support import ServerThread

PRICING = {"type": "per_token", "input_per_mtok": 1.0, "cached_input_per_mtok": 0.5, "output_per_mtok": 2.0}


@pytest.fixture(scope="module")
def stack():
    fake, chat_only = FakeOpenAI(), FakeOpenAI()
    up = ServerThread([fake.app(), chat_only.app()]).start()
    cfg = config([{"name": "hosted", "kind": "openai", "model": "hosted-glm", "base_url": up.urls[0] + "/v1",
                   "responses": "native", "pricing": PRICING},
                  {"name": "bridged", "kind": "openai", "model": "other-glm", "base_url": up.urls[1] + "/v1"}],
                 models=[{"name": "glm-native", "pools": ["hosted"]}, {"name": "glm-chat", "pools": ["bridged"]}],
                 tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-native"]},
                          {"name": "tenant-b", "api_key_hashes": [hash_key(KEY_B)], "models": ["glm-native"],
                           "rate_limits": {"requests_per_minute": 2}},
                          {"name": "tenant-c", "api_key_hashes": [hash_key("sk-test-poor")], "models": ["glm-native"],
                           "budget": {"usd_per_day": 0.0001}},
                          {"name": "tenant-d", "api_key_hashes": [hash_key("sk-test-fallback")],
                           "models": ["glm-native"], "fallback_pools": ["bridged"]}])
    gw = start_gateway(cfg)
    yield {"gw": gw, "fake": fake, "chat_only": chat_only, "base": gw.urls[0] + "/v1", "root": gw.urls[0], "admin": gw.admin_url}
    gw.stop()
    up.stop()


@pytest.fixture
def client(stack):
    stack["fake"].bodies.clear()
    stack["fake"].responses_cut_after = None
    stack["fake"].response_ids = "resp_{hex}"
    return OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)


def _metric(admin_url: str, name: str, **labels: str) -> float:
    text = httpx.get(admin_url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_non_stream_is_forwarded_to_the_pools_responses_endpoint(stack, client):
    cached_before = _metric(stack["admin"], "gateway_tokens_total", pool="hosted", type="cached_prompt")
    cost_before = _metric(stack["admin"], "gateway_cost_usd_total", pool="hosted", tenant="tenant-a")
    r = client.responses.with_raw_response.create(model="glm-native", input="Hello", instructions="Be brief.")
    resp = r.parse()
    [body] = stack["fake"].bodies
    assert body["model"] == "hosted-glm" and body["input"] == "Hello" and body["instructions"] == "Be brief."
    assert body["store"] is False and "stream_options" not in body  # the gateway keeps the state
    assert resp.output_text == "hi there friend" and resp.model == "glm-native"  # the client's model name
    assert resp.usage.input_tokens == 7 and resp.usage.input_tokens_details.cached_tokens == 2
    assert r.headers["x-gateway-replica"] == "hosted" and float(r.headers["x-gateway-cost-usd"]) > 0
    # accounted by the chat path's accounting: Responses usage mapped (cached_tokens included)
    assert _metric(stack["admin"], "gateway_tokens_total", pool="hosted", type="cached_prompt") == cached_before + 2
    # priced like a chat request: 5 uncached + 2 cached input, 3 output tokens
    assert _metric(stack["admin"], "gateway_cost_usd_total", pool="hosted", tenant="tenant-a") == pytest.approx(
        cost_before + (5 * 1.0 + 2 * 0.5 + 3 * 2.0) / 1e6)
    assert client.responses.retrieve(resp.id).output_text == "hi there friend"
    assert client.responses.delete(resp.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_stream_relays_the_upstreams_events(stack, client):
    events = list(client.responses.create(model="glm-native", input="Stream it.", stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "hi there friend" and final.model == "glm-native"
    assert final.usage.input_tokens_details.cached_tokens == 2
    [body] = stack["fake"].bodies
    assert body["stream"] is True and "stream_options" not in body and body["store"] is False
    assert client.responses.retrieve(final.id).output_text == "hi there friend"  # stored when it completed


def test_chain_history_is_the_gateways_and_another_tenants_id_is_404(stack, client):
    r1 = client.responses.create(model="glm-native", input="First question.")
    r2 = client.responses.create(model="glm-native", input="Second question.", previous_response_id=r1.id)
    body = stack["fake"].bodies[-1]
    assert "previous_response_id" not in body and body["store"] is False
    assert [(i.get("role"), i["content"][0]["text"]) for i in body["input"]] == [
        ("user", "First question."), ("assistant", "hi there friend"), ("user", "Second question.")]
    assert not any("id" in i for i in body["input"][:2])  # stored ids mean nothing to a stateless upstream
    items = client.responses.input_items.list(r2.id, order="asc")
    assert [i.type for i in items.data] == ["message", "message", "message"]
    other = OpenAI(base_url=stack["base"], api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model="glm-native", input="Steal it.", previous_response_id=r1.id)
    assert e.value.body["param"] == "previous_response_id"


def test_rate_limits_apply(stack):
    b = OpenAI(base_url=stack["base"], api_key=KEY_B, max_retries=0)
    seen = []
    for _ in range(3):
        try:
            b.responses.create(model="glm-native", input="Hi")
            seen.append(200)
        except openai.RateLimitError:
            seen.append(429)
    assert seen == [200, 200, 429]  # requests_per_minute: 2 (the refused chain above never reached the limiter)


def test_budgets_apply(stack):
    """The worst case (1000 expected output tokens at $2/Mtok) does not fit a $0.0001 day: refused before upstream."""
    n = len(stack["fake"].bodies)
    poor = OpenAI(base_url=stack["base"], api_key="sk-test-poor", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        poor.responses.create(model="glm-native", input="Spend it.")
    assert e.value.code == "insufficient_quota" and len(stack["fake"].bodies) == n


def test_a_bridged_fallback_pool_never_gets_a_responses_body(stack):
    """tenant-d may fall back to a bridge-mode pool: a native request fails over only among native pools."""
    fake = stack["fake"]
    fake.status = 500
    try:
        with pytest.raises(openai.InternalServerError):
            OpenAI(base_url=stack["base"], api_key="sk-test-fallback", max_retries=0).responses.create(
                model="glm-native", input="Fail over?")
    finally:
        fake.status = 200
    assert stack["chat_only"].bodies == []


def test_unknown_key_and_model_refused_like_the_chat_path(stack, client):
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=stack["base"], api_key="sk-nope", max_retries=0).responses.create(model="glm-native", input="x")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")


def test_upstream_error_before_the_stream_is_a_real_http_error(stack, client):
    fake = stack["fake"]
    fake.status, fake.error_body = 400, {"error": {"message": "bad tool", "type": "invalid_request_error",
                                                   "param": "tools", "code": None}}
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="glm-native", input="x", stream=True)
        assert "bad tool" in str(e.value)
    finally:
        fake.status = 200


def test_upstream_cut_mid_stream_ends_with_error_and_response_failed(stack, client):
    stack["fake"].responses_cut_after = 1
    events = list(client.responses.create(model="glm-native", input="Cut me.", stream=True))
    types = [e.type for e in events]
    assert "response.output_text.delta" in types and types[-2:] == ["error", "response.failed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.status == "failed"


def test_an_upstream_id_the_store_cannot_key_is_replaced(stack, client):
    stack["fake"].response_ids = "r-{hex}=="
    resp = client.responses.create(model="glm-native", input="Odd ids.")
    assert re.match(r"^resp_[0-9a-f]+$", resp.id)
    assert client.responses.retrieve(resp.id).output_text == "hi there friend"


def test_config_validates_the_switch():
    base = {"name": "h", "kind": "openai", "model": "m", "base_url": "http://127.0.0.1:1/v1"}
    with pytest.raises(ConfigError, match="litellm pools are always bridged"):
        parse_config(config([{"name": "l", "kind": "litellm", "model": "m", "responses": "native"}]))
    with pytest.raises(ConfigError, match="mixes responses: native and bridge"):
        parse_config(config([{**base, "responses": "native"}, {**base, "name": "g"}]))
    with pytest.raises(ConfigError, match="responses"):
        parse_config(config([{**base, "responses": "sometimes"}]))
    assert parse_config(config([base])).pools[0].responses == "bridge"
