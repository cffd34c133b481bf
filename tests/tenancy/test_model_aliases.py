"""Model aliases in tenant policy: the names agents ask for (`claude-*`, `gpt-5*`, an exact `gpt-5-codex`) answered
by a served model, the response reporting the name asked for, the alias's default output cap applied when the
request names none, listed by /v1/models and the admin API, and hot-reloaded with the policy files. Labels and the
log line name the served model (a glob must not mint metric label values)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from gateway.config import hash_key
from gateway.policy_schema import Tenant
from tests.gateway_fixtures import config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until
from tests.tenancy.test_tenancy import ADMIN, admin, write_policies

KEY = "sk-alias"
ALIASES = """api_key_hashes: [{h}]
models: [glm-5.2]
model_aliases:
  - {{match: gpt-5-codex, model: glm-5.2, max_output_tokens: 7}}
  - {{match: "claude-*", model: glm-5.2}}
  - {{match: "gpt-5*", model: glm-5.2, max_output_tokens: 3}}
"""


@pytest.fixture
def gateway(tmp_path):
    sims, _ = start_sims(1)
    write_policies(tmp_path, {"agents": ALIASES.format(h=hash_key(KEY))})
    cfg = config([sglang_pool("mi355x", sims.urls)], admin={"token_hashes": [hash_key(ADMIN)]},
                 policies={"dir": str(tmp_path), "watch_interval_s": 0.1})
    del cfg["tenants"]
    gw = start_gateway(cfg)
    yield gw, tmp_path
    gw.stop()
    sims.stop()


def test_aliases_answer_agent_model_names_with_the_served_model(gateway):
    gw, _ = gateway
    client = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY, max_retries=0)
    r = client.chat.completions.with_raw_response.create(model="claude-sonnet-4-5", messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=2)
    assert r.parse().model == "claude-sonnet-4-5"  # the name the client asked for
    # the exact alias wins over the glob that also matches; each applies its own default cap
    full = {"ignore_eos": True}
    assert client.chat.completions.create(model="gpt-5-codex", messages=[{"role": "user", "content": "hi"}],
                                          extra_body=full).usage.completion_tokens == 7
    assert client.chat.completions.create(model="gpt-5.1", messages=[{"role": "user", "content": "hi"}],
                                          extra_body=full).usage.completion_tokens == 3
    # the Responses and Messages bridges resolve them too, and report the name asked for
    resp = client.responses.create(model="gpt-5.1", input="hi", extra_body=full)
    assert resp.model == "gpt-5.1" and resp.usage.output_tokens == 3
    m = httpx.post(gw.urls[0] + "/v1/messages", headers={"x-api-key": KEY},
                   json={"model": "claude-opus-4-7[1m]", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert m.status_code == 200 and m.json()["model"] == "claude-opus-4-7[1m]"
    # a name no alias matches is still 404
    r404 = httpx.post(gw.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": "llama-3", "messages": [{"role": "user", "content": "hi"}]})
    assert r404.status_code == 404
    metrics = httpx.get(gw.admin_url + "/metrics").text
    assert 'model="claude-sonnet-4-5"' not in metrics and 'model="glm-5.2"' in metrics


def test_aliases_are_listed_and_admin_visible_and_hot_reloaded(gateway):
    gw, tmp_path = gateway
    h = {"authorization": f"Bearer {KEY}"}
    ids = [c["id"] for c in httpx.get(gw.urls[0] + "/v1/models", headers=h).json()["data"]]
    assert ids == ["glm-5.2", "gpt-5-codex"]  # exact aliases; a glob names no one model
    card = httpx.get(gw.urls[0] + "/v1/models/claude-haiku-4-5", headers=h).json()
    assert card["id"] == "claude-haiku-4-5" and card["root"] == "glm-5.2"
    assert httpx.get(gw.urls[0] + "/v1/models/claude-haiku-4-5", headers={"x-api-key": KEY}).status_code == 200
    listed = admin(gw, "GET", "/admin/policies").json()["model_aliases"]["agents"]
    assert [a["match"] for a in listed] == ["gpt-5-codex", "claude-*", "gpt-5*"]
    # the policy file changes: the glob is gone, live within a few watch periods
    write_policies(tmp_path, {"agents": f"api_key_hashes: [{hash_key(KEY)}]\nmodels: [glm-5.2]\n"
                                        "model_aliases: [{match: gpt-5-codex, model: glm-5.2}]\n"})
    wait_until(lambda: "claude-*" not in str(admin(gw, "GET", "/admin/policies").json()), timeout=5)
    r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers=h,
                   json={"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404


def test_an_alias_must_name_one_of_the_tenants_models():
    with pytest.raises(ValueError, match=r"model_aliases\[0\].model"):
        Tenant(name="t", api_key_hashes=["0" * 64], models=["glm-5.2"],
               model_aliases=[{"match": "claude-*", "model": "other"}])
    t = Tenant(name="t", api_key_hashes=["0" * 64], models=["glm-5.2", "gpt-5"],
               model_aliases=[{"match": "gpt-*", "model": "glm-5.2"}])
    assert t.alias_for("gpt-5") is None  # a model the tenant serves itself is never aliased
    assert t.alias_for("gpt-4o").model == "glm-5.2" and t.alias_for("claude") is None
