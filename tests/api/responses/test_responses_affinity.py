"""A previous_response_id chain continues on the replica that served its stored turn even when the prefix index has
forgotten it (cleared here, as after an index expiry, a restart, or another instance's unshared index): the stored
record names the replica and routing takes it as a prefix-match floor (gateway/routing/pipeline.py)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

FULL = {"ignore_eos": True}


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(4)
    gw = start_gateway(config([sglang_pool("mi355x", sims.urls)],
                              tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"]}]))
    yield {"gw": gw, "base": gw.urls[0] + "/v1"}
    gw.stop()
    sims.stop()


def _forget(gw) -> None:
    """Empty the gateway's prefix index (in-memory: no shared state in this stack)."""
    index = gw.app.state.gateway.router.index

    def clear() -> None:
        for key in index.replicas():
            index.drop_replica_sync(key)

    gw.call(clear)
    assert gw.call(index.size_sync) == 0


def test_next_turn_lands_on_the_stored_turns_replica_with_the_index_cleared(stack):
    client = OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)
    moved_without_hint = 0
    for conv in range(8):
        # turn 1: ~3 chunks; turn 2: ~11, so its cold placement key (chunk 8) is one turn 1 never had
        first = f"Conversation {conv}. " + "Background the assistant should keep in mind. " * 70
        r1 = client.responses.with_raw_response.create(model="glm-5.2", input=first, max_output_tokens=8,
                                                       extra_body=FULL)
        replica = r1.headers["x-gateway-replica"]
        out1 = r1.parse().output_text
        second = f"Follow-up {conv}: " + "More detail about the question being asked here. " * 170
        _forget(stack["gw"])
        r2 = client.responses.with_raw_response.create(model="glm-5.2", input=second, max_output_tokens=8,
                                                       previous_response_id=r1.parse().id, extra_body=FULL)
        assert r2.headers["x-gateway-replica"] == replica
        assert r2.headers["x-gateway-route"] == "prefix_hit"  # the floor made it a hit, not a cold placement
        # control: the same prompt sent as chat (no stored turn, so no hint) goes where cold placement says
        _forget(stack["gw"])
        chat = httpx.post(stack["base"] + "/chat/completions", headers={"authorization": f"Bearer {KEY_A}"}, json={
            "model": "glm-5.2", "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": first}, {"role": "assistant", "content": out1},
                         {"role": "user", "content": second}]}, timeout=30)
        assert chat.status_code == 200
        moved_without_hint += chat.headers["x-gateway-replica"] != replica
    assert moved_without_hint > 0  # without the hint some of these turns would have left their replica
