"""Live tenant changes through the admin API, on two gateway instances sharing one real Redis (and on one instance
with in-memory state): a change made on one is enforced on the other; every change is audited with its actor and
the values before and after; undo restores them; bad changes are refused naming the field with nothing applied;
concurrent changes are compare-and-set (one wins, both audited, no lost update); a policy file reload is audited."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import wait_until

ADM = {"authorization": "Bearer adm", "x-admin-actor": "alice"}


@pytest.fixture(scope="module")
def pair(sims, redis_server):
    """Two instances, one Redis, one fleet."""
    sim_st, _ = sims
    urls = [f"http://127.0.0.1:{p}" for p in sim_st.ports]
    cfg = config([sglang_pool("p", urls), sglang_pool("q", urls[:1])], admin={"token_hashes": [hash_key("adm")]},
                 routing={"redis_url": redis_server.url, "redis_prefix": f"lc{time.monotonic_ns()}:",
                          # the changes' Redis calls judged by what they write, not by how fast a busy machine runs
                          "control_redis_timeout_s": 30},
                 tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"],
                           "rate_limits": {"requests_per_minute": 60}}])
    gws = [start_gateway(cfg), start_gateway(cfg)]
    CLIENT_OF.update({g.admin_url: g.urls[0] for g in gws})
    yield [g.admin_url for g in gws]  # each instance's admin listener
    for g in gws:
        g.stop()


CLIENT_OF: dict[str, str] = {}  # an instance's admin listener -> its client listener


def limit_seen(base: str) -> str | None:
    """The requests/min limit this instance (`base`: its admin listener) enforces for tenant-a, as its response
    headers state it."""
    r = httpx.post(f"{CLIENT_OF[base]}/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                   json={"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    return r.headers.get("x-ratelimit-limit-requests")


def audit(base: str, limit: int = 20) -> list[dict]:
    return httpx.get(f"{base}/admin/history", params={"limit": limit}, headers=ADM).json()["entries"]


def test_a_change_on_one_instance_is_enforced_on_the_other_and_undone(pair):
    """The on-call loop: raise a limit on A, B enforces it; undo on A, B is back — each step audited with before
    and after, so the log alone tells what was in force when."""
    a, b = pair
    assert limit_seen(b) == "60"
    r = httpx.patch(f"{a}/admin/tenants/tenant-a/policy", headers=ADM,
                    json={"rate_limits": {"requests_per_minute": 600}})
    assert r.status_code == 200, r.text
    changed = r.json()
    assert changed["before"] == {"rate_limits": {"requests_per_minute": 60, "tokens_per_minute": None}}
    assert changed["after"] == {"rate_limits": {"requests_per_minute": 600, "tokens_per_minute": None}}
    wait_until(lambda: limit_seen(b) == "600", timeout=10, what="B enforcing the raised limit")
    entry = next(e for e in audit(b) if e["id"] == changed["audit_id"])
    assert entry["who"].endswith("(alice)") and entry["what"] == "tenant_policy" and entry["undoable"]

    u = httpx.post(f"{a}/admin/undo", headers=ADM, json={"id": changed["audit_id"]})
    assert u.status_code == 200, u.text
    assert u.json()["after"] == {"rate_limits": {"requests_per_minute": 60, "tokens_per_minute": None}}
    wait_until(lambda: limit_seen(b) == "60", timeout=10, what="B back on the file's limit")
    log = {e["id"]: e for e in audit(b)}
    assert log[changed["audit_id"]]["undone_by"] == u.json()["audit_id"]
    assert log[u.json()["audit_id"]]["undo_of"] == changed["audit_id"]
    again = httpx.post(f"{a}/admin/undo", headers=ADM, json={"id": changed["audit_id"]})
    assert again.status_code == 409 and "already undone" in again.json()["error"]["message"]


@pytest.mark.parametrize("body, status, param", [
    ({"rate_limits": {"requests_per_minute": 0}}, 400, "rate_limits.requests_per_minute"),
    ({"budget": {"usd_per_day": -5}}, 400, "budget.usd_per_day"),
    ({"priority": "urgent"}, 400, "priority"),
    ({"pools": ["nope"]}, 400, "pools[0]"),
    ({"model_aliases": [{"match": "gpt-*", "model": "not-served"}]}, 400, "model_aliases[0].model"),
    ({"api_key_hashes": ["0" * 64]}, 400, "api_key_hashes"),  # identity stays with the reviewed files
    ({"colour": "blue"}, 400, "colour"),
])
def test_a_bad_change_names_the_field_and_applies_nothing(pair, body, status, param):
    a, b = pair
    before = httpx.get(f"{a}/admin/tenants/tenant-a/policy", headers=ADM).json()
    n = len(audit(a, 1000))
    r = httpx.patch(f"{a}/admin/tenants/tenant-a/policy", headers=ADM, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert "nothing was applied" in r.json()["error"]["message"] or param in ("api_key_hashes", "colour")
    assert httpx.get(f"{b}/admin/tenants/tenant-a/policy", headers=ADM).json()["version"] == before["version"]
    assert len(audit(a, 1000)) == n


def test_unknown_tenant_is_404_naming_it(pair):
    r = httpx.patch(f"{pair[0]}/admin/tenants/nobody/policy", headers=ADM, json={"priority": "high"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "name"


def test_concurrent_changes_from_two_instances_one_wins_both_audited(pair):
    """Two on-call engineers change the same tenant from two instances, both from the version they read: exactly
    one change is written, the other gets 409 and is audited as refused — never a silent last-writer-wins."""
    a, b = pair
    version = httpx.get(f"{a}/admin/tenants/tenant-a/policy", headers=ADM).json()["version"]
    results: dict[str, httpx.Response] = {}
    go = threading.Barrier(2)

    def change(base: str, rpm: int) -> None:
        go.wait()
        results[base] = httpx.patch(f"{base}/admin/tenants/tenant-a/policy", params={"if_version": version},
                                    headers=ADM, json={"rate_limits": {"requests_per_minute": rpm}})

    threads = [threading.Thread(target=change, args=(a, 100)), threading.Thread(target=change, args=(b, 200))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results.values())
    assert codes == [200, 409], [r.text for r in results.values()]
    winner = next(base for base, r in results.items() if r.status_code == 200)
    want = 100 if winner == a else 200
    wait_until(lambda: all(httpx.get(f"{x}/admin/tenants/tenant-a/policy", headers=ADM).json()["effective"]
                           ["rate_limits"]["requests_per_minute"] == want for x in pair), timeout=10,
               what="both instances on the winner's value")
    whats = [e["what"] for e in audit(a, 5)]
    assert "tenant_policy" in whats and "tenant_policy_refused" in whats

    # without a version: both changes land, merged field by field (no lost update)
    v2 = httpx.get(f"{a}/admin/tenants/tenant-a/policy", headers=ADM).json()["version"]
    go2 = threading.Barrier(2)

    def free(base: str, body: dict) -> None:
        go2.wait()
        results[base] = httpx.patch(f"{base}/admin/tenants/tenant-a/policy", headers=ADM, json=body)

    threads = [threading.Thread(target=free, args=(a, {"rate_limits": {"tokens_per_minute": 5000}})),
               threading.Thread(target=free, args=(b, {"priority": "high"}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in results.values())
    got = httpx.get(f"{b}/admin/tenants/tenant-a/policy", headers=ADM).json()
    assert got["version"] == v2 + 2
    assert got["live"]["rate_limits"]["tokens_per_minute"] == 5000 and got["live"]["priority"] == "high"
    httpx.delete(f"{a}/admin/tenants/tenant-a/policy", headers=ADM).raise_for_status()


def test_concurrent_pool_changes_chain_their_before_and_after(pair):
    """Two instances set one pool's weight at once: both land, one after the other, and the later one's before is
    the earlier one's after — so the history reads as a chain and undoing the later puts back the earlier's value,
    never the value both started from."""
    a, b = pair
    go = threading.Barrier(2)
    answers: list[httpx.Response] = []

    def put(base: str, w: float) -> None:
        go.wait()
        answers.append(httpx.put(f"{base}/admin/pools/q", headers=ADM, json={"weight": w}))

    threads = [threading.Thread(target=put, args=(a, 0.25)), threading.Thread(target=put, args=(b, 0.75))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in answers] == [200, 200]
    ids = sorted(r.json()["audit_id"] for r in answers)
    log = {e["id"]: e for e in audit(a)}
    first, second = log[ids[0]], log[ids[1]]
    assert first["before"] == {"override": None}
    assert second["before"] == first["after"]  # no stale before: the compare-and-set saw the first write
    assert httpx.post(f"{a}/admin/undo", headers=ADM, json={"id": first["id"]}).status_code == 409  # replaced since
    assert httpx.post(f"{b}/admin/undo", headers=ADM, json={"id": second["id"]}).status_code == 200
    state = httpx.get(f"{a}/admin/state", headers=ADM).json()
    assert state["pool_overrides"]["q"] == first["after"]["override"]
    assert httpx.post(f"{a}/admin/undo", headers=ADM, json={"id": first["id"]}).status_code == 200
    assert "q" not in httpx.get(f"{a}/admin/state", headers=ADM).json()["pool_overrides"]


def test_undo_refuses_when_a_later_change_replaced_the_value(pair):
    a, _ = pair
    first = httpx.patch(f"{a}/admin/tenants/tenant-a/policy", headers=ADM, json={"max_concurrent": 5}).json()
    httpx.patch(f"{a}/admin/tenants/tenant-a/policy", headers=ADM, json={"max_concurrent": 7}).raise_for_status()
    r = httpx.post(f"{a}/admin/undo", headers=ADM, json={"id": first["audit_id"]})
    assert r.status_code == 409 and r.json()["error"]["param"] == "id"
    # the newest change undoes by default, then the first one can be undone
    assert httpx.post(f"{a}/admin/undo", headers=ADM).status_code == 200
    assert httpx.post(f"{a}/admin/undo", headers=ADM, json={"id": first["audit_id"]}).status_code == 200
    assert httpx.get(f"{a}/admin/tenants/tenant-a/policy", headers=ADM).json()["effective"]["max_concurrent"] is None


def test_drain_is_audited_with_before_after_and_undone(pair):
    a, b = pair
    r = httpx.post(f"{a}/admin/replicas/p-0/drain", headers=ADM)
    entry = next(e for e in audit(a) if e["id"] == r.json()["audit_id"])
    assert entry["before"] == {"drained": False} and entry["after"] == {"drained": True}
    wait_until(lambda: any(x["drained"] for x in httpx.get(f"{b}/admin/replicas", headers=ADM).json()["replicas"]),
               timeout=10, what="the drain on B")
    assert httpx.post(f"{a}/admin/undo", headers=ADM, json={"id": entry["id"]}).status_code == 200
    wait_until(lambda: not any(x["drained"] for x in httpx.get(f"{b}/admin/replicas", headers=ADM).json()["replicas"]),
               timeout=10, what="the undrain on B")


def test_preview_of_a_weight_change_is_computed_from_recent_decisions(pair):
    """Weight 0 on pool q moves every recent decision that chose q (and nothing else); nothing is changed."""
    a, _ = pair
    for i in range(6):
        httpx.post(f"{CLIENT_OF[a]}/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                   json={"model": "glm-5.2", "messages": [{"role": "user", "content": f"preview {i} " * 50}],
                         "max_tokens": 1}).raise_for_status()
    decisions = httpx.get(f"{a}/admin/decisions", params={"limit": 500}, headers=ADM).json()["decisions"]
    on_q = sum(1 for d in decisions if d["decision"] and d["decision"]["pool"] == "q")
    p = httpx.post(f"{a}/admin/preview", headers=ADM, json={"pool": "q", "weight": 0}).json()
    assert p["decisions"] >= 6 and p["would_move"] == on_q
    assert all(m["from"] == "q" and m["to"] == "p" for m in p["moves_by_pool"])
    pin = httpx.post(f"{a}/admin/preview", headers=ADM, json={"tenant": "tenant-a", "pin_pool": "q"}).json()
    assert pin["would_move"] == p["decisions"] - on_q
    bad = httpx.post(f"{a}/admin/preview", headers=ADM, json={"pool": "zz", "weight": 1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "pool"


def test_policy_file_reload_is_audited_with_before_and_after(sims, tmp_path: Path):
    """A policy file edit picked up by the watcher (no admin call) lands in the audit log with the fields that
    changed; and live changes work on in-memory state too (no Redis)."""
    sim_st, _ = sims
    pol = tmp_path / "policies"
    (pol / "tenants").mkdir(parents=True)
    tenant = {"api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"], "rate_limits": {"requests_per_minute": 60}}
    (pol / "tenants" / "tenant-a.yaml").write_text(yaml.safe_dump(tenant))
    cfg = config([sglang_pool("p", [f"http://127.0.0.1:{sim_st.ports[0]}"])], admin={"token_hashes": [hash_key("adm")]},
                 policies={"dir": str(pol), "watch_interval_s": 0.1})
    cfg.pop("tenants")
    gw = start_gateway(cfg)
    base = gw.admin_url
    CLIENT_OF[base] = gw.urls[0]
    try:
        tenant["rate_limits"]["requests_per_minute"] = 90
        (pol / "tenants" / "tenant-a.yaml").write_text(yaml.safe_dump(tenant))
        wait_until(lambda: any(e["what"] == "policy_reload" for e in audit(base)), timeout=10, what="the reload audited")
        e = next(e for e in audit(base) if e["what"] == "policy_reload")
        assert e["who"] == "policy-file" and not e["undoable"]
        assert e["before"] == {"tenant-a": {"rate_limits": {"requests_per_minute": 60, "tokens_per_minute": None}}}
        assert e["after"] == {"tenant-a": {"rate_limits": {"requests_per_minute": 90, "tokens_per_minute": None}}}
        r = httpx.patch(f"{base}/admin/tenants/tenant-a/policy", headers=ADM, json={"rate_limits": {"requests_per_minute": 120}})
        assert r.status_code == 200 and limit_seen(base) == "120"
        assert httpx.post(f"{base}/admin/undo", headers=ADM).status_code == 200 and limit_seen(base) == "90"
        assert httpx.post(f"{base}/admin/undo", headers=ADM, json={"id": e["id"]}).status_code == 409
    finally:
        gw.stop()


def test_an_admin_reload_is_audited_under_the_admin(sims, tmp_path: Path):
    """`gateway admin reload` (no watcher in time to see the edit first): the entry names the admin who asked."""
    sim_st, _ = sims
    pol = tmp_path / "policies"
    (pol / "tenants").mkdir(parents=True)
    tenant = {"api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"], "priority": "low"}
    (pol / "tenants" / "tenant-a.yaml").write_text(yaml.safe_dump(tenant))
    cfg = config([sglang_pool("p", [f"http://127.0.0.1:{sim_st.ports[0]}"])], admin={"token_hashes": [hash_key("adm")]},
                 policies={"dir": str(pol), "watch_interval_s": 3600})
    cfg.pop("tenants")
    gw = start_gateway(cfg)
    base = getattr(gw, "admin_url", None) or f"http://127.0.0.1:{gw.ports[0]}"  # the admin API's listener
    try:
        (pol / "tenants" / "tenant-a.yaml").write_text(yaml.safe_dump({**tenant, "priority": "high"}))
        assert httpx.post(f"{base}/admin/policies/reload", headers=ADM).status_code == 200
        wait_until(lambda: any(e["what"] == "policy_reload" for e in audit(base)), timeout=10, what="the reload audited")
        e = next(e for e in audit(base) if e["what"] == "policy_reload")
        assert e["who"].endswith("(alice)") and e["after"] == {"tenant-a": {"priority": "high"}}
    finally:
        gw.stop()


def test_a_live_change_outlives_the_instance_that_made_it(sims, redis_server):
    """Stored in Redis, not in the process: an instance started after the change (a restart, a scale-up) serves with
    it from its first request, and its history shows the change."""
    sim_st, _ = sims
    cfg = config([sglang_pool("p", [f"http://127.0.0.1:{sim_st.ports[0]}"])], admin={"token_hashes": [hash_key("adm")]},
                 routing={"redis_url": redis_server.url, "redis_prefix": f"lcp{time.monotonic_ns()}:"},
                 tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"],
                           "rate_limits": {"requests_per_minute": 60}}])

    def urls(gw) -> tuple[str, str]:  # (admin API, client API)
        client = f"http://127.0.0.1:{gw.ports[0]}"
        return getattr(gw, "admin_url", None) or client, client

    first = start_gateway(cfg)
    try:
        adm, _ = urls(first)
        r = httpx.patch(f"{adm}/admin/tenants/tenant-a/policy", headers=ADM, json={"rate_limits": {"requests_per_minute": 700}})
        assert r.status_code == 200
    finally:
        first.stop()
    later = start_gateway(cfg)
    try:
        adm, client = urls(later)
        r = httpx.post(f"{client}/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"},
                       json={"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.headers["x-ratelimit-limit-requests"] == "700"
        assert any(e["what"] == "tenant_policy" for e in audit(adm))
    finally:
        later.stop()
