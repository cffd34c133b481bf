"""The API the client spoke (chat, completions, responses, messages) labels the request metrics and the request log
line, over HTTP through the official SDKs: bridged requests are no longer counted as chat ones."""

from __future__ import annotations

import logging
import re

import anthropic
import httpx
import orjson
import pytest
from openai import OpenAI

from gateway.config import hash_key
from gateway.observability.metrics import APIS, api_for_path
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(orjson.loads(record.getMessage()))


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(1)
    gw = start_gateway(config([sglang_pool("mi355x", sims.urls)],
                              tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"]}]))
    handler = _Lines()
    logger = logging.getLogger("gateway.requests")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield {"gw": gw, "root": gw.urls[0], "admin": gw.admin_url, "log": handler}
    logger.removeHandler(handler)
    gw.stop()
    sims.stop()


def _counts(admin_url: str, name: str = "gateway_requests_total") -> dict[tuple[str, str], float]:
    """(api, status) -> count."""
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(admin_url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = (labels["api"], labels.get("status", ""))
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _delta(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def test_each_api_counts_and_logs_under_its_own_label(stack):
    root, adm, log = stack["root"], stack["admin"], stack["log"]
    before = _counts(adm)
    oa = OpenAI(base_url=root + "/v1", api_key=KEY_A, max_retries=0)
    an = anthropic.Anthropic(base_url=root, api_key=KEY_A, max_retries=0)
    ids = []
    r = oa.chat.completions.with_raw_response.create(model="glm-5.2", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=4)
    ids.append(("chat", r.headers["x-request-id"]))
    r = oa.completions.with_raw_response.create(model="glm-5.2", prompt="hi", max_tokens=4)
    ids.append(("completions", r.headers["x-request-id"]))
    r = oa.responses.with_raw_response.create(model="glm-5.2", input="hi", max_output_tokens=4)
    ids.append(("responses", r.headers["x-request-id"]))
    assert list(oa.responses.create(model="glm-5.2", input="hi", max_output_tokens=4, stream=True))
    r = an.messages.with_raw_response.create(model="glm-5.2", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    ids.append(("messages", r.headers["x-request-id"]))
    with an.messages.stream(model="glm-5.2", max_tokens=4, messages=[{"role": "user", "content": "hi"}]) as s:
        s.get_final_message()
    with pytest.raises(anthropic.AuthenticationError):  # refused inside the chat path: still the messages API
        anthropic.Anthropic(base_url=root, api_key="sk-wrong", max_retries=0).messages.create(
            model="glm-5.2", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError):  # refused by the bridge before it: counted by the edge's refusals
        an.messages.create(model="glm-5.2", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    wait_until(lambda: sum(_delta(before, _counts(adm)).values()) == 8, what="8 requests counted")
    assert _delta(before, _counts(adm)) == {("chat", "200"): 1, ("completions", "200"): 1, ("responses", "200"): 2,
                                             ("messages", "200"): 2, ("messages", "401"): 1, ("messages", "400"): 1}
    latency = _counts(adm, "gateway_request_duration_seconds_count")
    ttft = _counts(adm, "gateway_ttft_seconds_count")
    for api in ("chat", "completions", "responses", "messages"):
        assert latency.get((api, ""), 0) > 0 and ttft.get((api, ""), 0) > 0
    by_id = {line["request_id"]: line for line in log.lines}
    for api, rid in ids:
        assert by_id[rid]["api"] == api and by_id[rid]["status"] == "200"
    # a bridged request still says which path served it
    assert by_id[ids[2][1]]["endpoint"] == "chat/completions"
    assert sum(1 for line in log.lines if line.get("api") == "messages" and line.get("status") == "401") == 1
    assert sum(1 for line in log.lines if line.get("api") == "messages" and line.get("status") == "400") == 1


def test_the_label_is_bounded():
    assert {api_for_path(p) for p in ("/v1/chat/completions", "/v1/completions", "/v1/responses/resp_1",
                                      "/v1/messages/count_tokens", "/v1/models", "/admin/x", "/../etc")} <= set(APIS)
    assert api_for_path("/v1/models") == "other"
