"""`gateway check` names what would go quietly wrong beyond the SGLang settings preflight covers: a hosted pool is
sent a real one-token request (a wrong key, a model the endpoint does not serve and an endpoint that does not
answer are each a named failure, exit 1 — never `0 server(s)`, rc 0), one URL under two replica names is flagged,
and so is a pool whose model is not the name its SGLang server serves."""

from __future__ import annotations

import subprocess
import sys

import orjson
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.gateway_fixtures import config, sglang_pool
from tests.support import ServerThread, env_without_proxies, free_port, start_sims

KEY = "sk-provider-right"
MODEL = "hosted-glm"


def provider() -> Starlette:
    """A hosted OpenAI-compatible provider as they answer: 401 for a key it does not know, 404 model_not_found for
    a model it does not serve, a completion otherwise."""

    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        if request.headers.get("authorization") != f"Bearer {KEY}":
            return Response(orjson.dumps({"error": {"message": "Incorrect API key provided", "type":
                                                    "invalid_request_error", "code": "invalid_api_key"}}), 401)
        if body.get("model") != MODEL:
            return Response(orjson.dumps({"error": {"message": f"The model `{body.get('model')}` does not exist",
                                                    "type": "invalid_request_error", "code": "model_not_found"}}), 404)
        return Response(orjson.dumps({"id": "c", "object": "chat.completion", "model": MODEL, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}), media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def hosted(name: str, base: str, model: str = MODEL, key_env: str = "CHECK_RIGHT_KEY") -> dict:
    return {"name": name, "kind": "openai", "base_url": base + "/v1", "model": model, "api_key_env": key_env,
            "pricing": {"type": "per_token", "input_per_mtok": 1, "output_per_mtok": 2}}


def test_check_probes_hosted_pools_and_flags_duplicates_and_served_model_mismatches(tmp_path):
    sims, _ = start_sims(3)
    up = ServerThread([provider()]).start()
    try:
        base = up.urls[0]
        dup = sglang_pool("dup", [sims.urls[0], sims.urls[0]])  # one server under two names
        renamed = sglang_pool("renamed", sims.urls[2:], model="someone/else")  # not what the server serves
        pools = [sglang_pool("good", sims.urls[1:2]), dup, renamed, hosted("h-ok", base),
                 hosted("h-key", base, key_env="CHECK_WRONG_KEY"), hosted("h-model", base, model="glm-typo"),
                 hosted("h-down", f"http://127.0.0.1:{free_port()}")]
        cfg = config(pools, models=[{"name": "glm-5.2", "pools": [p["name"] for p in pools]}])
        path = tmp_path / "gw.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = {**env_without_proxies(), "CHECK_RIGHT_KEY": KEY, "CHECK_WRONG_KEY": "sk-not-this-one"}
        r = subprocess.run([sys.executable, "-m", "gateway.cli", "check", "--config", str(path)], env=env,
                           capture_output=True, text=True, timeout=120)
        out = r.stdout
        assert r.returncode == 1, out + r.stderr
        assert "ok    h-ok " in out and "ok    good/good-0" in out, out
        findings = {ln.strip() for ln in out.splitlines() if ln.startswith("  ") or ln.startswith("FAIL  config")}
        assert any(f.startswith("h-key: api_key:") and "401" in f for f in findings), out
        assert any(f.startswith("h-model: model:") and "glm-typo" in f for f in findings), out
        assert any(f.startswith("h-down: reachable:") for f in findings), out
        assert any("duplicate_url" in f and "dup/dup-0 and dup/dup-1" in f for f in findings), out
        assert any(f.startswith("renamed/renamed-0: served_model:") and "zai-org/GLM-5.2" in f for f in findings), out
        assert out.splitlines()[-1] == "4 server(s), 4 hosted pool(s), 5 misconfiguration(s)", out
    finally:
        up.stop()
        sims.stop()
