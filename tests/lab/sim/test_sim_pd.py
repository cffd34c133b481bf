"""The simulator's PD roles, over real HTTP, as a PD router drives SGLang: the same body with bootstrap_host/port/room
sent to a prefill server and a decode server at once. The decode server streams the answer after the room's KV
arrived; the prefill server answers one token once it sent the KV. Either side failing mid-transfer fails the other
side's request with an error (never a hang), and no KV stays reserved on either side afterwards."""

from __future__ import annotations

import asyncio
import random

import httpx
import orjson
import pytest

from gateway_lab.sim.des import EventLoop, VirtualRank
from gateway_lab.sim.pd import DecodeRank, KvFabric, PrefillRank, Side, rank_for_room
from gateway_lab.sim.profiles import profile
from gateway_lab.sim.sim_request import Event, EventKind, SimRequest
from tests.support import start_pd_sims, wait_until


@pytest.fixture(scope="module")
def pd():
    st, pre, dec, boots = start_pd_sims(1, 1, dp_size=2)
    yield st, pre, dec, boots
    st.stop()


def body(room: int, port: int, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "tell me about disaggregation " * 50}],
            "max_tokens": 40, "ignore_eos": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": room, **kw}


async def both(st, b: dict, decode_stream: bool = False) -> tuple[httpx.Response, list[dict] | httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as c:
        async def decode() -> list[dict] | httpx.Response:
            if not decode_stream:
                return await c.post(st.urls[1] + "/v1/chat/completions", json=b)
            events = []
            async with c.stream("POST", st.urls[1] + "/v1/chat/completions", json={**b, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(orjson.loads(line[6:]))
            return events

        p, d = await asyncio.gather(c.post(st.urls[0] + "/v1/chat/completions", json=b), decode())
    return p, d


def idle(reps) -> bool:
    return all(r.rank.used_tokens() - r.rank.cache.locked_tokens == 0 and not r.rank.running and not r.rank.waiting
               and not getattr(r.rank, "sending", None) and not getattr(r.rank, "prealloc", None)
               and not getattr(r.rank, "transferring", None) for rep in reps for r in rep.ranks)


def test_both_legs_serve_one_request_the_decode_side_answers_it(pd):
    st, pre, dec, boots = pd
    room = random.getrandbits(63)
    p, d = asyncio.run(both(st, body(room, boots[0])))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert p.json()["usage"]["completion_tokens"] == 1  # the prefill server's answer is its first token
    assert d.json()["usage"]["completion_tokens"] == 40
    assert d.json()["usage"]["prompt_tokens"] == p.json()["usage"]["prompt_tokens"]
    k = rank_for_room(room, 2)  # both sides put the room on the same DP rank, without talking
    assert pre[0].ranks[k].rank.counters.requests >= 1 and dec[0].ranks[k].rank.counters.requests >= 1
    assert pre[0].ranks[1 - k].rank.counters.requests == 0 and dec[0].ranks[1 - k].rank.counters.requests == 0
    wait_until(lambda: idle(pre + dec))


def test_the_prefill_cache_serves_a_repeated_prefix(pd):
    st, _pre, _dec, boots = pd
    _first, _ = asyncio.run(both(st, body(10, boots[0])))
    again, d = asyncio.run(both(st, body(12, boots[0])))  # same rank (10 % 2 == 12 % 2), same prompt
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert d.status_code == 200


def test_streamed_decode_leg_carries_the_whole_answer(pd):
    st, _, _, boots = pd
    p, events = asyncio.run(both(st, body(random.getrandbits(63), boots[0]), decode_stream=True))
    assert p.status_code == 200
    assert isinstance(events, list)
    text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or [])
    assert len(text.split()) == 40
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_requests_without_bootstrap_fields_are_refused_with_a_400(pd):
    st, _, _, boots = pd
    for url in st.urls[:2]:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "bootstrap_room" in r.json()["message"]
    r = httpx.post(st.urls[1] + "/v1/chat/completions", json=body(-1, boots[0]))
    assert r.status_code == 400
    r = httpx.post(st.urls[1] + "/v1/chat/completions", json=body(5, boots[0], n=2))
    assert r.status_code == 400


def test_decode_with_an_unknown_bootstrap_port_fails_fast(pd):
    st, _, dec, _ = pd
    r = httpx.post(st.urls[1] + "/v1/chat/completions", json=body(7, 1), timeout=30)
    assert r.status_code == 500 and "unreachable" in r.json()["message"]
    wait_until(lambda: idle(dec))


def test_server_info_and_loads_report_the_role(pd):
    st, _, _, _boots = pd
    assert httpx.get(st.urls[0] + "/server_info").json()["disaggregation_mode"] == "prefill"
    assert httpx.get(st.urls[1] + "/server_info").json()["disaggregation_mode"] == "decode"
    assert httpx.get(st.urls[1] + "/v1/loads").json()["loads"][0]["disagg"]["mode"] == "decode"
    boot = st.urls[2]
    assert httpx.get(boot + "/health").text == "OK"
    assert httpx.get(boot + "/route", params={"engine_rank": -1}).json()["prefill_page_size"] == 64


def test_a_stalled_transfer_times_out_on_both_sides_and_frees_the_kv(pd):
    """A wedged transfer: the decode side gives up after its waiting timeout (an error, not a hang), the prefill
    side's request fails with it, and neither side keeps KV reserved."""
    st, pre, dec, boots = pd
    for r in pre + dec:
        r.reconfigure(disaggregation_waiting_timeout=5.0)
    try:
        assert httpx.post(st.urls[0] + "/_sim/fault", json={"kind": "transfer_stall"}).status_code == 200
        p, d = asyncio.run(both(st, body(random.getrandbits(63), boots[0])))
        assert d.status_code == 500 and "timed out" in d.json()["message"]
        assert p.status_code == 500
        wait_until(lambda: idle(pre + dec))
    finally:
        for r in pre + dec:
            r.reconfigure(disaggregation_waiting_timeout=300.0)


def test_prefill_restart_mid_transfer_fails_the_decode_leg(pd):
    """The prefill server dies while the decode side waits for the KV: the decode request ends with an error."""
    st, _pre, dec, boots = pd
    b = body(random.getrandbits(63), boots[0])
    b["messages"][0]["content"] = "a long prompt to keep the prefill busy " * 4000

    async def go() -> tuple[object, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            pt = asyncio.create_task(c.post(st.urls[0] + "/v1/chat/completions", json=b))
            dt = asyncio.create_task(c.post(st.urls[1] + "/v1/chat/completions", json=b))
            await asyncio.sleep(0.05)  # both legs in: the decode side holds its reservation
            await c.post(st.urls[0] + "/_sim/fault", json={"kind": "restart"})
            p = await asyncio.gather(pt, return_exceptions=True)
            return p[0], await dt

    p, d = asyncio.run(go())
    assert d.status_code == 500 and "KV transfer failed" in d.json()["message"]
    assert isinstance(p, Exception) or p.status_code != 200  # type: ignore[union-attr]
    wait_until(lambda: idle(dec))


# -- the same roles on the virtual clock (what `gateway replay --pd` drives) -------------------------------------
def test_virtual_clock_transfer_time_follows_the_link_model():
    loop = EventLoop()
    fabric = KvFabric(lambda d, fn: loop.at(loop.now + d, fn))
    cfg = profile("mi355x-glm52-tp4")
    p = VirtualRank(PrefillRank(cfg.with_overrides(disaggregation_mode="prefill")), loop)
    d = VirtualRank(DecodeRank(cfg.with_overrides(disaggregation_mode="decode")), loop)
    fabric.register("8998", p)
    events: dict[str, list[Event]] = {"p": [], "d": []}
    keys = list(range(20_000 // 64))
    preq = SimRequest("p", keys, 20_000, 1, "length", 0.0, events["p"].append)
    dreq = SimRequest("d", keys, 20_000, 50, "length", 0.0, events["d"].append)
    fabric.add_prefill("8998", 1, Side(p.rank, preq, p.kick, lambda: loop.now))  # type: ignore[arg-type]
    fabric.add_decode("8998", 1, Side(d.rank, dreq, d.kick, lambda: loop.now))  # type: ignore[arg-type]
    p.rank.submit(preq)
    d.rank.submit(dreq)
    p.kick()
    d.kick()
    loop.run(until=100)
    pf = next(e for e in events["p"] if e.kind is EventKind.FINISH)
    df = next(e for e in events["d"] if e.kind is EventKind.FIRST)
    transfer = cfg.kv_transfer_time(20_000)
    assert transfer == pytest.approx(0.001 + 20_000 * 55_000 / 40e9)
    assert df.time >= pf.time  # the decode side's first token comes after the KV is out
    assert any(e.kind is EventKind.FINISH for e in events["d"])
    assert fabric.transfers == 1 and not fabric.rooms
    assert p.rank.used_tokens() == p.rank.cache.locked_tokens == 0 and d.rank.used_tokens() == 0
