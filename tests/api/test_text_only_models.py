"""A model configured `vision: false` (a text-only model such as GLM-5.2): an image is refused with 400 in the API's
own shape on the OpenAI APIs (as OpenAI and the engines refuse one for a text-only model), before any replica sees
it; on the Anthropic Messages API, whose models all take images, the image is left out, a note put in its place, and
the request served with the image named in x-gateway-dropped. The default (`vision: true`) forwards images."""

from __future__ import annotations

import httpx
import pytest

from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

PNG = "data:image/png;base64,iVBORw0KGgo="
AUTH = {"authorization": f"Bearer {KEY_A}"}


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(1)
    pools = [sglang_pool("p", sims.urls)]
    text_only = start_gateway(config(pools, models=[{"name": "glm-5.2", "pools": ["p"], "vision": False}]))
    vision = start_gateway(config(pools))
    yield sims, text_only, vision
    text_only.stop()
    vision.stop()
    sims.stop()


def _served(sims) -> int:
    return int(httpx.get(f"{sims.urls[0]}/_sim/state").json()["ranks"][0]["counters"]["requests"])


CHAT_IMAGE = {"model": "glm-5.2", "max_tokens": 4, "messages": [
    {"role": "user", "content": "first"},
    {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                 {"type": "image_url", "image_url": {"url": PNG}}]}]}


def test_chat_image_to_a_text_only_model_is_a_400_naming_the_part(stack):
    sims, text_only, _ = stack
    before = _served(sims)
    r = httpx.post(text_only.urls[0] + "/v1/chat/completions", headers=AUTH, json=CHAT_IMAGE, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "image_input_not_supported" and err["param"] == "messages[1].content[1]"
    assert err["type"] == "invalid_request_error" and "glm-5.2" in err["message"]
    assert r.headers["x-should-retry"] == "false"
    assert _served(sims) == before  # refused at the edge: no replica spent a prefill on it


def test_responses_input_image_to_a_text_only_model_is_a_400_in_the_responses_shape(stack):
    _, text_only, _ = stack
    body = {"model": "glm-5.2", "max_output_tokens": 4, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": PNG}]}]}
    r = httpx.post(text_only.urls[0] + "/v1/responses", headers=AUTH, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "image_input_not_supported"


def test_messages_image_to_a_text_only_model_is_served_without_it_and_named(stack):
    _, text_only, _ = stack
    body = {"model": "glm-5.2", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "what is this?"}]}]}
    headers = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
    r = httpx.post(text_only.urls[0] + "/v1/messages", headers=headers, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"
    assert r.headers["x-gateway-dropped"] == "messages[0].content[0]=image"
    counted = httpx.post(text_only.urls[0] + "/v1/messages/count_tokens", headers=headers,
                         json={k: v for k, v in body.items() if k != "max_tokens"}, timeout=30)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    bad = {**body, "messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]}
    r = httpx.post(text_only.urls[0] + "/v1/messages", headers=headers, json=bad, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"  # malformed is still the client's 400


def test_images_are_forwarded_by_default(stack):
    _, _, vision = stack
    r = httpx.post(vision.urls[0] + "/v1/chat/completions", headers=AUTH, json=CHAT_IMAGE, timeout=30)
    assert r.status_code == 200, r.text
