"""A refusal that an on-call change caused says so. Pinned to a pool whose replicas cannot take it, a tenant's 503
names the pin (and how to lift it), in the message and in `x-gateway-override`; the same refusal without the pin
names nothing — so an on-call reading a 503 at 3 a.m. sees their own override in it."""

from __future__ import annotations

import httpx

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

ADM = {"authorization": "Bearer adm", "x-admin-actor": "oncall"}
BODY = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_a_503_caused_by_a_pin_names_the_pin():
    sims, _ = start_sims(2)
    cfg = config([sglang_pool("p", sims.urls[:1]), sglang_pool("q", sims.urls[1:])],
                 models=[{"name": "glm-5.2", "pools": ["p", "q"]}], admin={"token_hashes": [hash_key("adm")]})
    gw = start_gateway(cfg)
    ask = lambda: httpx.post(gw.urls[0] + "/v1/chat/completions", json=BODY, timeout=30,  # noqa: E731
                             headers={"authorization": f"Bearer {KEY_A}"})
    try:
        assert httpx.post(gw.admin_url + "/admin/replicas/q-0/drain", headers=ADM).status_code == 200
        assert ask().status_code == 200  # p serves: the drained q is not needed
        r = httpx.put(gw.admin_url + "/admin/tenants/tenant-a/override", headers=ADM, json={"ttl_s": 600, "pin_pool": "q"})
        assert r.status_code == 200
        refused = ask()
        assert refused.status_code == 503
        msg = refused.json()["error"]["message"]
        assert "on-call override of tenant 'tenant-a'" in msg and "pin_pool=q" in msg and "--clear" in msg, msg
        assert "pin_pool=q" in refused.headers["x-gateway-override"]
        # the same refusal with no override in force names none
        assert httpx.delete(gw.admin_url + "/admin/tenants/tenant-a/override", headers=ADM).status_code == 200
        assert httpx.post(gw.admin_url + "/admin/replicas/p-0/drain", headers=ADM).status_code == 200
        plain = ask()
        assert plain.status_code == 503 and "override" not in plain.json()["error"]["message"]
        assert "x-gateway-override" not in plain.headers
    finally:
        gw.stop()
        sims.stop()
