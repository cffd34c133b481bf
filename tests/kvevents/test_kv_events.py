"""Precise routing from the simulator's KV events, over real ZMQ and HTTP on loopback (docs/kv-events.md).

Convergence = every subscription healthy and holding as many blocks as the engine rank has cache pages (read from
the simulator's /_sim/state). The faults (dropped batches, a killed subscription, a restart, a flush) must leave
the gateway's view equal to the engine's within one second of the engine settling, and no request may fail."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import hash_key
from gateway.prefix.memory import MemoryPrefixIndex
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, free_port_base, start_sims, wait_until

H = {"Authorization": f"Bearer {KEY_A}"}
CONVERGE_S = 20.0  # a bound on a condition, not a speed: a busy machine (CI beside other work) delivers events late


def kv_config(base: int, replay: bool = True) -> str:
    # loopback only (SGLang's default, tcp://*:5557, binds every interface)
    cfg: dict[str, Any] = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{base}"}
    if replay:
        cfg["replay_endpoint"] = f"tcp://127.0.0.1:{base + 50}"
    return json.dumps(cfg)


class Fleet:
    def __init__(self, n: int = 2, version: str = "0.5.23", replay: bool = True, mode: str = "precise",
                 routing: dict[str, Any] | None = None, admin: dict[str, Any] | None = None, **sim: Any) -> None:
        self.version = version
        self.sims: list[ServerThread] = []
        self.bases = []
        for _ in range(n):
            base = free_port_base()
            self.bases.append(base)
            st, _ = start_sims(1, sglang_version=version, kv_events_config=kv_config(base, replay), **sim)
            self.sims.append(st)
        self.urls = [s.urls[0] for s in self.sims]
        r = {"mode": mode, "kv_events": {"discovery_interval_s": 0.3}, **(routing or {})}
        self.gw = start_gateway(config([sglang_pool("p", self.urls)], routing=r, **({"admin": admin} if admin else {})))
        self.url = self.gw.urls[0]

    @property
    def manager(self) -> Any:
        return self.gw.app.app.app.state.gateway.kv_events  # type: ignore[attr-defined]

    def chat(self, text: str, **kw: Any) -> httpx.Response:
        r = httpx.post(f"{self.url}/v1/chat/completions", headers=H, timeout=30,
                       json={"model": "glm-5.2", "messages": [{"role": "user", "content": text}], "max_tokens": 2, **kw})
        assert r.status_code == 200, r.text
        return r

    def kv_health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/readyz").json()["kv_events"]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the /metrics samples named `name` (counters end in _total) whose labels include `labels`."""
        return sum(s.value for fam in text_string_to_metric_families(httpx.get(f"{self.gw.admin_url}/metrics").text)
                   for s in fam.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def engine_pages(self) -> dict[str, int]:
        out = {}
        for i, u in enumerate(self.urls):
            for rk in httpx.get(f"{u}/_sim/state").json()["ranks"]:
                out[f"p-{i}/rank{rk['dp_rank']}"] = rk["cache_pages"]
        return out

    def converged(self) -> bool:
        subs = self.kv_health()["subscriptions"]
        pages = self.engine_pages()
        return set(subs) == set(pages) and all(s["healthy"] and s["blocks"] == pages[k] for k, s in subs.items())

    def wait_converged(self, timeout: float = CONVERGE_S) -> None:
        wait_until(self.converged, timeout, "the gateway's blocks to equal the engines' cache pages")

    def stop(self) -> None:
        self.gw.stop()
        for s in self.sims:
            s.stop()


@pytest.fixture
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    f = Fleet(**getattr(request, "param", {}))
    wait_until(lambda: f.kv_health()["healthy"] == f.kv_health()["total"] >= len(f.urls), 5, "subscriptions")
    yield f
    f.stop()


def direct(url: str, text: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert r.status_code == 200


def prompt(i: int, n: int = 3000) -> str:
    return f"conversation {i}: " + "lorem ipsum dolor sit amet " * (n // 7)


@pytest.mark.parametrize("fleet", [{"mode": "precise", "admin": {"token_hashes": [hash_key("admin-secret")]}},
                                   {"mode": "hybrid", "admin": {"token_hashes": [hash_key("admin-secret")]}}],
                         indirect=True, ids=["precise", "hybrid"])
def test_explain_predicts_with_the_keys_live_traffic_uses(fleet: Fleet) -> None:
    """The admin explain's dry run hashes the request with the live hasher: in precise/hybrid mode, the engines'
    token-page keys. With the text-chunk hashes it would look up keys no engine event ever stored and predict a cold
    placement where live traffic finds the prefix (the explain would then explain a different decision)."""
    text = prompt(7)
    first = fleet.chat(text)
    fleet.wait_converged()
    events = fleet.metric("gateway_kv_events_index_answers_total", source="events")
    body = {"tenant": "tenant-a", "request": {"model": "glm-5.2", "messages": [{"role": "user", "content": text}],
                                              "max_tokens": 2}}
    r = httpx.post(f"{fleet.gw.admin_url}/admin/explain", json=body, headers={"authorization": "Bearer admin-secret"}, timeout=30)
    assert r.status_code == 200, r.text
    d = r.json()["decision"]
    assert d["branch"] == "prefix_hit" and d["chosen"] == first.headers["x-gateway-replica"], d
    # answered from the engines' events: the keys are the ones the engines published
    assert fleet.metric("gateway_kv_events_index_answers_total", source="events") > events
    live = fleet.chat(text)  # and live traffic takes the decision the explain showed
    assert live.headers["x-gateway-route"] == d["branch"] and live.headers["x-gateway-replica"] == d["chosen"]
    cached = live.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    chosen = next(c for c in d["candidates"] if c["replica"] == d["chosen"])
    assert chosen["cached_tokens"] >= cached - 64  # predicted what the engine then reported, within a page


@pytest.mark.parametrize("fleet", [{"version": "0.5.13"}, {"version": "0.5.23"}], indirect=True,
                         ids=["arrays-0.5.13", "maps-0.5.23"])
def test_precise_routing_follows_the_engines_events(fleet: Fleet) -> None:
    assert fleet.metric("gateway_kv_events_batches_total") == 0  # nothing published before the first request
    first = fleet.chat(prompt(1))
    fleet.wait_converged()
    health = fleet.kv_health()["subscriptions"]
    assert {s["encoding"] for s in health.values() if s["batches"]} == {"maps" if fleet.version == "0.5.23" else "arrays"}
    # /metrics tells an operator the same as /readyz: every subscription healthy, the blocks each rank holds
    for name, pages in fleet.engine_pages().items():
        server, rank = name.split("/rank")
        assert fleet.metric("gateway_kv_events_healthy", server=server, rank=rank) == 1
        assert fleet.metric("gateway_kv_events_blocks", server=server, rank=rank) == pages
    batches = fleet.metric("gateway_kv_events_batches_total")
    assert batches >= 1 and fleet.metric("gateway_kv_events_gaps_total") == 0
    events = fleet.metric("gateway_kv_events_index_answers_total", source="events")
    second = fleet.chat(prompt(1))
    assert second.headers["x-gateway-replica"] == first.headers["x-gateway-replica"]
    assert second.headers["x-gateway-route"] == "prefix_hit"
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # answered from the events for each replica, none from the fallback
    assert fleet.metric("gateway_kv_events_index_answers_total", source="events") >= events + len(fleet.urls)
    assert fleet.metric("gateway_kv_events_index_answers_total", source="fallback") == 0
    fleet.chat(prompt(2))  # new pages stored: another batch arrives and is counted
    wait_until(lambda: fleet.metric("gateway_kv_events_batches_total") > batches, CONVERGE_S, "the batch counted")


@pytest.mark.parametrize("fleet", [{"version": "0.5.13"}, {"version": "0.5.23"}], indirect=True,
                         ids=["arrays-0.5.13", "maps-0.5.23"])
def test_a_salted_tenant_matches_the_events_alone(fleet: Fleet) -> None:
    """The tenant's cache_salt is on 0.5.23's events and absent before: either way the events alone (this
    instance's own speculative entries cleared) must place the repeat on the replica that holds it."""
    first = fleet.chat(prompt(2))
    fleet.wait_converged()
    fleet.manager.index.spec = MemoryPrefixIndex()
    second = fleet.chat(prompt(2))
    assert second.headers["x-gateway-route"] == "prefix_hit"
    assert second.headers["x-gateway-replica"] == first.headers["x-gateway-replica"]


def test_encoding_seen_per_version() -> None:
    for version, enc in (("0.5.13", "arrays"), ("0.5.23", "maps")):
        f = Fleet(1, version=version)
        try:
            wait_until(lambda f=f: f.kv_health()["healthy"] == 1, 5, "subscription")
            f.chat(prompt(0))
            f.wait_converged()
            assert next(iter(f.kv_health()["subscriptions"].values()))["encoding"] == enc
        finally:
            f.stop()


def test_dropped_batches_are_replayed(fleet: Fleet) -> None:
    fleet.chat(prompt(1))
    fleet.wait_converged()
    for u in fleet.urls:
        assert httpx.post(f"{u}/_sim/kv_events", json={"drop_batches": 2}).status_code == 200
        # straight to each engine: 3 batches each, the first 2 never sent (SGLang has no heartbeat, so a lost batch
        # shows only when a later one arrives)
        for i in range(3):
            direct(u, prompt(10 + i))
    fleet.wait_converged()
    fleet.chat(prompt(11))
    subs = fleet.kv_health()["subscriptions"].values()
    assert sum(s["gaps"] for s in subs) >= 1 and sum(s["replayed"] for s in subs) >= 2
    assert all(s["replay_failures"] == 0 for s in subs)
    assert fleet.metric("gateway_kv_events_gaps_total") >= 1
    assert fleet.metric("gateway_kv_events_replayed_batches_total") >= 2
    assert fleet.metric("gateway_kv_events_replay_failures_total") == 0


@pytest.mark.parametrize("fleet", [{"replay": False}], indirect=True)
def test_unreplayable_gap_drops_the_rank_view_and_requests_still_succeed(fleet: Fleet) -> None:
    fleet.chat(prompt(1))
    fleet.wait_converged()
    for u in fleet.urls:
        httpx.post(f"{u}/_sim/kv_events", json={"drop_batches": 1})
        for i in range(2):
            direct(u, prompt(10 + i))
    wait_until(lambda: sum(s["replay_failures"] for s in fleet.kv_health()["subscriptions"].values()) >= 1, 2,
               "a replay failure")
    # the view restarted from the next batch: never more blocks than the engine holds (no phantom entries)
    subs, pages = fleet.kv_health()["subscriptions"], fleet.engine_pages()
    assert all(s["blocks"] <= pages[k] for k, s in subs.items())
    fleet.chat(prompt(1))


@pytest.mark.parametrize("fleet", [{"routing": {"kv_events": {"discovery_interval_s": 60}}}], indirect=True)
def test_killed_subscription_falls_back_then_resubscribes_and_converges(fleet: Fleet) -> None:
    for i in range(4):
        fleet.chat(prompt(i))
    fleet.wait_converged()
    st = next(iter(fleet.manager.ranks.values()))
    lv = {"server": st.server, "rank": str(st.rank)}
    assert fleet.metric("gateway_kv_events_healthy", **lv) == 1
    assert fleet.metric("gateway_kv_events_healthy") == len(fleet.urls)
    before = dict(fleet.manager.index.answers)
    fallback = fleet.metric("gateway_kv_events_index_answers_total", source="fallback")
    fleet.gw.call(lambda: st.sub._task.cancel())
    wait_until(lambda: fleet.kv_health()["healthy"] == len(fleet.urls) - 1, 1, "the subscription down")
    assert fleet.metric("gateway_kv_events_healthy", **lv) == 0  # the dead one, and only it, reads 0
    assert fleet.metric("gateway_kv_events_healthy") == len(fleet.urls) - 1
    # while it is down, that replica is routed on the approximate index and requests succeed
    for i in range(4, 8):
        fleet.chat(prompt(i))
    assert fleet.manager.index.answers["fallback"] > before["fallback"]
    assert fleet.metric("gateway_kv_events_index_answers_total", source="fallback") >= fallback + 4  # one per request
    asyncio.run_coroutine_threadsafe(fleet.manager.discover(), fleet.gw.loop).result(5)  # the next discovery round
    wait_until(lambda: fleet.kv_health()["healthy"] == len(fleet.urls), 1, "resubscribed")
    assert fleet.metric("gateway_kv_events_healthy", **lv) == 1
    fleet.chat(prompt(8))  # the new subscription's first batch: it replays the buffer from 0, then converges
    fleet.wait_converged()


def test_restart_drops_the_view_and_converges(fleet: Fleet) -> None:
    for i in range(3):
        fleet.chat(prompt(i))
    fleet.wait_converged()
    for u in fleet.urls:
        assert httpx.post(f"{u}/_sim/fault", json={"kind": "restart"}).status_code == 200
    wait_until(lambda: all(httpx.get(f"{u}/_sim/state").json()["status"] == "ready" for u in fleet.urls), 5, "restart")
    fleet.wait_converged()  # the engines' caches are empty, so must the view be
    assert all(v == 0 for v in fleet.engine_pages().values())
    fleet.chat(prompt(7))
    fleet.wait_converged()
    subs = fleet.kv_health()["subscriptions"].values()
    assert all(s["disconnects"] + s["resets"] >= 1 for s in subs)


def test_flush_cache_all_blocks_cleared(fleet: Fleet) -> None:
    for i in range(3):
        fleet.chat(prompt(i))
    fleet.wait_converged()
    assert sum(s["blocks"] for s in fleet.kv_health()["subscriptions"].values()) > 0
    for u in fleet.urls:
        assert httpx.post(f"{u}/flush_cache").status_code == 200
    fleet.wait_converged()
    assert all(s["blocks"] == 0 for s in fleet.kv_health()["subscriptions"].values())


def test_requests_in_flight_through_every_fault_all_succeed(fleet: Fleet) -> None:
    """Streams keep arriving while a subscription is killed, batches are dropped and the caches are flushed
    (AllBlocksCleared), then a replica restarts: none fails, and the view converges after each fault."""
    import threading

    stop, done, errors = threading.Event(), [0], []

    def client(k: int) -> None:
        n = 0
        while not stop.is_set():
            try:
                r = httpx.post(f"{fleet.url}/v1/chat/completions", headers=H, timeout=30,
                               json={"model": "glm-5.2", "max_tokens": 8, "stream": True,
                                     "messages": [{"role": "user", "content": prompt(100 * k + n % 5)}]})
                if r.status_code != 200 or "[DONE]" not in r.text:
                    errors.append((r.status_code, r.text[:200]))
                done[0] += 1
            except httpx.HTTPError as e:
                errors.append(repr(e))
            n += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()

    def traffic_through(fault: Any) -> None:
        at = done[0]
        fault()
        wait_until(lambda: done[0] >= at + 6, 10, "requests completing through the fault")

    try:
        wait_until(lambda: done[0] >= 3, 10, "traffic flowing")
        st = next(iter(fleet.manager.ranks.values()))
        traffic_through(lambda: fleet.gw.call(lambda: st.sub._task.cancel()))
        asyncio.run_coroutine_threadsafe(fleet.manager.discover(), fleet.gw.loop).result(5)
        traffic_through(lambda: [httpx.post(f"{u}/_sim/kv_events", json={"drop_batches": 2}) for u in fleet.urls])
        traffic_through(lambda: [httpx.post(f"{u}/flush_cache") for u in fleet.urls])
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert errors == []
    # SGLang sends no heartbeat: a dropped last batch shows only when a later one arrives, so each engine gets a
    # few more requests (past any drop still pending) before the view must equal its cache
    for u in fleet.urls:
        for i in range(3):
            direct(u, prompt(900 + i))
    fleet.wait_converged()


@pytest.mark.parametrize("fleet", [{"n": 1, "max_total_num_tokens": 8000}], indirect=True)
def test_evictions_reach_the_view(fleet: Fleet) -> None:
    for i in range(8):  # ~24k tokens of distinct prompts through an 8k-token cache
        fleet.chat(prompt(i))
    fleet.wait_converged()
    state = httpx.get(f"{fleet.urls[0]}/_sim/state").json()["ranks"][0]
    assert state["evicted_pages"] > 0


def test_late_joiner_replays_what_the_engine_already_holds() -> None:
    base = free_port_base()
    st, _ = start_sims(1, kv_events_config=kv_config(base))
    try:
        httpx.post(f"{st.urls[0]}/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": [{"role": "user", "content": prompt(1)}], "max_tokens": 2})
        httpx.post(f"{st.urls[0]}/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": [{"role": "user", "content": prompt(2)}], "max_tokens": 2})
        pages = httpx.get(f"{st.urls[0]}/_sim/state").json()["ranks"][0]["cache_pages"]
        gw = start_gateway(config([sglang_pool("p", st.urls)], routing={"mode": "precise",
                                                                         "kv_events": {"discovery_interval_s": 0.3}}))
        try:
            def blocks() -> int:
                subs = httpx.get(f"{gw.urls[0]}/readyz").json()["kv_events"]["subscriptions"]
                return sum(s["blocks"] for s in subs.values())
            # nothing is published until the next batch: one more request makes the consumer catch up
            wait_until(lambda: httpx.get(f"{gw.urls[0]}/readyz").json()["kv_events"]["healthy"] == 1, 5, "subscribed")
            r = httpx.post(f"{gw.urls[0]}/v1/chat/completions", headers=H, timeout=30,
                           json={"model": "glm-5.2", "messages": [{"role": "user", "content": prompt(1)}], "max_tokens": 2})
            assert r.status_code == 200
            wait_until(lambda: blocks() == httpx.get(f"{st.urls[0]}/_sim/state").json()["ranks"][0]["cache_pages"],
                       CONVERGE_S, "the late joiner's view")
            assert blocks() >= pages
        finally:
            gw.stop()
    finally:
        st.stop()


@pytest.mark.parametrize("fleet", [{"n": 1, "dp_size": 2}], indirect=True)
def test_dp_ranks_each_publish_on_their_port(fleet: Fleet) -> None:
    wait_until(lambda: fleet.kv_health()["total"] == 2, 3, "two rank subscriptions")
    for i in range(6):
        fleet.chat(prompt(i))
    fleet.wait_converged()
    subs = fleet.kv_health()["subscriptions"]
    assert all(s["blocks"] > 0 for s in subs.values())


def test_port_collision_only_rank_0_publishes_and_rank_1_falls_back() -> None:
    f = Fleet(1, version="0.5.13", dp_size=2, kv_events_port_collision=True)
    try:
        wait_until(lambda: f.kv_health()["total"] == 2, 3, "two rank subscriptions")
        state = httpx.get(f"{f.urls[0]}/_sim/kv_events").json()["ranks"]
        assert state[0]["error"] is None and "bind" in state[1]["error"]
        for i in range(4):
            f.chat(prompt(i))  # no request fails; the server is routed approximately (rank 1 has no publisher)
        subs = f.kv_health()["subscriptions"]
        assert subs["p-0/rank0"]["healthy"] and not subs["p-0/rank1"]["healthy"]
        assert f.manager.index.answers["fallback"] >= 4
    finally:
        f.stop()


def test_static_endpoints_for_0_5_9() -> None:
    base = free_port_base()
    st, _ = start_sims(1, sglang_version="0.5.9", kv_events_config=kv_config(base))
    try:
        assert "kv_events" not in httpx.get(f"{st.urls[0]}/server_info").json()
        static = {"p-0": {"endpoint": f"tcp://127.0.0.1:{base}", "replay_endpoint": f"tcp://127.0.0.1:{base + 50}"}}
        gw = start_gateway(config([sglang_pool("p", st.urls)], routing={
            "mode": "precise", "kv_events": {"discovery_interval_s": 0.3, "static": static}}))
        try:
            wait_until(lambda: httpx.get(f"{gw.urls[0]}/readyz").json()["kv_events"]["healthy"] == 1, 5, "subscribed")
            r = httpx.post(f"{gw.urls[0]}/v1/chat/completions", headers=H, timeout=30,
                           json={"model": "glm-5.2", "messages": [{"role": "user", "content": prompt(1)}], "max_tokens": 2})
            assert r.status_code == 200
            wait_until(lambda: next(iter(httpx.get(f"{gw.urls[0]}/readyz").json()["kv_events"]["subscriptions"]
                                         .values()))["blocks"] > 0, CONVERGE_S, "blocks")
        finally:
            gw.stop()
    finally:
        st.stop()


def test_tokenizer_mismatch_routes_that_replica_approximately(tmp_path: Any) -> None:
    from tests.tokenizers.test_real_tokenizer import make_tokenizer_dir

    make_tokenizer_dir(tmp_path)
    f = Fleet(1, routing={"kv_events": {"discovery_interval_s": 0.3,
                                        "tokenizer": {"kind": "hf", "path": str(tmp_path)}}})
    try:
        wait_until(lambda: "p-0" in f.kv_health()["unsubscribed"], 5, "the tokenizer check")
        assert f.kv_health()["tokenizer"]["p-0"].startswith("mismatch")
        f.chat(prompt(1))
        assert f.manager.index.answers["fallback"] >= 1
    finally:
        f.stop()


def test_sim_tokenizer_agrees_with_the_engine(fleet: Fleet) -> None:
    wait_until(lambda: len(fleet.kv_health()["tokenizer"]) == 2, 3, "tokenizer checks")
    assert set(fleet.kv_health()["tokenizer"].values()) == {"ok"}


def test_sim_kv_events_control_validates(fleet: Fleet) -> None:
    u = fleet.urls[0]
    for bad in ({"drop_batches": -1}, {"drop_batches": "x"}, [1]):
        r = httpx.post(f"{u}/_sim/kv_events", json=bad)
        assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["message"]


def test_two_instances_over_redis_hybrid_events_correct_the_shared_index() -> None:
    """Hybrid with the approximate index in Redis (two instances): both subscribe, both route on the events, and a
    flush seen through the events empties the shared index's entries for that replica."""
    from tests.support import RedisServer

    redis = RedisServer()
    base = free_port_base()
    st, _ = start_sims(1, kv_events_config=kv_config(base))
    gws = []
    try:
        r = {"mode": "hybrid", "redis_url": redis.url, "kv_events": {"discovery_interval_s": 0.3}}
        gws = [start_gateway(config([sglang_pool("p", st.urls)], routing=r)) for _ in range(2)]
        for g in gws:
            wait_until(lambda g=g: httpx.get(f"{g.urls[0]}/readyz").json()["kv_events"]["healthy"] == 1, 5, "subscribed")
        body = {"model": "glm-5.2", "messages": [{"role": "user", "content": prompt(1)}], "max_tokens": 2}
        assert httpx.post(f"{gws[0].urls[0]}/v1/chat/completions", headers=H, json=body, timeout=30).status_code == 200
        pages = httpx.get(f"{st.urls[0]}/_sim/state").json()["ranks"][0]["cache_pages"]
        for g in gws:  # the instance that did not route it knows the blocks too
            wait_until(lambda g=g: next(iter(httpx.get(f"{g.urls[0]}/readyz").json()["kv_events"]["subscriptions"]
                                             .values()))["blocks"] == pages, CONVERGE_S, "blocks on both instances")
        second = httpx.post(f"{gws[1].urls[0]}/v1/chat/completions", headers=H, json=body, timeout=30)
        assert second.headers["x-gateway-route"] == "prefix_hit"
        state = gws[0].app.app.app.state.gateway  # type: ignore[attr-defined]
        index = getattr(state, "index", None) or state.extra["index"]
        hasher = getattr(state, "prefix_hasher", None) or state.extra["prefix_hasher"]
        keys = hasher("chat/completions", body, "glm-5.2", "tenant:tenant-a", 256)
        key = state.registry.targets[0].index_key

        def shared_entries() -> int:
            return asyncio.run_coroutine_threadsafe(index.inner.match(keys, [key]), gws[0].loop).result(5).get(key, 0)

        assert shared_entries() > 0
        assert httpx.post(f"{st.urls[0]}/flush_cache").status_code == 200
        wait_until(lambda: shared_entries() == 0, CONVERGE_S, "the shared index emptied by AllBlocksCleared")
    finally:
        for g in gws:
            g.stop()
        st.stop()
        redis.stop()
