"""The `litellm` pool kind: other providers through litellm, imported only when such a pool is used."""

import subprocess
import sys

import pytest
from openai import OpenAI

from tests.gateway_fixtures import KEY_A, config, start_gateway
from tests.support import env_without_proxies, start_sims

pytest.importorskip("litellm", reason="the litellm extra is not installed")


def test_litellm_pool_serves_chat_and_stream():
    sims, _ = start_sims(1)
    pool = {"name": "via-litellm", "kind": "litellm", "model": "hosted_vllm/zai-org/GLM-5.2",
            "api_base": sims.urls[0] + "/v1", "pricing": {"type": "per_token", "input_per_mtok": 1, "output_per_mtok": 2}}
    gw = start_gateway(config([pool]))
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=6, extra_body={"ignore_eos": True})
        assert r.headers["x-gateway-pool"] == "via-litellm"
        body = r.parse()
        assert body.model == "glm-5.2" and body.usage.completion_tokens == 6
        chunks = list(c.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert len(text.split()) == 6
    finally:
        gw.stop()
        sims.stop()


def test_litellm_is_not_imported_for_other_pool_kinds():
    code = (
        "from gateway.app import create_app\n"
        "from gateway.config import parse_config\n"
        "from tests.gateway_fixtures import config, sglang_pool\n"
        "import sys\n"
        "create_app(parse_config(config([sglang_pool('p', ['http://127.0.0.1:9'])])))\n"
        "print('litellm' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_without_proxies(), cwd=".")
    assert out.stdout.strip() == "False", out.stderr
