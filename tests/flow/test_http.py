"""Flow control on the request path: the real app over loopback HTTP to simulated replicas."""

from __future__ import annotations

import httpx
import pytest

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, KEY_B, config, sglang_pool, start_gateway
from tests.support import start_sims

ADMIN = "admin-flow-token"
BODY = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def gw():
    sims, _ = start_sims(2)
    tenants = [{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"],
                "flow": {"band": "standard", "weight": 3, "client_bands": ["critical"]}},
               {"name": "tenant-b", "api_key_hashes": [hash_key(KEY_B)], "models": ["glm-5.2"],
                "flow": {"band": "sheddable"}}]
    st = start_gateway(config([sglang_pool("p", sims.urls)], tenants=tenants, flow={"enabled": True},
                              admin={"token_hashes": [hash_key(ADMIN)]}))
    yield st
    st.stop()
    sims.stop()


def post(gw, key: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{gw.urls[0]}/v1/chat/completions", json=BODY, timeout=30,
                      headers={"authorization": f"Bearer {key}", **headers})


def test_requests_are_served_in_their_policys_band(gw):
    """Each answer names the band it was served in: the policy's, whatever the client asks for, unless the policy
    lists the band the client asks for."""
    a, b = post(gw, KEY_A), post(gw, KEY_B, **{"x-gateway-band": "critical"})
    assert (a.status_code, a.headers["x-gateway-band"]) == (200, "standard")
    assert (b.status_code, b.headers["x-gateway-band"]) == (200, "sheddable")  # not in its client_bands
    assert "x-gateway-flow-wait-ms" in b.headers  # two tenants seen: held, let through by the pump on its decision
    c = post(gw, KEY_A, **{"x-gateway-band": "critical"})
    assert (c.status_code, c.headers["x-gateway-band"]) == (200, "critical")


def test_grants_are_counted_per_tenant_and_band(gw):
    post(gw, KEY_A)
    text = httpx.get(f"{gw.admin_url}/metrics", timeout=10).text
    assert 'gateway_flow_granted_total{band="standard",held="' in text and 'tenant="tenant-a"' in text
    assert "gateway_flow_fairness" in text


def test_an_unknown_band_in_a_policy_fails_the_load_naming_the_field():
    from gateway.config import ConfigError, parse_config

    tenants = [{"name": "t", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"], "flow": {"band": "gold"}}]
    with pytest.raises(ConfigError, match=r"tenants\[0\]\.flow\.band: unknown band 'gold'"):
        parse_config(config([sglang_pool("p", ["http://127.0.0.1:1"])], tenants=tenants))


def test_admin_moves_a_tenant_to_another_band_live_and_the_change_is_audited(gw):
    """An on-call override changes the band (and weight) the next request is served in, on every instance through
    the control plane; an unknown band is a 400 naming the field; the change is in the audit log."""
    h = {"authorization": f"Bearer {ADMIN}"}
    bad = httpx.put(f"{gw.admin_url}/admin/tenants/tenant-b/override", json={"ttl_s": 60, "flow_band": "gold"},
                    headers=h, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "flow_band"
    ok = httpx.put(f"{gw.admin_url}/admin/tenants/tenant-b/override",
                   json={"ttl_s": 60, "flow_band": "critical", "flow_weight": 5}, headers=h, timeout=10)
    assert ok.status_code == 200, ok.text
    assert post(gw, KEY_B).headers["x-gateway-band"] == "critical"
    audit = httpx.get(f"{gw.admin_url}/admin/audit", headers=h, timeout=10).text
    assert "tenant-b" in audit and "critical" in audit
    flow = httpx.get(f"{gw.admin_url}/admin/flow", headers=h, timeout=10).json()
    assert flow["enabled"] is True and "fairness" in flow
    httpx.delete(f"{gw.admin_url}/admin/tenants/tenant-b/override", headers=h, timeout=10)
    assert post(gw, KEY_B).headers["x-gateway-band"] == "sheddable"


def test_the_admin_cli_moves_a_tenant_to_another_band(gw, capsys):
    from gateway.cli import main

    assert main(["admin", "override", "tenant-b", "--flow-band", "standard", "--flow-weight", "2", "--ttl", "60",
                 "--url", gw.admin_url, "--token", ADMIN]) == 0
    assert post(gw, KEY_B).headers["x-gateway-band"] == "standard"
    assert main(["admin", "override", "tenant-b", "--clear", "--url", gw.admin_url, "--token", ADMIN]) == 0
    assert post(gw, KEY_B).headers["x-gateway-band"] == "sheddable"
