"""Failures caused by a request are that client's error, and failures caused by the gateway's upstream credentials
are the gateway's: neither may close replicas to everyone (real simulator over loopback, the openai SDK)."""

import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.config import hash_key
from tests.gateway_fixtures import (
    KEY_A,
    KEY_B,
    config,
    sglang_pool,
    start_gateway,
)
from tests.support import start_sims, wait_until

MSG = [{"role": "user", "content": "blast radius"}]


def _tenants():
    return [{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"]},
            {"name": "tenant-b", "api_key_hashes": [hash_key(KEY_B)], "models": ["glm-5.2"]}]


def _breaker_gauges(admin_url: str) -> list[str]:
    text = httpx.get(admin_url + "/metrics").text
    return [ln for ln in text.splitlines() if ln.startswith("gateway_replica_circuit_open{")]


def test_content_caused_failures_of_one_tenant_do_not_open_breakers_for_others():
    """Three content-caused failures from tenant A: A gets a 4xx naming the problem each time, nothing is counted
    against the replicas, and tenant B's requests on the same instance keep succeeding."""
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], tenants=_tenants(), routing={"policy": "round_robin"}))
    try:
        a = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        b = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_B, max_retries=0)
        for _ in range(2):  # both replicas are serving traffic
            b.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=2)
        # (1) an impossible token id: refused by the edge or by the engine, either way a 400 that names it
        for _ in range(3):
            with pytest.raises(openai.BadRequestError) as e:
                a.completions.create(model="glm-5.2", prompt=[1099511627776], max_tokens=3)
            assert "1099511627776" in str(e.value) or "token" in str(e.value).lower()
            b.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=2)
        # (2) a failure the edge cannot see: the engine answers this body with a 500 on every replica it reaches
        # (the simulator's queued one-shot faults, set on both replicas just before A's request)
        for i in range(3):
            for u in sims.urls:
                httpx.post(u + "/_sim/fault", json={"kind": "status", "status": 500, "count": 1})
            with pytest.raises(openai.BadRequestError) as e:
                a.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": f"bad {i}"}], max_tokens=2)
            err = e.value.body
            assert err["code"] == "upstream_rejected_request" and err["type"] == "invalid_request_error"
            assert "2 model server replicas" in err["message"] and "status 500" in err["message"]
            assert e.value.response.headers["x-should-retry"] == "false"
            assert e.value.response.headers["x-gateway-attempts"] == "2"
            for _ in range(2):
                r = b.chat.completions.with_raw_response.create(model="glm-5.2", messages=MSG, max_tokens=2)
                assert r.http_response.status_code == 200
        states = gw.call(lambda: {t.name: t.breaker.state.value for t in gw.app.state.gateway.registry.targets})
        assert set(states.values()) == {"closed"}
        gauges = _breaker_gauges(gw.admin_url)
        assert all(ln.endswith(" 0.0") for ln in gauges)
        caused = [ln for ln in httpx.get(gw.admin_url + "/metrics").text.splitlines()
                  if ln.startswith("gateway_request_caused_failures_total")]
        assert caused and float(caused[0].split()[-1]) >= 3
    finally:
        gw.stop()
        sims.stop()


def test_a_5xx_the_same_body_does_not_meet_elsewhere_counts_against_the_replica():
    """The other half of the rule: a body that fails on one replica and succeeds on the next is served, and the
    failure is the first replica's (replica-level evidence, counted toward its breaker)."""
    sims, _ = start_sims(2)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"policy": "round_robin"}, health={"enabled": False}))
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "status", "status": 500, "count": 3})
        served = []
        for i in range(6):  # round robin: three of them start on p-0
            r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=[{"role": "user", "content": f"q{i}"}],
                                                            max_tokens=2)
            served.append(r.headers["x-gateway-replica"])
        assert set(served) == {"p-1"}
        assert gw.call(lambda: gw.app.state.gateway.registry.get("p-0").breaker.state.value) == "open"
    finally:
        gw.stop()
        sims.stop()


def test_wrong_upstream_key_is_a_502_about_the_gateways_credentials(caplog):
    """A pool configured with a wrong key for its SGLang servers (--api-key): clients get a 502 that names the
    gateway's upstream credentials, never a 401 that blames their own key; the replicas stay routable."""
    sims, _ = start_sims(2, api_key="right-key")
    os.environ["H3_TEST_WRONG_UPSTREAM_KEY"] = "wrong-key"
    pool = {**sglang_pool("p", sims.urls), "api_key_env": "H3_TEST_WRONG_UPSTREAM_KEY"}
    gw = start_gateway(config([pool]))
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as e:
                c.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=2, stream=stream)
            assert e.value.status_code == 502
            assert not isinstance(e.value, openai.AuthenticationError)
            assert e.value.body["code"] == "upstream_credentials_rejected"
            assert "gateway's upstream credentials" in e.value.body["message"] and "'p'" in e.value.body["message"]
            assert e.value.response.headers["x-should-retry"] == "false"
            assert e.value.response.headers["x-gateway-attempts"] == "1"  # the pool's other replica shares the key
        states = gw.call(lambda: {t.name: t.breaker.state.value for t in gw.app.state.gateway.registry.targets})
        assert set(states.values()) == {"closed"}
        oncall = [r.getMessage() for r in caplog.records if r.name == "gateway.dispatch" and r.levelname == "ERROR"]
        assert len(oncall) == 1 and "credentials for pool p" in oncall[0]  # once a minute per pool, not per request
        assert "wrong-key" not in " ".join(r.getMessage() for r in caplog.records)
    finally:
        os.environ.pop("H3_TEST_WRONG_UPSTREAM_KEY", None)
        gw.stop()
        sims.stop()


def test_a_hosted_pool_whose_key_is_refused_everywhere_is_a_credentials_error_not_overload(caplog):
    """A provider that refuses the pool's key refuses its health probe too. The probe used to mark the endpoint
    unhealthy, and clients got 503 "overloaded" (retried, hiding the cause). The endpoint is up: it stays routable,
    clients get the credentials error (502, x-should-retry false), and the probe's finding is logged for on-call."""
    from tests.fakes.openai_upstream import FakeOpenAI
    from tests.support import ServerThread

    fake = FakeOpenAI()
    fake.status = 401
    fake.error_body = {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                                 "code": "invalid_api_key"}}
    up = ServerThread([fake.app()]).start()
    gw = start_gateway(config([{"name": "h", "kind": "openai", "model": "m", "base_url": up.urls[0] + "/v1"}]))
    try:
        st = gw.app.state.gateway
        wait_until(lambda: gw.call(lambda: st.registry.targets[0].state.credentials_rejected), what="the probe ran")
        wait_until(lambda: gw.call(lambda: st.registry.targets[0].state.health_failures) == 0, what="two rounds")
        assert gw.call(lambda: st.registry.targets[0].healthy)
        r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                       json={"model": "glm-5.2", "messages": MSG, "max_tokens": 2})
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_credentials_rejected"
        assert r.headers["x-should-retry"] == "false"
        probe_lines = [x.getMessage() for x in caplog.records if x.name == "gateway.health" and x.levelname == "ERROR"]
        assert probe_lines and "pool h" in probe_lines[0]
    finally:
        gw.stop()
        up.stop()


def test_504_after_every_attempt_timed_out_names_the_attempts():
    """One replica that never answers: the 504 carries x-gateway-attempts and says a retry will not help."""
    sims, _ = start_sims(1)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], timeouts={"first_byte": 0.5}))
    try:
        httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "hang", "count": 1})
        r = httpx.post(gw.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                       json={"model": "glm-5.2", "messages": MSG, "max_tokens": 2}, timeout=10)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        assert r.headers["x-gateway-attempts"] == "1" and r.headers["x-should-retry"] == "false"
    finally:
        gw.stop()
        sims.stop()


def test_timeouts_on_a_replica_that_serves_others_are_not_held_against_it():
    """Tenant A's requests (three different bodies) each hang until the first-byte timeout while tenant B's requests
    on the same replica are answered: the replica is alive, so its breaker counts nothing. The same timeout on a
    replica that answered no one in the meantime does count."""
    sims, _ = start_sims(1)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], tenants=_tenants(), timeouts={"first_byte": 1.0},
                              health={"enabled": False}))
    try:
        b = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_B, max_retries=0)

        def a_request(i: int) -> int:
            httpx.post(sims.urls[0] + "/_sim/fault", json={"kind": "hang", "count": 1})
            return httpx.post(gw.urls[0] + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                              json={"model": "glm-5.2", "messages": [{"role": "user", "content": f"slow {i}"}],
                                    "max_tokens": 2}, timeout=10).status_code

        with ThreadPoolExecutor(1) as pool:
            for i in range(3):
                status = pool.submit(a_request, i)
                wait_until(lambda: httpx.get(sims.urls[0] + "/_sim/state").json()["inflight"] >= 1, timeout=5,
                           what="A's request waiting on the replica")
                b.chat.completions.create(model="glm-5.2", messages=MSG, max_tokens=2)  # answered meanwhile
                assert status.result() == 504
        breaker = gw.call(lambda: (gw.app.state.gateway.registry.get("p-0").breaker.failures,
                                   gw.app.state.gateway.registry.get("p-0").breaker.state.value))
        assert breaker == (0, "closed")
        assert a_request(99) == 504  # nobody else answered while it waited: replica-level evidence
        assert gw.call(lambda: gw.app.state.gateway.registry.get("p-0").breaker.failures) == 1
    finally:
        gw.stop()
        sims.stop()


def test_one_tenants_bad_bodies_cannot_open_a_single_target_pool_for_others():
    """A hosted endpoint is a pool of one target: no second replica can tell a body's fault from the target's, so
    three bodies from tenant A that the provider answers with a 500 used to open its breaker — every tenant then got
    503 on that pool for the cooldown. Evidence is counted per tenant: A gets its 502s, B keeps 100%. Failures from
    two tenants are evidence about the target, and do open it (the contrast that makes the rule meaningful)."""
    from tests.fakes.openai_upstream import FakeOpenAI
    from tests.support import ServerThread

    fake = FakeOpenAI()
    fake.fail_if = lambda body: "poison" in str(body.get("messages"))
    fake.error_body = {"error": {"message": "internal error", "type": "server_error", "code": None}}
    up = ServerThread([fake.app()]).start()
    gw = start_gateway(config([{"name": "h", "kind": "openai", "model": "hosted-glm", "base_url": up.urls[0] + "/v1"}],
                              tenants=_tenants(), circuit_breaker={"failure_threshold": 3, "cooldown_s": 30.0}))
    try:
        a = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        b = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_B, max_retries=0)
        for i in range(3):
            with pytest.raises(openai.InternalServerError):
                a.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": f"poison {i}"}],
                                          max_tokens=2)
        ok = sum(b.chat.completions.with_raw_response.create(model="glm-5.2", messages=MSG, max_tokens=2)
                 .http_response.status_code == 200 for _ in range(20))
        assert ok == 20
        assert gw.call(lambda: gw.app.state.gateway.registry.targets[0].breaker.state.value) == "closed"
        # consecutive failures from two tenants are the target's fault: it opens
        for client, i in ((a, 3), (a, 4), (b, 5)):
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": f"poison {i}"}],
                                               max_tokens=2)
        assert gw.call(lambda: gw.app.state.gateway.registry.targets[0].breaker.state.value) == "open"
    finally:
        gw.stop()
        up.stop()
