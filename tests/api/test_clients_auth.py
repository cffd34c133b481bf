"""A bad key is an authentication error in every client (issue 16 item 2): the 401 body matches OpenAI's (message
starting "Incorrect API key provided", type invalid_request_error, code invalid_api_key) so the OpenAI Python and
Node SDKs and litellm all raise their AuthenticationError class, not a BadRequestError; the key is never echoed."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import env_without_proxies, start_sims

BAD_KEY = "sk-bad-0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]
NODE_SDK = ROOT / ".node" / "node_modules"


@pytest.fixture(scope="module")
def gw():
    sims, _ = start_sims(1)
    g = start_gateway(config([sglang_pool("p", sims.urls)]))
    yield g
    g.stop()
    sims.stop()


def test_401_body_is_openais(gw):
    r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {BAD_KEY}"},
                   json={"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["message"].startswith("Incorrect API key provided")
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert BAD_KEY not in r.text and BAD_KEY[-6:] not in r.text


def test_openai_python_sdk_raises_authentication_error(gw):
    c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=BAD_KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        c.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        c.models.list()


def test_litellm_as_a_client_raises_authentication_error(gw):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch of the price list on import
    litellm = pytest.importorskip("litellm", reason="the litellm extra is not installed")
    kw = {"model": "openai/glm-5.2", "api_base": gw.urls[0] + "/v1", "messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 3, "max_retries": 0}
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(api_key=BAD_KEY, **kw)
    assert litellm.completion(api_key=KEY_A, **kw).choices[0].message.content  # a good key goes through


def _node(gw, key: str) -> dict:
    out = subprocess.run(["node", str(Path(__file__).with_name("node_auth_check.cjs")), gw.urls[0] + "/v1", key],
                         env={**env_without_proxies(), "NODE_PATH": str(NODE_SDK)}, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the OpenAI Node SDK cannot run")
def test_openai_node_sdk_raises_authentication_error(gw):
    assert (NODE_SDK / "openai").is_dir(), "the OpenAI Node SDK is missing: run `make setup` (npm install --prefix .node)"
    bad = _node(gw, BAD_KEY)
    assert bad["ok"] is False and bad["auth"] is True and bad["status"] == 401, bad
    assert bad["name"] == "AuthenticationError" and bad["code"] == "invalid_api_key"
    assert BAD_KEY not in bad["message"]
    assert _node(gw, KEY_A)["ok"] is True
