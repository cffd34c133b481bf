"""A PD pool end to end: the gateway over real HTTP in front of simulated SGLang prefill and decode servers.

Invariants: every request takes both legs with SGLang's bootstrap fields and the client gets the decode server's
answer; a leg failing before the commit point costs the client nothing (another prefill rank, another pair); after
it, the stream ends with an error event; and in every case the prefill load view and both servers' KV go back to
zero (nothing leaked)."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from gateway.app import create_admin_app, create_app
from gateway.config import hash_key, parse_config
from gateway_lab.sim.pd import FABRIC
from tests.gateway_fixtures import KEY_A, config, start_gateway
from tests.support import ServerThread, start_pd_sims, wait_until

LONG = [{"role": "user", "content": "explain prefill/decode disaggregation in detail " * 300}]


def pd_pool(decode_urls: list[str], prefill_urls: list[str], boots: list[int], **disagg) -> dict:
    return {"name": "pd", "kind": "sglang", "model": "zai-org/GLM-5.2",
            "replicas": [{"name": f"decode-{i}", "url": u} for i, u in enumerate(decode_urls)],
            "disaggregation": {"prefill": [{"name": f"prefill-{i}", "url": u, "bootstrap_port": b}
                                           for i, (u, b) in enumerate(zip(prefill_urls, boots))],
                               "decide": "always", **disagg}}


@pytest.fixture
def deployment():
    st, pre, dec, boots = start_pd_sims(2, 2)
    gw = start_gateway(config([pd_pool(st.urls[2:4], st.urls[0:2], boots)],
                              routing={"policy": "least_loaded"}))
    try:
        yield st, pre, dec, gw
    finally:
        gw.stop()
        st.stop()


def pd_state(gw):
    return gw.app.state.gateway.backends["sglang"].pools["pd"]


def idle(reps) -> bool:
    return all(not r.rank.running and not r.rank.waiting and r.rank.reserved == 0 and r.rank.cache.locked_tokens == 0
               and not getattr(r.rank, "sending", None) and not getattr(r.rank, "prealloc", None)
               and not getattr(r.rank, "transferring", None) for rep in reps for r in rep.ranks)


def nothing_leaked(gw, pre, dec) -> bool:
    load = pd_state(gw).load()
    kv = gw.call(lambda: dict(pd_state(gw).decode_kv))
    return all(v["queued_tokens"] == 0 and v["inflight"] == 0 for v in load.values()) and not kv and idle(pre + dec)


def client(gw) -> OpenAI:
    return OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)


def test_both_legs_serve_the_request_streamed_and_not(deployment):
    _st, pre, dec, gw = deployment
    c = client(gw)
    r = c.chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=30, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 30
    chunks = list(c.chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=30, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 30
    assert sum(rk.rank.counters.requests for p in pre for rk in p.ranks) == 2  # one prefill leg per request
    raw = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=LONG, max_tokens=3)
    assert raw.headers["x-gateway-pd"] in ("pd_fixed; prefill=prefill-0", "pd_fixed; prefill=prefill-1")
    assert raw.headers["x-gateway-replica"].startswith("decode-")
    assert pd_state(gw).branches["pd_fixed"] == 3
    wait_until(lambda: nothing_leaked(gw, pre, dec), what="load view and KV back to zero")


def test_a_repeated_prompt_goes_to_the_prefill_rank_that_holds_it(deployment):
    _st, pre, _dec, gw = deployment
    c = client(gw)
    for _ in range(3):
        c.chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=2)
    counts = sorted(rk.rank.counters.requests for p in pre for rk in p.ranks)
    assert counts == [0, 3]  # prefix affinity: one prefill server took them all
    cached = max(rk.rank.counters.cached_tokens for p in pre for rk in p.ranks)
    assert cached > 0


def test_prefill_leg_refused_before_the_commit_point_is_served_by_the_other_prefill(deployment):
    st, pre, dec, gw = deployment
    st.stop_one(0)  # prefill-0 is gone: its legs are refused
    c = client(gw)
    for stream in (False, True, False):
        r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=LONG, max_tokens=5, stream=stream,
                                                        extra_body={"ignore_eos": True})
        body = r.parse()
        last = list(body)[-1] if stream else body
        assert last.choices[0].finish_reason == "length"
    assert sum(rk.rank.counters.requests for rk in pre[1].ranks) == 3
    wait_until(lambda: nothing_leaked(gw, pre[1:], dec), what="load view and KV back to zero")
    assert all(v["inflight"] == 0 for v in pd_state(gw).load().values())


def test_prefill_error_status_retries_with_another_prefill(deployment):
    st, pre, dec, gw = deployment
    for u in st.urls[0:2]:  # whichever prefill is chosen first answers 503 once
        httpx.post(u + "/_sim/fault", json={"kind": "status", "status": 503, "count": 1})
    r = client(gw).chat.completions.with_raw_response.create(model="glm-5.2", messages=LONG, max_tokens=5)
    assert r.parse().usage.completion_tokens > 0
    wait_until(lambda: nothing_leaked(gw, pre, dec), what="load view and KV back to zero")


def test_a_stalled_transfer_is_retried_before_the_commit_point(deployment):
    """The KV never arrives (a wedged transfer): the decode server gives up after its waiting timeout, and the
    gateway, before anything reached the client, tries another pair."""
    st, pre, dec, gw = deployment
    for r in pre + dec:
        r.reconfigure(disaggregation_waiting_timeout=4.0)
    failed = FABRIC.failures
    httpx.post(st.urls[0] + "/_sim/fault", json={"kind": "transfer_stall", "count": 1})
    r = client(gw).chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=5, stream=True,
                                           extra_body={"ignore_eos": True})
    chunks = list(r)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert FABRIC.failures > failed  # the stalled room failed; the client got another pair's answer
    wait_until(lambda: nothing_leaked(gw, pre, dec), what="load view and KV back to zero")


def test_decode_dying_mid_stream_is_an_error_event_and_leaks_nothing(deployment):
    st, pre, dec, gw = deployment
    for u in st.urls[2:4]:
        httpx.post(u + "/_sim/fault", json={"kind": "reset_after_chunks", "n": 3, "count": 1})
    got = []
    with pytest.raises(openai.APIError) as e:
        for ch in client(gw).chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=200, stream=True,
                                                     extra_body={"ignore_eos": True}):
            got.append(ch)
    assert "mid-stream" in str(e.value)
    assert 1 <= len(got) <= 4
    wait_until(lambda: nothing_leaked(gw, pre, dec), what="load view and KV back to zero")


def test_no_prefill_left_is_an_http_error_before_the_commit_point(deployment):
    st, _pre, dec, gw = deployment
    st.stop_one(0)
    st.stop_one(1)
    with pytest.raises(openai.APIStatusError) as e:
        client(gw).chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=5, stream=True)
    assert e.value.status_code in (502, 503)
    wait_until(lambda: nothing_leaked(gw, [], dec), what="decode KV back to zero")


def test_n_above_one_is_a_clear_400_on_a_pd_pool(deployment):
    with pytest.raises(openai.BadRequestError) as e:
        client(deployment[3]).chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=5, n=2)
    assert "one sequence per request" in str(e.value)


def test_auto_serves_on_the_decode_server_when_that_predicts_better():
    st, pre, _dec, boots = start_pd_sims(1, 1, disaggregation_decode_local_prefill=True)
    gw = start_gateway(config([pd_pool(st.urls[1:2], st.urls[0:1], boots, decide="auto", local_prefill=True)]))
    try:
        c = client(gw)
        c.chat.completions.create(model="glm-5.2", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        c.chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=3)
        # on an idle decode server the long prompt is cheaper there too: it skips the KV transfer and stalls no
        # running stream (the busy cases are routing/pd.py's unit tests)
        assert dict(pd_state(gw).branches) == {"unified_short": 1, "unified_cheaper": 1}
        assert sum(rk.rank.counters.requests for rk in pre[0].ranks) == 0
        metrics = httpx.get(gw.admin_url + "/metrics").text
        assert 'gateway_pd_decisions_total{branch="unified_short",pool="pd"} 1.0' in metrics
    finally:
        gw.stop()
        st.stop()


def test_a_request_no_decode_server_has_kv_headroom_for_is_a_503_before_any_leg():
    """Decode servers are passed over when this instance's requests there leave too little KV (the pool timing's
    capacity); when none is left, the client gets a 503 to retry, and no prefill leg was sent."""
    st, pre, dec, boots = start_pd_sims(1, 2)
    p = pd_pool(st.urls[1:3], st.urls[0:1], boots)
    p["timing"] = {"kv_capacity_tokens": 8_000}
    gw = start_gateway(config([p]))
    try:
        c = client(gw)
        r = c.chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=50)  # ~3.6k + 50 fits
        assert r.usage.completion_tokens > 0
        with pytest.raises(openai.APIStatusError) as e:  # ~3.6k + 6k does not, on either server
            c.chat.completions.create(model="glm-5.2", messages=LONG, max_tokens=6_000)
        assert e.value.status_code == 503
        assert pd_state(gw).branches["decode_kv_full"] == 2
        assert sum(rk.rank.counters.requests for rk in pre[0].ranks) == 1
        wait_until(lambda: nothing_leaked(gw, pre, dec), what="load view and KV back to zero")
    finally:
        gw.stop()
        st.stop()


def test_prefill_dying_after_bootstrap_is_retried_before_the_commit_point(deployment):
    """The prefill server restarts while it holds the request (the decode side waits for the room's KV): the client
    still gets a whole answer, from another pair, and nothing stays reserved."""
    import concurrent.futures

    st, pre, dec, gw = deployment
    long = [{"role": "user", "content": "a prompt long enough to keep a prefill busy for a while " * 3000}]

    def holding() -> int | None:
        for i, rep in enumerate(pre):
            if any(r.rank.waiting or r.rank.running or r.rank.sending for r in rep.ranks):
                return i
        return None

    # Both prefill servers slowed 20x, so the restart lands while the prefill is under way however busy the machine
    # is (at the fixture's time scale a prefill of this prompt otherwise ends in a fraction of a second, and a
    # restart after its KV was sent leaves nothing to retry); a restart clears the fault on the server it hits.
    for url in st.urls[0:2]:
        httpx.post(url + "/_sim/fault", json={"kind": "slow", "phase": "prefill", "factor": 20}).raise_for_status()
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(lambda: list(client(gw).chat.completions.create(
            model="glm-5.2", messages=long, max_tokens=5, stream=True, extra_body={"ignore_eos": True})))
        wait_until(lambda: holding() is not None and any(rk.rank.prealloc or rk.rank.transferring
                                                         for d in dec for rk in d.ranks),
                   what="both legs in flight")
        i = holding()
        assert i is not None
        httpx.post(st.urls[i] + "/_sim/fault", json={"kind": "restart"})
        chunks = fut.result(timeout=60)
    assert chunks[-1].choices[0].finish_reason == "length"
    # a fresh prefill leg served it (on the other server, or on the restarted one if the retry came after it was up)
    assert sum(rk.rank.counters.requests for p in pre for rk in p.ranks) >= 1
    wait_until(lambda: nothing_leaked(gw, pre, dec), what="load view and KV back to zero")


def test_admin_state_shows_the_prefill_ranks_and_branches():
    st, _, _, boots = start_pd_sims(1, 1)
    cfg = config([pd_pool(st.urls[1:2], st.urls[0:1], boots)], admin={"token_hashes": [hash_key("adm-token")]})
    app = create_app(parse_config(cfg))
    gw = ServerThread([app, create_admin_app(app)]).start()
    try:
        OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0).chat.completions.create(
            model="glm-5.2", messages=LONG, max_tokens=3)
        state = httpx.get(gw.urls[1] + "/admin/state", headers={"authorization": "Bearer adm-token"}).json()
        pd = state["pools"][0]["pd"]
        assert pd["branches"] == {"pd_fixed": 1} and pd["decide"] == "always"
        assert [(p["name"], p["circuit"], p["bootstrap_port"]) for p in pd["prefill"]] == [("prefill-0", "closed", boots[0])]
        wait_until(lambda: httpx.get(gw.urls[1] + "/admin/state", headers={"authorization": "Bearer adm-token"}).json()
                   ["pools"][0]["pd"]["prefill"][0]["inflight"] == 0, what="the prefill leg released")
    finally:
        gw.stop()
        st.stop()


def test_the_room_puts_the_prefill_leg_on_the_chosen_dp_rank():
    """A prefill server with 2 DP ranks: SGLang sends room r to rank r % 2, so the gateway picks the rank by picking
    the room; a repeated prompt follows its prefix to the same rank, and a different one may go to the other."""
    st, pre, dec, boots = start_pd_sims(1, 1, dp_size=2)
    p = pd_pool(st.urls[1:2], st.urls[0:1], boots)
    p["disaggregation"]["prefill"][0]["dp_size"] = 2
    gw = start_gateway(config([p]))
    try:
        c = client(gw)
        for _ in range(3):
            r = c.chat.completions.with_raw_response.create(model="glm-5.2", messages=LONG, max_tokens=2)
        first = r.headers["x-gateway-pd"].split("prefill=")[1]
        assert first in ("prefill-0/dp0", "prefill-0/dp1")
        k = int(first[-1])
        assert [rk.rank.counters.requests for rk in pre[0].ranks][k] == 3
        assert pre[0].ranks[k].rank.counters.cached_tokens > 0
        wait_until(lambda: nothing_leaked(gw, pre, dec), what="load view and KV back to zero")
    finally:
        gw.stop()
        st.stop()
