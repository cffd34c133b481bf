"""Nothing that identifies the client's user, installation or session reaches an upstream by default: Codex's
`client_metadata` (installation and session ids), `user` and `safety_identifier` on the Responses bridge, Claude
Code's `metadata.user_id` (device and session ids) and its attribution block on the Messages bridge. A tenant with
`client_metadata: forward` sends them as they came. The upstream's bodies are recorded by FakeOpenAI."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import hash_key
from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import config, start_gateway
from tests.support import ServerThread

STRIP, FORWARD = "sk-strip", "sk-forward"
IDS = "inst-4e1f-secret-device"


@pytest.fixture(scope="module")
def stack():
    fake = FakeOpenAI()
    ups = ServerThread([fake.app()]).start()
    cfg = config([{"name": "hosted", "kind": "openai", "model": "hosted-glm", "base_url": ups.urls[0] + "/v1"}],
                 tenants=[{"name": "strip", "api_key_hashes": [hash_key(STRIP)], "models": ["glm-5.2"]},
                          {"name": "fwd", "api_key_hashes": [hash_key(FORWARD)], "models": ["glm-5.2"],
                           "client_metadata": "forward"}])
    gw = start_gateway(cfg)
    yield gw.urls[0], fake
    gw.stop()
    ups.stop()


def _send(url: str, key: str) -> None:
    r = httpx.post(url + "/v1/responses", headers={"authorization": f"Bearer {key}"}, json={
        "model": "glm-5.2", "input": "hi", "user": f"user-{IDS}", "safety_identifier": f"safety-{IDS}",
        "prompt_cache_key": f"session-{IDS}", "client_metadata": {"x-codex-installation-id": IDS}})
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": key}, json={
        "model": "glm-5.2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.153; cch={IDS};"},
                   {"type": "text", "text": "You are an agent."}],
        "metadata": {"user_id": f'{{"device_id": "{IDS}", "session_id": "s"}}'}})
    assert r.status_code == 200, r.text


def test_client_identifying_fields_stay_at_the_gateway_by_default(stack):
    url, fake = stack
    fake.bodies.clear()
    _send(url, STRIP)
    assert len(fake.bodies) == 2
    for body in fake.bodies:
        assert IDS not in str(body), body
        assert not {"user", "safety_identifier", "client_metadata", "prompt_cache_key"} & set(body)


def test_a_tenant_may_forward_them(stack):
    url, fake = stack
    fake.bodies.clear()
    _send(url, FORWARD)
    responses, messages = fake.bodies
    assert responses["client_metadata"] == {"x-codex-installation-id": IDS} and responses["user"] == f"user-{IDS}"
    assert IDS in messages["user"] and IDS in messages["messages"][0]["content"]
