"""`reasoning.effort` reaches each pool's chat/completions as that pool takes it: hosted pools get chat
`reasoning_effort` as sent; SGLang pools only the tiers every 0.5.x accepts (minimal -> low, xhigh -> high, none ->
chat_template_kwargs.enable_thinking false); a mixed route only low / medium / high. Upstream bodies are recorded by
FakeOpenAI standing in for a hosted provider and, under the sglang kind, for an SGLang server; the simulator (typed
like SGLang 0.5.23) checks that what the gateway sends is accepted."""

from __future__ import annotations

from dataclasses import replace

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.api.responses.reasoning import chat_fields
from gateway.config import hash_key
from gateway.upstreams import CAPABILITIES
from tests.fakes.openai_upstream import FakeOpenAI
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, start_sims

SG, HOSTED, MIXED = frozenset({"sglang"}), frozenset({"openai"}), frozenset({"sglang", "litellm"})


@pytest.mark.parametrize(("effort", "kinds", "fields"), [
    (None, SG, {}),
    ("minimal", HOSTED, {"reasoning_effort": "minimal"}),
    ("none", HOSTED, {"reasoning_effort": "none"}),
    ("high", SG, {"reasoning_effort": "high"}),
    ("minimal", SG, {"reasoning_effort": "low"}),
    ("xhigh", SG, {"reasoning_effort": "high"}),
    ("none", SG, {"chat_template_kwargs": {"enable_thinking": False}}),
    ("medium", MIXED, {"reasoning_effort": "medium"}),
    ("minimal", MIXED, {}),  # one of the pools would refuse it: dropped
    ("none", MIXED, {}),
])
def test_chat_fields_per_pool_kind(effort, kinds, fields):
    assert chat_fields(effort, kinds, {}) == fields


def test_the_capability_decides_not_the_kind_name(monkeypatch):
    """A backend kind is narrowed because its capabilities say so: another kind with `narrow_reasoning_effort`
    gets SGLang's treatment, and SGLang without it would get the value as sent."""
    monkeypatch.setitem(CAPABILITIES, "other-engine", replace(CAPABILITIES["sglang"]))
    assert chat_fields("minimal", frozenset({"other-engine"}), {}) == {"reasoning_effort": "low"}
    assert chat_fields("minimal", frozenset({"other-engine", "openai"}), {}) == {}
    monkeypatch.setitem(CAPABILITIES, "sglang", replace(CAPABILITIES["sglang"], narrow_reasoning_effort=False))
    assert chat_fields("minimal", SG, {}) == {"reasoning_effort": "minimal"}


def test_none_on_sglang_keeps_the_clients_other_template_kwargs():
    assert chat_fields("none", SG, {"chat_template_kwargs": {"x": 1}}) == {
        "chat_template_kwargs": {"x": 1, "enable_thinking": False}}


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(1)
    hosted, sg = FakeOpenAI(), FakeOpenAI()
    ups = ServerThread([hosted.app(), sg.app()]).start()
    fake_sglang = {**sglang_pool("fake-sg", [ups.urls[1]]), "health_path": "/v1/models"}
    cfg = config(
        [sglang_pool("sim", sims.urls), fake_sglang,
         {"name": "hosted", "kind": "openai", "model": "hosted-glm", "base_url": ups.urls[0] + "/v1"}],
        models=[{"name": "glm-5.2", "pools": ["sim"]}, {"name": "glm-sg", "pools": ["fake-sg"]},
                {"name": "glm-hosted", "pools": ["hosted"]}, {"name": "glm-mixed", "pools": ["hosted", "fake-sg"]}],
        tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)],
                  "models": ["glm-5.2", "glm-sg", "glm-hosted", "glm-mixed"]}])
    gw = start_gateway(cfg)
    yield {"gw": gw, "hosted": hosted, "sg": sg, "sims": sims, "base": gw.urls[0] + "/v1"}
    gw.stop()
    ups.stop()
    sims.stop()


@pytest.fixture
def client(stack):
    return OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("model", "effort", "upstream", "sent"), [
    ("glm-hosted", "minimal", "hosted", {"reasoning_effort": "minimal"}),
    ("glm-sg", "minimal", "sg", {"reasoning_effort": "low"}),
    ("glm-sg", "high", "sg", {"reasoning_effort": "high"}),
    ("glm-sg", "none", "sg", {"chat_template_kwargs": {"enable_thinking": False}}),
    ("glm-mixed", "minimal", "hosted", {}),
    ("glm-mixed", "low", "hosted", {"reasoning_effort": "low"}),
])
def test_effort_reaches_the_pool_as_it_takes_it(stack, client, stream, model, effort, upstream, sent):
    fake: FakeOpenAI = stack[upstream]
    fake.bodies.clear()
    if stream:
        with client.responses.stream(model=model, input="Think about it.", reasoning={"effort": effort}) as s:
            resp = s.get_final_response()
    else:
        resp = client.responses.create(model=model, input="Think about it.", reasoning={"effort": effort})
    assert resp.status == "completed" and resp.reasoning.effort == effort  # echoed as the client sent it
    [body] = fake.bodies
    assert {k: body[k] for k in ("reasoning_effort", "chat_template_kwargs") if k in body} == sent
    assert "reasoning" not in body  # the Responses field itself never goes upstream


def test_simulated_sglang_accepts_what_the_gateway_sends(client):
    for effort in ("minimal", "high", "none", "xhigh"):
        resp = client.responses.create(model="glm-5.2", input="Think about it.", max_output_tokens=4,
                                       reasoning={"effort": effort})
        assert resp.status in ("completed", "incomplete") and resp.reasoning.effort == effort


def test_simulator_refuses_an_effort_sglang_does_not_take(stack):
    r = httpx.post(stack["sims"].urls[0] + "/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"})
    assert r.status_code == 400 and "reasoning_effort" in r.json()["message"]


def test_bad_effort_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="glm-5.2", input="x", reasoning={"effort": "extreme"})  # type: ignore[typeddict-item]
    assert e.value.body["param"] == "reasoning.effort"
