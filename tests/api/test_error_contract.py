"""The errors agents act on, on every endpoint: the key is checked before the body (a wrong key with a bad body is a
401, never a 400), a 4xx the same request would meet again says `x-should-retry: false` (the OpenAI and Anthropic
SDKs otherwise retry with backoff: Claude Code hung for minutes on a bad key), and every refusal's request-log line
carries the model as read, the API and a bounded reason."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

CHAT = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ENDPOINTS = {  # path -> (a valid body, how the key is sent)
    "/v1/chat/completions": (CHAT, "bearer"),
    "/v1/completions": ({"model": "glm-5.2", "prompt": "hi", "max_tokens": 2}, "bearer"),
    "/v1/responses": ({"model": "glm-5.2", "input": "hi", "max_output_tokens": 2}, "bearer"),
    "/v1/responses/input_tokens": ({"model": "glm-5.2", "input": "hi"}, "bearer"),
    "/v1/messages": ({"model": "glm-5.2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, "x-api-key"),
    "/v1/messages/count_tokens": ({"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}]}, "x-api-key"),
}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(json.loads(record.getMessage()))
        except ValueError:
            pass


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(1)
    gw = start_gateway(config([sglang_pool("mi355x", sims.urls)], tenants=[
        {"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"],
         "model_aliases": [{"match": "claude-*", "model": "glm-5.2"}]}]))
    lines = Lines()
    logging.getLogger("gateway.requests").addHandler(lines)
    yield {"url": gw.urls[0], "log": lines}
    logging.getLogger("gateway.requests").removeHandler(lines)
    gw.stop()
    sims.stop()


def _headers(kind: str, key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if kind == "bearer" else {"x-api-key": key}


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_the_key_is_checked_before_the_body_and_final_4xx_say_do_not_retry(stack, path):
    body, kind = ENDPOINTS[path]
    url = stack["url"] + path
    for bad_body in (b"{not json", b'{"model": 5}', b"[]"):
        r = httpx.post(url, headers=_headers(kind, "sk-wrong"), content=bad_body)
        assert r.status_code == 401, (path, bad_body, r.text)
        assert r.headers["x-should-retry"] == "false"
    r = httpx.post(url, headers=_headers(kind, KEY_A), content=b'{"model": 5}')
    assert r.status_code == 400 and r.headers["x-should-retry"] == "false", r.text
    r = httpx.post(url, headers=_headers(kind, KEY_A), json={**body, "model": "no-such-model"})
    assert r.status_code == 404 and r.headers["x-should-retry"] == "false", r.text
    r = httpx.post(url, headers=_headers(kind, KEY_A), json=body)
    assert r.status_code == 200, r.text


def test_other_endpoints_say_do_not_retry_on_final_4xx(stack):
    url = stack["url"]
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/nope"), ("GET", "/v1/responses/resp_abc"),
                         ("POST", "/v1/no-such-path")):
        r = httpx.request(method, url + path, headers={"authorization": "Bearer sk-wrong"})
        assert r.status_code == 401 and r.headers["x-should-retry"] == "false", (path, r.text)
        r = httpx.request(method, url + path, headers={"authorization": f"Bearer {KEY_A}"})
        if r.status_code >= 400:
            assert r.status_code == 404 and r.headers["x-should-retry"] == "false", (path, r.text)


@pytest.mark.parametrize("path,body,kind,model,reason", [
    # refused by the bridge's own translation (the body was read): the model as read, the error's code and field
    ("/v1/messages", {"model": "claude-x", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
     "x-api-key", "glm-5.2", "invalid_request_error (max_tokens)"),
    ("/v1/messages", {"model": "glm-5.2", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": "x"}]}]}, "x-api-key", "glm-5.2", "invalid_request_error (messages[0].content[0].source)"),
    ("/v1/messages/count_tokens", {"model": "no-such", "messages": [{"role": "user", "content": "hi"}]},
     "x-api-key", "no-such", "model_not_found (model)"),
    ("/v1/responses", {"model": "glm-5.2", "input": "x", "background": True}, "bearer", "glm-5.2",
     "invalid_request_error (background)"),
    # refused by the chat path behind the bridge: its own accounting names the model and the API
    ("/v1/messages", {"model": "glm-5.2", "max_tokens": 5, "temperature": 0.5, "top_p": 0.5,
                      "messages": [{"role": "user", "content": "hi"}], "top_k": -1}, "x-api-key", "glm-5.2", None),
    ("/v1/responses", {"model": "nope", "input": "x"}, "bearer", "unknown", "model_not_found (model)"),
])
def test_every_refusal_is_logged_with_model_api_and_reason(stack, path, body, kind, model, reason):
    log = stack["log"]
    mark = len(log.lines)
    r = httpx.post(stack["url"] + path, headers=_headers(kind, KEY_A), json=body)
    assert 400 <= r.status_code < 500, r.text
    refused = [ln for ln in log.lines[mark:] if ln["status"] == str(r.status_code)]
    assert len(refused) == 1, log.lines[mark:]
    line = refused[0]
    assert line["model"] == model and line["api"] == ("messages" if "messages" in path else "responses")
    assert line["error"] and len(line["error"]) <= 200
    if reason is not None:
        assert line["error"] == reason


def test_a_wrong_key_is_logged_as_auth_on_every_bridge(stack):
    log = stack["log"]
    for path, (body, kind) in ENDPOINTS.items():
        mark = len(log.lines)
        httpx.post(stack["url"] + path, headers=_headers(kind, "sk-wrong"), json=body)
        line = next(ln for ln in log.lines[mark:] if ln["status"] == "401")
        assert line["reason"] == "auth" and line["tenant"] == "none", (path, line)
