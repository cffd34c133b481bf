"""An agent session's requests share one cold placement: Claude Code's x-claude-code-session-id (Messages) and
Codex's prompt_cache_key / session_id (Responses) key the ring, so a session's first turns and its subagents (whose
prompts share no prefix yet) land on one replica; without a session, unrelated prompts spread over the replicas."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

SESSIONS = 8


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("mi355x", sims.urls)]))
    yield gw.urls[0]
    gw.stop()
    sims.stop()


def _message(url: str, prompt: str, session: str | None) -> str:
    headers = {"x-api-key": KEY_A, **({"x-claude-code-session-id": session} if session else {})}
    r = httpx.post(url + "/v1/messages", headers=headers, timeout=30,
                   json={"model": "glm-5.2", "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]})
    assert r.status_code == 200, r.text
    return r.headers["x-gateway-replica"]


def _response(url: str, prompt: str, session: str | None) -> str:
    body = {"model": "glm-5.2", "input": prompt, "max_output_tokens": 2, "store": False,
            **({"prompt_cache_key": session} if session else {})}
    r = httpx.post(url + "/v1/responses", headers={"authorization": f"Bearer {KEY_A}"}, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers["x-gateway-replica"]


@pytest.mark.parametrize("send", [_message, _response])
def test_a_sessions_unrelated_prompts_land_together(stack, send):
    for i in range(SESSIONS):
        main = send(stack, f"main agent {i}: plan the work", f"session-{send.__name__}-{i}")
        sub = send(stack, f"subagent {i}: search the code", f"session-{send.__name__}-{i}")
        assert main == sub, i
    apart = [send(stack, f"main agent {i}: plan", None) != send(stack, f"subagent {i}: search", None)
             for i in range(SESSIONS)]
    assert any(apart)  # without a session key the same pairs do not all land together
