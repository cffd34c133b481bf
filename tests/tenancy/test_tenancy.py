"""Tenants and on-call, end to end: real Redis, two gateway instances, simulated replicas over loopback, the
openai SDK as the client. Each test states the promise it checks."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.app import create_app
from gateway.config import ConfigError, hash_key, parse_config
from tests.gateway_fixtures import config, sglang_pool, start_gateway
from tests.support import RedisServer, env_without_proxies, start_sims, wait_until

ADMIN = "admin-test-token"
ADMIN_H = {"authorization": f"Bearer {ADMIN}", "x-admin-actor": "alice"}
PER_TOKEN = {"type": "per_token", "input_per_mtok": 1.0, "cached_input_per_mtok": 0.2, "output_per_mtok": 3.2}


def tenant(name: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "api_key_hashes": [hash_key(f"sk-{name}")], "models": ["glm-5.2"], **kw}


def cfg_for(pools: list[dict[str, Any]], tenants: list[dict[str, Any]] | None = None, redis_url: str | None = None,
            **extra: Any) -> dict[str, Any]:
    cfg = config(pools, tenants=tenants or [tenant("a")], admin={"token_hashes": [hash_key(ADMIN)]}, **extra)
    if redis_url:
        cfg["routing"] = {**cfg.get("routing", {}), "redis_url": redis_url, "redis_prefix": f"t{time.monotonic_ns()}:"}
    return cfg


def client(gw: Any, name: str) -> OpenAI:
    return OpenAI(base_url=gw.urls[0] + "/v1", api_key=f"sk-{name}", max_retries=0)


def chat(gw: Any, name: str, content: str = "hello", **kw: Any) -> Any:
    kw.setdefault("max_tokens", 2)
    return client(gw, name).chat.completions.with_raw_response.create(
        model=kw.pop("model", "glm-5.2"), messages=[{"role": "user", "content": content}], **kw)


def admin(gw: Any, method: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.request(method, gw.admin_url + path, headers=ADMIN_H, timeout=10, **kw)


def day_usage(gw: Any, tenant: str = "a") -> dict[str, Any]:
    """`tenant`'s usage today as the instance `gw` reads it (GET /admin/usage)."""
    return dict(admin(gw, "GET", f"/admin/usage?tenant={tenant}").json()["tenants"][tenant]["day"])


@pytest.fixture(scope="module")
def fleet():
    sims, reps = start_sims(3)
    yield sims, reps
    sims.stop()


def test_drain_on_one_instance_stops_traffic_from_the_other(fleet, redis_server):
    sims, _ = fleet
    cfg = cfg_for([sglang_pool("p", sims.urls[:2])], redis_url=redis_server.url, routing={"policy": "round_robin"})
    a, b = start_gateway(cfg), start_gateway(cfg)
    try:
        assert {chat(b, "a").headers["x-gateway-replica"] for _ in range(4)} == {"p-0", "p-1"}
        r = admin(a, "POST", "/admin/replicas/p-0/drain")
        assert r.status_code == 200 and r.json()["drained"] is True
        # how fast it propagates is measured by loadtests/control_propagation.py, not asserted here
        wait_until(lambda: b.call(lambda: b.app.state.gateway.registry.get("p-0").drained), timeout=30,
                   what="instance B to see the drain")
        assert {chat(b, "a").headers["x-gateway-replica"] for _ in range(6)} == {"p-1"}
        admin(a, "POST", "/admin/replicas/p-0/undrain")
        wait_until(lambda: not b.call(lambda: b.app.state.gateway.registry.get("p-0").drained), timeout=30)
        assert {chat(b, "a").headers["x-gateway-replica"] for _ in range(4)} == {"p-0", "p-1"}
        entries = admin(b, "GET", "/admin/audit").json()["entries"]  # one audit log, read from either instance
        assert [e["what"] for e in entries[:2]] == ["undrain", "drain"]
        assert entries[1]["replica"] == "p-0" and entries[1]["who"].endswith("(alice)") and ADMIN not in str(entries)
    finally:
        a.stop()
        b.stop()


def test_draining_every_replica_reports_degraded_but_keeps_the_instance_ready(fleet, redis_server):
    """Readiness must not follow upstreams: with every replica drained the instance stays in its Service and answers
    an OpenAI-shaped 503, rather than every instance dropping out and clients getting connection errors."""
    sims, _ = fleet
    gw = start_gateway(cfg_for([sglang_pool("p", sims.urls[:2])], redis_url=redis_server.url))
    try:
        assert httpx.get(gw.urls[0] + "/readyz").json() == {"status": "ready"}
        for r in ("p-0", "p-1"):
            assert admin(gw, "POST", f"/admin/replicas/{r}/drain").status_code == 200
        ready = httpx.get(gw.urls[0] + "/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "degraded", "models_without_replicas": ["glm-5.2"]}
        with pytest.raises(openai.APIStatusError) as e:
            chat(gw, "a")
        assert e.value.status_code == 503 and e.value.body["type"] in ("service_unavailable_error", "server_error")
        for r in ("p-0", "p-1"):
            admin(gw, "POST", f"/admin/replicas/{r}/undrain")
        assert httpx.get(gw.urls[0] + "/readyz").json() == {"status": "ready"}
        assert chat(gw, "a").status_code == 200
    finally:
        gw.stop()


def test_a_tenant_cannot_reach_or_learn_another_tenants_models_and_pools(fleet):
    sims, _ = fleet
    pools = [sglang_pool("shared-p", sims.urls[:1]), sglang_pool("team-b-private", sims.urls[1:2])]
    models = [{"name": "glm-5.2", "pools": ["shared-p", "team-b-private"]},
              {"name": "b-finetune", "pools": ["team-b-private"]}]
    tenants = [tenant("a", pools=["shared-p"]), tenant("b", models=["glm-5.2", "b-finetune"])]
    gw = start_gateway(config(pools, models, tenants=tenants))
    try:
        seen: list[str] = []
        assert [m.id for m in client(gw, "a").models.list()] == ["glm-5.2"]
        for _ in range(3):
            r = chat(gw, "a")
            seen.append(str(dict(r.headers)) + r.text)
            assert r.headers["x-gateway-pool"] == "shared-p"
        with pytest.raises(openai.NotFoundError) as other:
            chat(gw, "a", model="b-finetune")
        with pytest.raises(openai.NotFoundError) as missing:
            chat(gw, "a", model="no-such-model")
        # the same answer for a model that exists elsewhere and one that does not
        assert other.value.body["code"] == missing.value.body["code"] == "model_not_found"
        assert other.value.body["message"].replace("b-finetune", "X") == missing.value.body["message"].replace("no-such-model", "X")
        with pytest.raises(openai.PermissionDeniedError) as pinned:
            chat(gw, "a", extra_headers={"x-gateway-pool": "team-b-private"})
        with pytest.raises(openai.PermissionDeniedError) as bogus:
            chat(gw, "a", extra_headers={"x-gateway-pool": "nope"})
        assert pinned.value.body == bogus.value.body
        with pytest.raises(openai.NotFoundError):
            client(gw, "a").models.retrieve("b-finetune")
        seen += [str(e.value.body) + str(dict(e.value.response.headers)) for e in (other, missing, pinned, bogus)]
        assert not any("team-b-private" in s or "tenant-b" in s for s in seen)
        assert chat(gw, "b", model="b-finetune").headers["x-gateway-pool"] == "team-b-private"  # b itself can
    finally:
        gw.stop()


def write_policies(root: Path, tenants: dict[str, str], defaults: str = "models: [glm-5.2]\n") -> None:
    (root / "tenants").mkdir(parents=True, exist_ok=True)
    (root / "defaults.yaml").write_text(defaults)
    for name, text in tenants.items():
        (root / "tenants" / f"{name}.yaml").write_text(text)


def test_policy_files_hot_reload_and_an_invalid_change_never_replaces_the_running_policy(fleet, tmp_path):
    sims, _ = fleet
    write_policies(tmp_path, {"a": f"api_key_hashes: [{hash_key('sk-a')}]\n"})
    cfg = cfg_for([sglang_pool("p", sims.urls[:1])], policies={"dir": str(tmp_path), "watch_interval_s": 0.1})
    del cfg["tenants"]
    gw = start_gateway(cfg)
    try:
        assert chat(gw, "a").parse().usage.completion_tokens == 2
        # a broken edit (bad YAML), picked up by the watcher: rejected, reported, and A keeps being served
        (tmp_path / "tenants" / "a.yaml").write_text("api_key_hashes: [oops\n")
        wait_until(lambda: admin(gw, "GET", "/admin/policies").json()["last_error"] is not None, timeout=3)
        assert "tenants/a.yaml: invalid YAML" in admin(gw, "GET", "/admin/policies").json()["last_error"]
        assert chat(gw, "a").parse().usage.completion_tokens == 2
        r = admin(gw, "POST", "/admin/policies/reload")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "running policy stays in force" in r.json()["error"]["message"]
        assert chat(gw, "a").parse().usage.completion_tokens == 2
        # a valid edit: the fixed file plus a new tenant, live within a couple of watch periods
        write_policies(tmp_path, {"a": f"api_key_hashes: [{hash_key('sk-a')}]\n",
                                  "c": f"api_key_hashes: [{hash_key('sk-c')}]\nttft_sla_ms: 5000\n"})
        wait_until(lambda: admin(gw, "GET", "/admin/policies").json()["tenants"] == 2, timeout=3)
        assert admin(gw, "GET", "/admin/policies").json()["last_error"] is None
        assert chat(gw, "c").parse().usage.completion_tokens == 2
        assert 'gateway_policy_reloads_total{result="error"}' in httpx.get(gw.admin_url + "/metrics").text
    finally:
        gw.stop()
    # and a gateway never starts on an invalid directory
    (tmp_path / "tenants" / "c.yaml").write_text("api_key_hashes: [x]\n")
    with pytest.raises(ConfigError, match=r"tenants/c\.yaml: api_key_hashes"):
        create_app(parse_config(cfg))


def test_twenty_concurrent_requests_cannot_push_a_tenant_past_its_budget(fleet, redis_server):
    sims, _ = fleet
    pool = {**sglang_pool("hosted", sims.urls[2:3]), "pricing": PER_TOKEN}
    prompt_tokens, out = 1000, 20
    worst = (prompt_tokens * 1.0 + out * 3.2) / 1e6  # reserved per request: no cache hit, max output
    budget = 5.5 * worst
    cfg = cfg_for([pool], [tenant("a", budget={"usd_per_day": budget})], redis_url=redis_server.url)
    a, b = start_gateway(cfg), start_gateway(cfg)
    ok, refused, other = [], [], []
    barrier = threading.Barrier(20)

    def one(i: int) -> None:
        barrier.wait()
        try:
            # 4,000 characters = 1,000 prompt tokens with the template around them (the shared token rule)
            r = chat((a, b)[i % 2], "a", content=f"{i:04d}" + "x" * 3970, max_tokens=out, extra_body={"ignore_eos": True})
            ok.append(r.parse().usage)
        except openai.RateLimitError as e:
            refused.append(e)
        except Exception as e:  # noqa: BLE001 - anything else is a failure this test reports
            other.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert other == [] and len(ok) + len(refused) == 20
        assert 1 <= len(ok) <= 5 and refused
        e = refused[0]
        assert e.body["code"] == "insufficient_quota" and e.response.headers["x-should-retry"] == "false"
        assert int(e.response.headers["retry-after"]) >= 1
        spent = sum(u.prompt_tokens * 1e-6 + u.completion_tokens * 3.2e-6 for u in ok)
        # both instances read the shared ledger once every settlement is in it: on a machine busy enough that a Redis
        # call times out, an instance settles locally and replays within a second, so this waits rather than races
        wait_until(lambda: all(u["requests"] == len(ok) and u["spent_usd"] == pytest.approx(spent)
                               for u in map(day_usage, (a, b))), timeout=30, what="settlements in the shared ledger")
        assert day_usage(b)["spent_usd"] <= budget and day_usage(b)["reserved_usd"] == pytest.approx(0, abs=1e-12)
    finally:
        a.stop()
        b.stop()


def test_a_stream_the_client_abandons_is_still_charged(fleet):
    """The engine prefilled the prompt and generated until the cancel, but its usage chunk never comes: the tenant is
    charged the gateway's prompt count and at least the tokens relayed, and the reservation is released."""
    sims, _ = fleet
    pool = {**sglang_pool("hosted", sims.urls[2:3]), "pricing": PER_TOKEN}
    gw = start_gateway(cfg_for([pool], [tenant("a", budget={"usd_per_day": 10.0})]))
    try:
        s = client(gw, "a").chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "x" * 4000}],
                                                    max_tokens=20_000, stream=True, extra_body={"ignore_eos": True})
        it = iter(s)
        got = [next(it) for _ in range(4)]  # the role chunk and three content chunks
        s.close()
        wait_until(lambda: day_usage(gw)["requests"] == 1, what="the abandoned stream's settlement")
        day = day_usage(gw)
        assert day["prompt_tokens"] >= 1000 and day["completion_tokens"] >= len(got) - 1
        assert day["spent_usd"] == pytest.approx((day["prompt_tokens"] - day["cached_tokens"]) * 1e-6
                                                 + day["cached_tokens"] * 0.2e-6 + day["completion_tokens"] * 3.2e-6)
        assert day["reserved_usd"] == pytest.approx(0, abs=1e-12)
    finally:
        gw.stop()


def test_a_rate_limit_holds_across_two_instances_within_five_percent(fleet, redis_server):
    """60 requests/min shared by two instances: hammered from both until every client has been refused a few times
    (the bucket is drained, however slow the machine), what passes is the bucket's minute allowance plus its refill
    over the run — not twice that, as per-instance counters would allow."""
    sims, _ = fleet
    cfg = cfg_for([sglang_pool("p", sims.urls[:2])], [tenant("a", rate_limits={"requests_per_minute": 60})],
                  redis_url=redis_server.url)
    a, b = start_gateway(cfg), start_gateway(cfg)
    allowed: list[float] = []
    refused: list[Any] = []
    starts: list[float] = []
    lock = threading.Lock()
    give_up = time.monotonic() + 120  # a ceiling for a wedged run, not a measurement

    def hammer(gw: Any) -> None:
        c = client(gw, "a")
        mine = 0
        while mine < 3 and time.monotonic() < give_up:
            t = time.monotonic()
            with lock:
                starts.append(t)
            try:
                c.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
                allowed.append(t)
            except openai.RateLimitError as e:
                refused.append(e)
                mine += 1

    threads = [threading.Thread(target=hammer, args=((a, b)[i % 2],)) for i in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        elapsed = max(starts) - min(starts)
        expected = 60 + elapsed * 1.0  # full bucket + 1/s refill
        assert 0.95 * expected <= len(allowed) <= 1.05 * expected, (len(allowed), expected)
        h = refused[0].response.headers
        assert h["x-ratelimit-limit-requests"] == "60" and h["x-ratelimit-remaining-requests"] == "0"
        assert float(h["retry-after-ms"]) > 0 and refused[0].body["code"] == "rate_limit_exceeded"
    finally:
        a.stop()
        b.stop()


def test_cache_isolation_by_default_and_sharing_by_group(fleet):
    """The same prompt from two isolated tenants never shares a cached prefix; two tenants of one sharing group do."""
    sims, _ = fleet
    tenants = [tenant("t1"), tenant("t2"), tenant("g1", cache={"sharing_group": "team"}),
               tenant("g2", cache={"sharing_group": "team"})]
    gw = start_gateway(config([sglang_pool("p", sims.urls[:1])], tenants=tenants))
    try:
        def cached(name: str, text: str) -> int:
            return chat(gw, name, content=text).parse().usage.prompt_tokens_details.cached_tokens

        text = "the same long agent context " * 400  # ~2,800 tokens
        assert cached("t1", text) == 0
        assert cached("t2", text) == 0  # isolated: nothing of t1's cache
        assert cached("t1", text) > 2500  # positive control: t1's own resend hits
        text2 = "another shared context " * 400
        assert cached("g1", text2) == 0
        assert cached("g2", text2) > 2000  # same group: shared
        assert cached("t1", text2) == 0  # and the group's cache is not t1's
    finally:
        gw.stop()


def test_on_call_overrides_pool_weights_and_the_admin_surface(fleet, redis_server, tmp_path):
    sims, _ = fleet
    q = sglang_pool("q", sims.urls[1:2])
    q["pricing"] = {**q["pricing"], "usd_per_gpu_hour": 8.0}  # dearer: p serves unless on-call says otherwise
    cfg = cfg_for([sglang_pool("p", sims.urls[:1]), q],
                  [tenant("a", rate_limits={"requests_per_minute": 10_000}, budget={"usd_per_day": 100})],
                  redis_url=redis_server.url)
    a, b = start_gateway(cfg), start_gateway(cfg)
    served: list[str] = []

    def pool_of(gw: Any) -> str:
        served.append(chat(gw, "a").headers["x-gateway-pool"])
        return served[-1]

    try:
        assert pool_of(a) == "p"
        # pin the tenant to q for 1.5 s from instance A; B obeys, then the override lapses by itself
        r = admin(a, "PUT", "/admin/tenants/a/override", json={"ttl_s": 1.5, "pin_pool": "q", "ttft_sla_ms": 9000})
        assert r.status_code == 200
        wait_until(lambda: pool_of(b) == "q", timeout=1.0, what="the pin on B")
        wait_until(lambda: pool_of(b) == "p", timeout=5.0, what="the override lapsed by itself")
        # weight 0 through the CLI: the pool takes no new traffic
        env = {**env_without_proxies(), "GATEWAY_ADMIN_TOKEN": ADMIN}
        cli = [sys.executable, "-m", "gateway.cli", "admin", "--url", a.admin_url, "--actor", "bob"]
        out = subprocess.run(cli + ["pool", "p", "--weight", "0"], env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        wait_until(lambda: pool_of(b) == "q", timeout=1.0)
        st = admin(b, "GET", "/admin/state").json()
        assert st["pool_overrides"]["p"]["weight"] == 0 and all(not r["routable"] for r in st["pools"][0]["replicas"])
        assert all("predicted_ttft_s" in r for p in st["pools"] for r in p["replicas"])
        assert subprocess.run(cli + ["pool", "p", "--clear"], env=env, capture_output=True, timeout=30).returncode == 0
        bad = subprocess.run(cli + ["drain", "no-such-replica"], env=env, capture_output=True, text=True, timeout=30)
        assert bad.returncode == 1 and "404" in bad.stderr
        # bad input gets OpenAI-shaped errors with the right status
        r = admin(a, "PUT", "/admin/pools/p", json={"weight": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "weight"
        assert admin(a, "PUT", "/admin/pools/p", json={"pricing": PER_TOKEN}).status_code == 400  # self-hosted pool
        assert admin(a, "PUT", "/admin/tenants/zz/override", json={"ttl_s": 5}).status_code == 404
        assert admin(a, "PUT", "/admin/tenants/a/override", json={"ttl_s": 5, "pin_pool": "zz"}).status_code == 400
        assert httpx.get(a.admin_url + "/admin/state").status_code == 401
        # recent decisions with their explanation; usage from both instances in one ledger
        d = admin(b, "GET", "/admin/decisions?limit=3").json()["decisions"]
        assert len(d) == 3 and d[0]["decision"]["branch"] and d[0]["served_by"] in ("p-0", "q-0")
        # every chat above, through either instance, lands in the one shared ledger
        wait_until(lambda: admin(a, "GET", "/admin/usage").json()["tenants"]["a"]["day"]["requests"] == len(served))
        assert [e["what"] for e in admin(a, "GET", "/admin/audit?limit=3").json()["entries"]] == ["pool", "pool", "tenant_override"]
    finally:
        a.stop()
        b.stop()


def test_redis_outage_refuses_admin_writes_but_never_a_request(fleet):
    sims, _ = fleet
    srv = RedisServer()
    cfg = cfg_for([sglang_pool("p", sims.urls[:1])],
                  [tenant("a", rate_limits={"requests_per_minute": 10_000, "tokens_per_minute": 10_000_000},
                          budget={"usd_per_day": 100})], redis_url=srv.url)
    gw = start_gateway(cfg)
    try:
        assert chat(gw, "a").status_code == 200
        srv.kill()
        for _ in range(5):  # limits and budgets fall back to this instance; requests are served
            assert chat(gw, "a").parse().usage.completion_tokens == 2
        r = admin(gw, "POST", "/admin/replicas/p-0/drain")
        assert r.status_code == 503 and "not applied" in r.json()["error"]["message"]
        assert not gw.call(lambda: gw.app.state.gateway.registry.get("p-0").drained)
        srv.start()
        wait_until(lambda: admin(gw, "POST", "/admin/replicas/p-0/drain").status_code == 200, timeout=5)
        admin(gw, "POST", "/admin/replicas/p-0/undrain")
        assert chat(gw, "a").status_code == 200
    finally:
        gw.stop()
        srv.stop()


HUNG_DEADLINE_S = 30.0  # a call that waits this long waits on the hung Redis: no bound stopped it


def post_chat(gw: Any, stream: bool, **headers: str) -> httpx.Response:
    """A chat with a deadline that fails the test only when the request truly hangs."""
    body = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": stream}
    return httpx.post(gw.urls[0] + "/v1/chat/completions", json=body, timeout=HUNG_DEADLINE_S, trust_env=False,
                      headers={"authorization": "Bearer sk-a", **headers})


def test_a_hung_redis_never_hangs_a_request_the_probes_the_admin_state_or_the_shutdown(fleet, caplog):
    """Redis SIGSTOPped: its connections stay open and new ones are accepted, but nothing is answered (a hung
    server, unlike the refused connections of an outage). The shared client has no socket timeout; each call is
    bounded where it is made. With every Redis user in play (rate limits, a budget, a fleet-wide concurrency cap,
    flow control, the prefix index and load, idempotency keys, the control channel): requests, streamed or not, are
    served on this instance's state; a request with an Idempotency-Key is refused (503) rather than risk serving it
    twice; /healthz, the admin state and usage answer, an admin write is refused (503). After SIGCONT the changes go
    through again and the spend made meanwhile reaches Redis, each request once. With Redis hung again the
    graceful shutdown finishes, no step abandoned."""
    sims, _ = fleet
    srv = RedisServer()
    cfg = cfg_for([sglang_pool("p", sims.urls[:1])],
                  [tenant("a", rate_limits={"requests_per_minute": 10_000, "tokens_per_minute": 10_000_000},
                          budget={"usd_per_day": 100}, max_concurrent=50, max_concurrent_scope="fleet")],
                  redis_url=srv.url, flow={"enabled": True}, routing={"redis_hung_after_s": 1.0})
    gw = start_gateway(cfg)
    served = 0

    def serve_both() -> None:
        nonlocal served
        r = post_chat(gw, stream=False)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        s = post_chat(gw, stream=True)
        assert s.status_code == 200 and s.text.rstrip().endswith("data: [DONE]")
        served += 2

    def day() -> dict[str, Any]:
        return dict(admin(gw, "GET", "/admin/usage?tenant=a").json()["tenants"]["a"]["day"])

    try:
        serve_both()
        wait_until(lambda: day()["requests"] == 2, timeout=10, what="the first two requests settled in Redis")
        os.kill(srv.proc.pid, signal.SIGSTOP)  # our own redis-server, by its PID
        try:
            for _ in range(3):
                serve_both()
            r = post_chat(gw, stream=False, **{"idempotency-key": "k-1"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert httpx.get(gw.urls[0] + "/healthz", timeout=HUNG_DEADLINE_S, trust_env=False).status_code == 200
            state = httpx.get(gw.admin_url + "/admin/state", headers=ADMIN_H, timeout=HUNG_DEADLINE_S)
            assert state.status_code == 200 and state.json()["pools"][0]["replicas"][0]["name"] == "p-0"
            # this instance's own figures: the requests served during the hang (settled in the background)
            wait_until(lambda: (d := day())["shared"] is False and d["requests"] == served - 2, timeout=10,
                       what="usage answered from this instance's ledger")
            assert admin(gw, "POST", "/admin/replicas/p-0/drain").status_code == 503  # not applied anywhere
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)

        wait_until(lambda: admin(gw, "POST", "/admin/replicas/p-0/drain").status_code == 200, timeout=10,
                   what="admin writes through Redis again")
        assert admin(gw, "POST", "/admin/replicas/p-0/undrain").status_code == 200
        serve_both()
        wait_until(lambda: "shared" not in (d := day()) and d["pending_settlements"] == 0 and d["requests"] == served,
                   timeout=10, what="the settlements queued during the hang replayed, every request once")

        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            serve_both()  # its settlements queue: the shutdown's last replay meets the hung Redis
            caplog.set_level(logging.INFO, logger="gateway")
            gw.stop()
            gw.thread.join(HUNG_DEADLINE_S)
            assert not gw.thread.is_alive()
            abandoned = [r.fields for r in caplog.records
                         if getattr(r, "fields", {}).get("event") == "shutdown_step_timeout"]
            assert abandoned == []
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
    finally:
        gw.stop()
        srv.stop()


def test_admin_port_serves_the_admin_api_alone_and_flushes_a_replicas_prefix_entries(fleet):
    """`admin.port`: the same instance's admin API on a second port, and nothing else there; flush-prefix makes
    the router forget a replica's entries (the next request with that prefix is no longer a predicted hit)."""
    from gateway.app import create_admin_app
    from tests.support import ServerThread

    sims, _ = fleet
    app = create_app(parse_config(cfg_for([sglang_pool("p", sims.urls[:1])])))
    st = ServerThread([app, create_admin_app(app)]).start()
    main, adm = st.urls
    try:
        text = "a long shared context for the flush test " * 200
        c = OpenAI(base_url=main + "/v1", api_key="sk-a", max_retries=0)
        for _ in range(2):
            r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=[{"role": "user", "content": text}],
                                                            max_tokens=2)
        assert r.headers["x-gateway-route"] == "prefix_hit"
        state = httpx.get(adm + "/admin/state", headers=ADMIN_H).json()
        assert state["prefix_index_entries"] > 0 and state["pools"][0]["replicas"][0]["name"] == "p-0"
        assert httpx.post(adm + "/v1/chat/completions", headers={"authorization": "Bearer sk-a"}, json={}).status_code == 404
        r = httpx.post(adm + "/admin/replicas/p-0/flush-prefix", headers=ADMIN_H)
        assert r.status_code == 200
        assert httpx.get(adm + "/admin/state", headers=ADMIN_H).json()["prefix_index_entries"] == 0
        again = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=[{"role": "user", "content": text}],
                                                            max_tokens=2)
        assert again.headers["x-gateway-route"] == "cold_ring"
        assert httpx.get(adm + "/admin/audit", headers=ADMIN_H).json()["entries"][0]["what"] == "flush_prefix"
    finally:
        st.stop()
