"""The PD pair decision (routing/pd.py), table-driven: which prefill rank, which decode server, and whether to
disaggregate. Each case names the branch it must take, because the branch is what the metrics and the replay
tables count."""

from __future__ import annotations

import pytest

from gateway.config import PoolTiming
from gateway.pd_config import Disaggregation
from gateway.routing.pd import (
    DecodeView,
    PdRequest,
    PrefillView,
    choose_decode,
    choose_prefill,
    decide,
    room_for_rank,
)

AUTO = Disaggregation.model_validate({"prefill": [{"name": "p", "url": "http://p"}], "decide": "auto",
                                      "local_prefill": True})
T = PoolTiming()


def pv(name: str, cached: int = 0, queued: float = 0.0, available: bool = True) -> PrefillView:
    return PrefillView(name, name, 0, cached, queued, available)


def dv(inflight: float = 0.0, queued: float = 0.0, kv_used: int | None = None, name: str = "d") -> DecodeView:
    return DecodeView(name, inflight, 48, 2_400_000, kv_used, queued)


@pytest.mark.parametrize("views,expect", [
    ([pv("a", cached=18_000, queued=10_000), pv("b")], "a"),  # 12k tokens of work beat 20k
    ([pv("a", cached=18_000, queued=30_000), pv("b")], "b"),  # 32k behind the warm one: the cold idle one
    ([pv("a"), pv("b")], "a"),  # tie: by name
    ([pv("a", cached=4_096), pv("b", cached=4_096, available=False)], "a"),
])
def test_choose_prefill(views, expect):
    """The prefill rank that finishes this prompt first: prefix affinity and queue in one number."""
    assert choose_prefill(views, PdRequest(20_000, 500, 2.0), AUTO)[0].name == expect


def test_choose_prefill_none_available():
    assert choose_prefill([pv("a", available=False)], PdRequest(1000, 10, 2.0), AUTO) is None


@pytest.mark.parametrize("views,expect,branch", [
    ([dv(10, name="a"), dv(2, name="b")], "b", "decode_load"),
    ([dv(2, kv_used=2_390_000, name="a"), dv(40, name="b")], "b", "decode_load"),  # a has no KV headroom
    ([dv(2, kv_used=2_390_000, name="a"), dv(2, kv_used=2_300_000, name="b")], "b", "decode_kv_tight"),
])
def test_choose_decode(views, expect, branch):
    v, b = choose_decode(views, PdRequest(20_000, 1000, 2.0), AUTO)
    assert (v.name, b) == (expect, branch)


@pytest.mark.parametrize("req,prefill,decode,branch,disagg", [
    # a short uncached prompt stays on the decode server, whatever the queues
    (PdRequest(200, 100, 2.0), [pv("p")], dv(), "unified_short", False),
    # the prefill pool is congested (~8 s of queue) and the decode server is free: prefill there (SLA-aware PD)
    (PdRequest(20_000, 500, 2.22), [pv("p", queued=140_000)], dv(), "unified_sla", False),
    # the decode server has a long prefill queue: only the pair meets the SLA
    (PdRequest(20_000, 500, 2.22), [pv("p")], dv(10, queued=40_000), "pd_sla", True),
    # both meet the SLA; a busy decode batch would stall for the prefill: the pair is cheaper
    (PdRequest(20_000, 500, 2.22), [pv("p")], dv(48), "pd_cheaper", True),
    # both meet the SLA on an idle decode server: no transfer, no stalled stream
    (PdRequest(20_000, 500, 2.22), [pv("p")], dv(0), "unified_cheaper", False),
    # neither meets it: the faster
    (PdRequest(60_000, 500, 1.0), [pv("p", queued=10_000)], dv(0), "unified_faster", False),
    (PdRequest(60_000, 500, 1.0), [pv("p")], dv(30, queued=30_000), "pd_faster", True),
    # no prefill rank available: served whole on the decode server
    (PdRequest(20_000, 500, 2.22), [pv("p", available=False)], dv(), "unified_no_prefill", False),
])
def test_decide_auto(req, prefill, decode, branch, disagg):
    c = decide(req, prefill, decode, AUTO, T)
    assert (c.branch, c.disaggregate) == (branch, disagg)
    assert (c.prefill is not None) == disagg


def test_decide_always_and_without_local_prefill():
    always = AUTO.model_copy(update={"decide": "always"})
    assert decide(PdRequest(200, 10, 2.0), [pv("p")], dv(), always, T).branch == "pd_fixed"
    only = AUTO.model_copy(update={"local_prefill": False})
    assert decide(PdRequest(200, 10, 2.0), [pv("p")], dv(), only, T).branch == "pd_only"
    c = decide(PdRequest(200, 10, 2.0), [pv("p", available=False)], dv(), only, T)
    assert (c.branch, c.disaggregate, c.decode) == ("no_prefill", False, None)


@pytest.mark.parametrize("room,rank,dp", [(0, 0, 1), (17, 1, 2), (17, 0, 2), (2**62 - 1, 3, 4), (5, 2, 3)])
def test_room_for_rank_lands_on_the_rank(room, rank, dp):
    r = room_for_rank(room, rank, dp)
    assert r % dp == rank and 0 <= r < 2**63 and abs(r - room) < dp
