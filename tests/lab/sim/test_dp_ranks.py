"""Data-parallel SGLang servers (issue #11): a server with N ranks becomes N routing targets, discovered from
/server_info with nothing in the config but its URL, each pinned to its rank, so prefix affinity survives."""

import asyncio
import threading

import httpx

from gateway_lab.sim.profiles import profile
from gateway_lab.sim.replica import Replica
from gateway_lab.sim.server import create_sim_app
from loadtests.dp_ranks import SETUPS, run_setup
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, free_port, start_sims, wait_until


def test_pinned_ranks_keep_the_hits_of_separate_servers_and_unpinned_lose_them():
    """The must-show, small: one `--dp-size 2` server (plain and with DP attention) behind the gateway keeps prefix
    hits within 2 points of two single-rank servers; with pinning off, SGLang's round robin splits each group's
    requests over both ranks' caches and hits fall."""
    rows = {s.name: run_setup(s, groups=3, per_group=4, prefix_words=800) for s in SETUPS}
    two, pinned, attn, off = (rows[s.name] for s in SETUPS)
    assert pinned["targets"] == ["p-0/dp0", "p-0/dp1"] and attn["targets"] == ["p-0/dp0", "p-0/dp1"]
    assert off["targets"] == ["p-0"]
    assert abs(pinned["hit_rate"] - two["hit_rate"]) <= 0.02
    assert abs(attn["hit_rate"] - two["hit_rate"]) <= 0.02
    assert pinned["hit_rate"] > off["hit_rate"] + 0.05


def test_ranks_discovered_after_a_start_without_the_server():
    """/server_info unreachable at start: the server is one target (requests fail over as usual); when it comes up,
    the next poll discovers its ranks and splits it, with no config change."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = start_gateway(config([sglang_pool("p", [url])], routing={"load_poll_s": 0.1}))
    sims = None
    try:
        def names() -> list[str]:
            return gw.call(lambda: [t.name for t in gw.app.state.gateway.registry.by_pool["p"]])

        assert names() == ["p-0"]
        cfg = profile("mi355x-glm52-tp4", time_scale=20.0, dp_size=2, enable_cache_report=True)
        sims = ServerThread([create_sim_app(Replica(cfg, name="late"))], ports=[port]).start()
        wait_until(lambda: names() == ["p-0/dp0", "p-0/dp1"], timeout=10, what="ranks discovered on reconnect")
        r = httpx.post(f"{gw.urls[0]}/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"}, timeout=30,
                       json={"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-gateway-replica"] in ("p-0/dp0", "p-0/dp1")
    finally:
        gw.stop()
        if sims is not None:
            sims.stop()


def test_config_dp_size_overrides_discovery_and_each_rank_gets_its_own_load():
    """`dp_size` in the config splits the server before anything is read; each rank target gets its own rank's row
    of /v1/loads (not the server's sum)."""
    sims, _ = start_sims(1, dp_size=2)
    pool = sglang_pool("p", sims.urls)
    pool["replicas"][0]["dp_size"] = 2
    gw = start_gateway(config([pool], routing={"load_poll_s": 0.1}))
    try:
        def reg():
            return gw.app.state.gateway.registry

        assert gw.call(lambda: [t.dp_rank for t in reg().by_pool["p"]]) == [0, 1]
        # a long request held on rank 1 (sent straight to the server) shows on p-0/dp1 only
        body = {"prompt": list(range(200)), "max_tokens": 100_000, "ignore_eos": True, "data_parallel_rank": 1}
        held = threading.Thread(target=lambda: _quietly(lambda: httpx.post(f"{sims.urls[0]}/v1/completions", json=body,
                                                                            timeout=3)), daemon=True)
        held.start()
        wait_until(lambda: gw.call(lambda: [(t.engine_load.inflight if t.engine_load else None)
                                            for t in reg().by_pool["p"]]) == [0, 1], timeout=3, what="per-rank load")
        held.join()
    finally:
        gw.stop()
        sims.stop()


def _quietly(fn):
    try:
        fn()
    except httpx.HTTPError:
        pass  # the held request is cut by its timeout; only its load while it ran matters


def test_header_pinning_reaches_the_rank():
    """`dp_pinning: header` pins with X-Data-Parallel-Rank (0.5.13+) instead of a body field: the rank the router
    chose is the rank that served, every time."""
    sims, _ = start_sims(1, dp_size=2)
    pool = {**sglang_pool("p", sims.urls), "dp_pinning": "header"}
    gw = start_gateway(config([pool], routing={"load_poll_s": 0.1}))
    try:
        wait_until(lambda: gw.call(lambda: len(gw.app.state.gateway.registry.by_pool["p"])) == 2, timeout=10,
                   what="ranks discovered")
        served = []
        for i in range(4):
            r = httpx.post(f"{gw.urls[0]}/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"}, timeout=30,
                           json={"model": "glm-5.2", "max_tokens": 2, "messages": [
                               {"role": "system", "content": "header pinned context " * 300},
                               {"role": "user", "content": f"q{i}"}]})
            served.append(r.headers["x-gateway-replica"])
        rank = int(served[0][-1])
        assert len(set(served)) == 1
        counters = [x["counters"] for x in httpx.get(f"{sims.urls[0]}/_sim/state").json()["ranks"]]
        assert counters[rank]["requests"] >= 4 and counters[rank]["cached_tokens"] >= 3 * 1500
        assert counters[1 - rank]["cached_tokens"] == 0  # round robin would have split the group over both ranks
    finally:
        gw.stop()
        sims.stop()


def test_admin_addresses_one_rank_and_flushes_every_rank_of_a_server():
    """On-call can drain one rank by its target name (`p-0/dp1`, a slash inside the name); flush-prefix by the
    server's name forgets every rank's entries, not only the first rank's."""
    from tests.tenancy.test_tenancy import ADMIN_H, cfg_for

    sims, _ = start_sims(1, dp_size=2)
    pool = sglang_pool("p", sims.urls)
    pool["replicas"][0]["dp_size"] = 2
    gw = start_gateway(cfg_for([pool]))
    st = lambda: gw.app.state.gateway  # noqa: E731
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, gw.loop).result(5)  # noqa: E731
    post = lambda path: httpx.post(gw.admin_url + path, headers=ADMIN_H, timeout=10)  # noqa: E731
    try:
        r = post("/admin/replicas/p-0/dp1/drain")
        assert r.status_code == 200 and {k: v for k, v in r.json().items() if k != "audit_id"} == \
            {"replica": "p-0/dp1", "drained": True}  # audit_id: the history entry an undo names
        assert gw.call(lambda: [(t.name, t.drained) for t in st().registry.by_pool["p"]]) == [
            ("p-0/dp0", False), ("p-0/dp1", True)]
        assert post("/admin/replicas/p-0/dp1/undrain").json()["drained"] is False
        assert post("/admin/replicas/p-0/dp7/drain").status_code == 404  # an unknown rank is an unknown replica

        keys = gw.call(lambda: [t.index_key for t in st().registry.by_pool["p"]])
        for key in keys:
            run(st().index.insert(key, [1, 2, 3], 60.0))
        assert run(st().index.match([1, 2, 3], keys)) == {k: 3 for k in keys}
        r = post("/admin/replicas/p-0/flush-prefix")
        assert r.status_code == 200 and r.json()["flushed"] == keys
        assert run(st().index.match([1, 2, 3], keys)) == {}
        run(st().index.insert(keys[0], [1, 2, 3], 60.0))
        run(st().index.insert(keys[1], [1, 2, 3], 60.0))
        assert post("/admin/replicas/p-0/dp1/flush-prefix").json()["flushed"] == [keys[1]]  # one rank alone
        assert run(st().index.match([1, 2, 3], keys)) == {keys[0]: 3}
    finally:
        gw.stop()
        sims.stop()
