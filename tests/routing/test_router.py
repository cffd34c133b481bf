"""The router end to end: shared placement across gateway instances, cache-hit feedback, Redis outages."""

import threading
import time

import httpx
import pytest
from openai import OpenAI

from gateway.config import ConfigError
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import RedisServer, start_sims, wait_until


def long_prompt(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"[{tag}] " + "shared agent context " * 600},
            {"role": "user", "content": f"question {time.monotonic_ns()}"}]


def send(gw, messages, **kw):
    c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
    r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=messages, max_tokens=4,
                                                    extra_body={"ignore_eos": True}, **kw)
    return r.headers, r.parse()


def routing_cfg(urls, redis_url=None, **extra):
    cfg = config([sglang_pool("p", urls)], **extra)
    if redis_url:
        cfg["routing"] = {**cfg.get("routing", {}), "redis_url": redis_url, "redis_prefix": f"t{time.monotonic_ns()}:"}
    return cfg


@pytest.fixture(scope="module")
def fleet():
    sims, reps = start_sims(4)
    yield sims, reps
    sims.stop()


def test_two_instances_share_prefix_placement_through_redis(fleet, redis_server):
    """What A places, B finds in Redis. The Redis timeout is generous here: this checks sharing, and on a busy
    2-core machine one 0.1 s round trip can run late (that is answered from the local mirror, by design)."""
    sims, _ = fleet
    cfg = routing_cfg(sims.urls, redis_server.url, routing={"redis_timeout_s": 2.0})
    a, b = start_gateway(cfg), start_gateway(cfg)
    try:
        for k in range(3):
            msgs = long_prompt(f"group-{k}")
            h1, _ = send(a, msgs)
            h2, r2 = send(b, msgs[:1] + [{"role": "user", "content": "a different question"}])
            assert h1["x-gateway-replica"] == h2["x-gateway-replica"]
            assert h2["x-gateway-route"] == "prefix_hit"
            # what routing expected of the replica: the cached prefix shortens the predicted first token
            assert 0 < int(h2["x-gateway-ttft-predicted-ms"]) < int(h1["x-gateway-ttft-predicted-ms"])
            assert r2.usage.prompt_tokens_details.cached_tokens >= 3000  # the shared system prompt (3,150 tokens) came from cache
    finally:
        a.stop()
        b.stop()


def test_redis_password_from_the_environment(fleet, monkeypatch):
    """A Redis that requires AUTH, its password only in an env var (as a Kubernetes Secret provides it): the two
    instances share placement through it; the variable unset refuses to start rather than silently running
    unshared."""
    sims, _ = fleet
    secured = RedisServer(password="s3cret-pw")
    try:
        cfg = routing_cfg(sims.urls, secured.url)
        cfg["routing"]["redis_password_env"] = "GW_TEST_REDIS_PASSWORD"
        monkeypatch.delenv("GW_TEST_REDIS_PASSWORD", raising=False)
        with pytest.raises(ConfigError, match=r"redis_password_env: \$GW_TEST_REDIS_PASSWORD is not set"):
            start_gateway(cfg)
        monkeypatch.setenv("GW_TEST_REDIS_PASSWORD", "s3cret-pw")
        a, b = start_gateway(cfg), start_gateway(cfg)
        try:
            msgs = long_prompt("secured")
            h1, _ = send(a, msgs)
            h2, r2 = send(b, msgs[:1] + [{"role": "user", "content": "another question"}])
            assert (h2["x-gateway-replica"], h2["x-gateway-route"]) == (h1["x-gateway-replica"], "prefix_hit")
            assert r2.usage.prompt_tokens_details.cached_tokens >= 3000
        finally:
            a.stop()
            b.stop()
    finally:
        secured.stop()


def test_instances_agree_on_cold_placement_without_talking(fleet):
    """No shared state at all (in-memory): consistent hashing still puts a new prefix on the same replica."""
    sims, _ = fleet
    cfg = routing_cfg(sims.urls)
    a, b = start_gateway(cfg), start_gateway(cfg)
    try:
        placed = []
        for k in range(6):
            msgs = long_prompt(f"cold-{k}")
            placed.append((send(a, msgs)[0]["x-gateway-replica"], send(b, msgs)[0]["x-gateway-replica"]))
        assert all(x == y for x, y in placed)
        assert len({x for x, _ in placed}) >= 2  # and new prefixes spread over the fleet
    finally:
        a.stop()
        b.stop()


def test_stale_entry_corrected_after_replica_restart(fleet):
    sims, _ = fleet
    gw = start_gateway(routing_cfg(sims.urls, health={"enabled": False}))
    try:
        msgs = long_prompt("restart")
        h, _ = send(gw, msgs)
        replica = h["x-gateway-replica"]
        i = int(replica.rsplit("-", 1)[1])
        h, r = send(gw, msgs)
        assert h["x-gateway-replica"] == replica and r.usage.prompt_tokens_details.cached_tokens > 3000
        before = httpx.get(sims.urls[i] + "/server_info").json()["incarnation"]
        httpx.post(sims.urls[i] + "/_sim/fault", json={"kind": "restart"})

        def restarted() -> bool:
            info = httpx.get(sims.urls[i] + "/server_info").json()
            return info["incarnation"] != before and info["status"] == "ready"

        wait_until(restarted, timeout=5, what="the replica restarted")
        h, r = send(gw, msgs)  # predicted warm, the engine says cold: the stale entries are dropped
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        counted = 'gateway_prefix_index_corrections_total{pool="p"} 1.0'
        wait_until(lambda: counted in httpx.get(gw.admin_url + "/metrics").text, timeout=5, what="the correction counted")
        _, r2 = send(gw, msgs)  # re-learned from this request's own insertion: warm again
        assert r2.usage.prompt_tokens_details.cached_tokens > 3000
    finally:
        gw.stop()


def test_redis_killed_mid_run_loses_no_request(fleet):
    sims, _ = fleet
    srv = RedisServer()
    cfg = routing_cfg(sims.urls, srv.url)
    a, b = start_gateway(cfg), start_gateway(cfg)
    errors, ok = [], []
    stop = threading.Event()

    def client(gw, tag):
        n = 0
        while not stop.is_set():
            try:
                h, _ = send(gw, long_prompt(f"{tag}-{n % 3}"))
                ok.append(h["x-gateway-replica"])
            except Exception as e:  # noqa: BLE001 - any failure is what this test counts
                errors.append(repr(e))
            n += 1

    threads = [threading.Thread(target=client, args=(g, t)) for g, t in ((a, "A"), (b, "B"), (a, "C"))]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(ok) >= 6, timeout=10, what="traffic flowing before the outage")
        before = len(ok)
        srv.kill()
        time.sleep(1.5)
        during = len(ok) - before
        srv.start()
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(30)
        assert errors == []
        assert during > 0 and len(ok) > before + during
    finally:
        stop.set()
        a.stop()
        b.stop()
        srv.stop()


def test_replicas_are_known_before_the_first_request(fleet):
    """The start awaits the first preflight: each simulator's incarnation (part of its prefix index key) is known
    when serving begins, so a request's entries are not dropped as a restart's when the preflight lands after it
    (a CI run lost the first request's placement that way)."""
    sims, _ = fleet
    incarnations = {str(httpx.get(u + "/server_info").json()["incarnation"]) for u in sims.urls}
    gw = start_gateway(routing_cfg(sims.urls))
    try:
        keys = [t.index_key for ts in gw.app.state.gateway.registry.servers().values() for t in ts]
        assert len(keys) == 4 and {k.split("@", 1)[1] for k in keys} == incarnations
    finally:
        gw.stop()


def test_explain_is_a_dry_run_with_inputs(fleet):
    from gateway.config import hash_key

    sims, _ = fleet
    gw = start_gateway(routing_cfg(sims.urls, admin={"token_hashes": [hash_key("admin-secret")]}))
    try:
        msgs = long_prompt("explain")
        h, _ = send(gw, msgs)
        body = {"tenant": "tenant-a", "request": {"model": "glm-5.2", "messages": msgs}}
        r = httpx.post(gw.admin_url + "/admin/explain", json=body, headers={"authorization": "Bearer admin-secret"})
        assert r.status_code == 200
        d = r.json()["decision"]
        assert d["branch"] == "prefix_hit" and d["chosen"] == h["x-gateway-replica"]
        assert len(d["candidates"]) == 4 and all("predicted_ttft_s" in c and c["regime"] == "free" for c in d["candidates"])
        assert max(c["cached_tokens"] for c in d["candidates"]) >= 2800
        assert httpx.post(gw.admin_url + "/admin/explain", json=body).status_code == 401
        assert httpx.post(gw.admin_url + "/admin/explain", json=body, headers={"authorization": "Bearer nope"}).status_code == 401
        bad = httpx.post(gw.admin_url + "/admin/explain", json={"tenant": "x"}, headers={"authorization": "Bearer admin-secret"})
        assert bad.status_code == 400
        reps = httpx.get(gw.admin_url + "/admin/replicas", headers={"authorization": "Bearer admin-secret"}).json()
        assert {r["name"] for r in reps["replicas"]} == {"p-0", "p-1", "p-2", "p-3"} and reps["prefix_index_entries"] > 0
    finally:
        gw.stop()


def test_unmeetable_sla_sheds_with_retry_after_or_spills(fleet):
    """A key whose TTFT target no replica can meet: `shed` answers 503 + Retry-After before any upstream work;
    `spill` (the default) still serves it from the least predicted TTFT."""
    import openai

    from gateway.config import hash_key

    sims, _ = fleet
    tenants = [{"name": "strict", "api_key_hashes": [hash_key("sk-strict")], "models": ["glm-5.2"],
                "ttft_sla_ms": 10, "on_sla_miss": "shed"},
               {"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"], "ttft_sla_ms": 10}]
    gw = start_gateway(routing_cfg(sims.urls, tenants=tenants))
    try:
        strict = OpenAI(base_url=gw.urls[0] + "/v1", api_key="sk-strict", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            strict.chat.completions.create(model="glm-5.2", messages=long_prompt("shed"), max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["code"] == "server_is_overloaded"
        assert int(e.value.response.headers["retry-after"]) >= 1
        h, r = send(gw, long_prompt("spill"))
        assert h["x-gateway-route"] == "sla_miss_least_ttft" and r.usage.completion_tokens == 4
        assert 'gateway_routing_decisions_total{branch="shed",model="glm-5.2"} 1.0' in httpx.get(gw.admin_url + "/metrics").text
    finally:
        gw.stop()
