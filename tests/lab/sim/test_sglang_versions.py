"""The simulator serves each SGLang release's surface (`--sglang-version 0.5.9 | 0.5.13 | 0.5.23`), and the gateway
works against every one of them: completions, streams, cached tokens, engine load, DP ranks pinned by the field
that release understands, liveness. Also: /health is slow behind a long prefill, and that is busy, not dead."""

import asyncio
import threading
import time

import httpx
import pytest
from openai import OpenAI

from gateway.config import parse_config
from gateway.preflight import describe, inspect
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until

VERSIONS = ["0.5.9", "0.5.13", "0.5.23"]


@pytest.mark.parametrize("version", VERSIONS)
def test_simulator_surface_per_version(version):
    sims, _ = start_sims(1, sglang_version=version, dp_size=2, report_incarnation=False)
    try:
        u = sims.urls[0]
        info = httpx.get(f"{u}/server_info").json()
        assert info["version"].startswith(version) and "incarnation" not in info and info["dp_size"] == 2
        assert ("default_priority_value" in info) == (version != "0.5.9")
        loads = httpx.get(f"{u}/v1/loads").json()
        row = loads["loads"][0]
        assert "memory" in row and "queues" in row  # no include = every section
        if version == "0.5.9":
            assert "num_waiting_uncached_tokens" not in row and loads["dp_rank_count"] == 2 and "aggregate" in loads
        else:
            assert "num_waiting_uncached_tokens" in row and "aggregate" not in loads
        assert ("accelerator" in loads and "num_accelerators" in loads) == (version == "0.5.23")
        get_load = httpx.get(f"{u}/get_load")
        assert get_load.status_code == (404 if version == "0.5.23" else 200)
        if version == "0.5.9":
            assert "num_pending_tokens" not in get_load.json()[0]
        assert httpx.get(f"{u}/ready").status_code == (200 if version == "0.5.23" else 404)
        assert httpx.get(f"{u}/ping").status_code == 200
        # rank pinning: the body field everywhere, routed_dp_rank and the header from 0.5.13
        p = {"prompt": list(range(300)), "max_tokens": 1}
        httpx.post(f"{u}/v1/completions", json={**p, "data_parallel_rank": 1}, timeout=30)
        by_field = httpx.post(f"{u}/v1/completions", json={**p, "routed_dp_rank": 1}, timeout=30).json()
        by_header = httpx.post(f"{u}/v1/completions", json=p, headers={"X-Data-Parallel-Rank": "1"}, timeout=30).json()
        new = version != "0.5.9"
        # on 0.5.9 those two are unpinned, so round robin decides (rank 0 then 1, or the reverse)
        if new:
            assert by_field["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
            assert by_header["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        bad = httpx.post(f"{u}/v1/completions", json=p, headers={"X-Data-Parallel-Rank": "x"}, timeout=30)
        assert bad.status_code == (400 if new else 200)
    finally:
        sims.stop()


def test_dp_attention_on_0523_reports_attn_dp_size():
    sims, _ = start_sims(1, dp_size=2, enable_dp_attention=True)
    try:
        info = httpx.get(f"{sims.urls[0]}/server_info").json()
        assert info["dp_size"] == 1 and info["attn_dp_size"] == 2 and info["enable_dp_attention"] is True
    finally:
        sims.stop()


@pytest.mark.parametrize("version", VERSIONS)
def test_gateway_works_against_each_version(version):
    """One dp-2 server of that release behind the gateway, nothing configured but its URL: ranks discovered and
    pinned with that release's field, cached tokens reported back, engine load read, streams end with usage."""
    sims, _ = start_sims(1, sglang_version=version, dp_size=2, report_incarnation=False)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"load_poll_s": 0.1}))
    try:
        def reg():
            return gw.app.state.gateway.registry

        wait_until(lambda: gw.call(lambda: [t.name for t in reg().by_pool["p"]]) == ["p-0/dp0", "p-0/dp1"],
                   timeout=10, what="ranks discovered")
        field = gw.call(lambda: reg().by_pool["p"][0].pin_field())
        assert field == ("data_parallel_rank" if version == "0.5.9" else "routed_dp_rank")
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        system = {"role": "system", "content": "versioned shared context " * 400}
        replicas, cached = [], []
        for i in range(4):
            r = c.chat.completions.with_raw_response.create(
                model="glm-5.2", messages=[system, {"role": "user", "content": f"question {i}"}], max_tokens=3)
            replicas.append(r.headers["x-gateway-replica"])
            details = r.parse().usage.prompt_tokens_details  # None on 0.5.13 when nothing was cached
            cached.append(details.cached_tokens if details is not None else 0)
        assert len(set(replicas)) == 1 and min(cached[1:]) >= 2000  # one rank holds the prefix and is reused
        stream = c.chat.completions.create(model="glm-5.2", messages=[system, {"role": "user", "content": "s"}],
                                           max_tokens=5, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens >= 2000
        wait_until(lambda: gw.call(lambda: all(t.engine_load is not None for t in reg().by_pool["p"])), timeout=5,
                   what="engine load read from /v1/loads")
        assert gw.call(lambda: reg().by_pool["p"][0].version).startswith(version)
    finally:
        gw.stop()
        sims.stop()


def test_health_is_slow_behind_a_long_prefill_and_the_gateway_keeps_the_replica():
    """SGLang's /health waits for scheduler output, and a long chunked prefill sends none until it ends: /health
    times out while /ping answers at once. A pool still probing /health re-checks /ping and keeps the busy replica
    in rotation instead of ejecting it."""
    sims, _ = start_sims(1, time_scale=4.0)
    u = sims.urls[0]
    pool = {**sglang_pool("p", sims.urls), "health_path": "/health"}
    gw = start_gateway(config([pool], health={"interval_s": 0.3, "timeout_s": 0.5}))
    body = {"prompt": [i % 100_000 for i in range(200_000)], "max_tokens": 1}  # ~13 chunks of 16k, no output between
    prefill = threading.Thread(target=lambda: httpx.post(f"{u}/v1/completions", json=body, timeout=120), daemon=True)
    try:
        prefill.start()
        wait_until(lambda: httpx.get(f"{u}/_sim/state").json()["ranks"][0]["counters"]["prefill_compute_tokens"] >= 16_384,
                   timeout=10, what="the long prefill under way (its first chunk done)")
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{u}/health", timeout=0.5)
        assert httpx.get(f"{u}/ping", timeout=0.5).status_code == 200
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # several health rounds, all while the prefill runs
            assert gw.call(lambda: gw.app.state.gateway.registry.by_pool["p"][0].healthy)
            time.sleep(0.1)
        assert prefill.is_alive()  # still prefilling: every probe above saw a slow /health
    finally:
        gw.stop()
        sims.stop()


def test_gateway_in_front_of_shortest_prefill_first_servers_sends_no_priority():
    """Servers started with --schedule-policy shortest-prefill-first cannot schedule by priority, and with
    --abort-on-priority-when-disabled refuse any request that carries one. The gateway reads that from /server_info
    (`send_priority: auto`), sends no priority (the prefill levels included), and every request is served, its
    prefix reused; `gateway check` reads the policy."""
    sims, _ = start_sims(2, schedule_policy="shortest-prefill-first", abort_on_priority_when_disabled=True)
    gw = start_gateway(config([sglang_pool("p", sims.urls)], routing={"load_poll_s": 0.1}))
    try:
        wait_until(lambda: gw.call(lambda: all(t.priority_scheduling is False
                                               for t in gw.app.state.gateway.registry.by_pool["p"])),
                   timeout=10, what="server facts read")
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        system = {"role": "system", "content": "shortest first shared context " * 400}
        cached = []
        for i in range(3):
            r = c.chat.completions.create(model="glm-5.2", messages=[system, {"role": "user", "content": f"q{i}"}],
                                          max_tokens=3)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert min(cached[1:]) >= 2000
        rep = asyncio.run(inspect(httpx.AsyncClient(trust_env=False), parse_config(config([sglang_pool("p", sims.urls)]))
                                  .pools[0], "p-0", sims.urls[0], None, 256))
        assert "schedule policy shortest-prefill-first, priority scheduling False" in describe(rep)
        assert rep.checks() == []  # send_priority: auto sends nothing there, so the refusal is no misconfiguration
    finally:
        gw.stop()
        sims.stop()
