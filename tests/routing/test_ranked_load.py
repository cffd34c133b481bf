"""The queued prefill per engine priority: on a replica that prefills its waiting queue by priority, what is ahead of
a request is its rank and above, plus at most one lower request already under way — not the whole queue. Pure
functions on fixed inputs, the engine's effects through both trackers, and the Redis layout two gateways (and an
older one) share."""

import asyncio
import time
from dataclasses import replace

import pytest
import redis.asyncio as aioredis

from gateway.config import GpuHourPricing, PoolTiming
from gateway.dispatch.feedback import apply_effects
from gateway.prediction.ttft import LoadView, TtftCorrector, ahead_of, predict_ttft
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.routing.engine import Attempt, RoutingEngine, merged_load
from gateway.routing.features import TargetInfo
from gateway.routing.load import MemoryLoadTracker, RedisLoadTracker, Reservations
from gateway.routing.policies import prefix_sla_cost
from gateway.routing.policy import PolicyContext
from gateway.routing.request import RoutingRequest

GPU = GpuHourPricing(gpus_per_replica=4, usd_per_gpu_hour=2.1, prefill_tokens_per_s=16_700, decode_tokens_per_s=3_600)
T = PoolTiming()


def sq(*tokens: float) -> float:
    return sum(t * t for t in tokens)


def test_ahead_of_counts_its_rank_and_above_and_one_lower_request():
    # 16,000 unranked, 4,000 at 12, two of 20,000 at 3
    load = LoadView(60_000, 6, ((12, 4_000, sq(4_000)), (3, 40_000, sq(20_000, 20_000))))
    assert ahead_of(load, None) is load  # arrival order: all of it
    assert ahead_of(load, 12).queued_prefill_tokens == 16_000 + 4_000 + 20_000  # one rank-3 prompt may be under way
    # above both ranks: one lower request under way, as long as the time the replica spends on them says on average
    assert ahead_of(load, 13).queued_prefill_tokens == pytest.approx(16_000 + sq(4_000, 20_000, 20_000) / 44_000)
    assert ahead_of(load, 3).queued_prefill_tokens == 60_000  # the lowest rank waits for everything
    assert ahead_of(load, 2).queued_prefill_tokens == 60_000
    assert ahead_of(load, 12).inflight == 6


def test_a_long_prompt_among_short_ones_is_the_one_likely_under_way():
    """Twenty 500-token turns and one 60k-token cold prompt at a lower rank: the replica is most likely in the long
    prompt's prefill (it takes 6x the time of all twenty), so nearly all of it counts — not their mean (3,300)."""
    load = LoadView(70_000, 21, ((2, 70_000, sq(*[500] * 20, 60_000)),))
    head = ahead_of(load, 9).queued_prefill_tokens
    assert head == pytest.approx(sq(*[500] * 20, 60_000) / 70_000) and 50_000 < head < 60_000


def test_ahead_of_scales_parts_that_sum_past_the_queue():
    """A queue estimated smaller than its ranked parts (the drain estimate): each part shrinks alike."""
    load = LoadView(10_000, 2, ((9, 10_000, sq(10_000)), (0, 10_000, sq(10_000))))
    assert ahead_of(load, 9).queued_prefill_tokens == pytest.approx(0.5 * (10_000 + 10_000))
    assert ahead_of(load, 10).queued_prefill_tokens == pytest.approx(0.5 * 10_000)


def test_an_engine_gauge_above_the_tracked_queue_is_ranked_as_the_tracked_one():
    merged = merged_load(LoadView(10_000, 2, ((9, 2_000, sq(2_000)), (0, 8_000, sq(8_000)))), LoadView(20_000, 3))
    assert merged.queued_prefill_tokens == 20_000 and merged.inflight == 3
    assert merged.ranked == ((9, 4_000, 2 * sq(2_000)), (0, 16_000, 2 * sq(8_000)))  # twice as many of those sizes
    low = merged_load(LoadView(10_000, 2, ((9, 2_000, sq(2_000)),)), LoadView(5_000, 1))
    assert low == LoadView(10_000, 2, ((9, 2_000, sq(2_000)),))


def engine() -> RoutingEngine:
    return RoutingEngine(prefix_sla_cost.PrefixSlaCost(prefix_sla_cost.Params(), PolicyContext(chunk_tokens=256)),
                         uses_prefix=True, chunk_tokens=256, corrector=TtftCorrector(), speculative_ttl_s=10,
                         residency_ttl_s=600, shortest_prefill_first=True)


def info(name: str, ranked: bool) -> TargetInfo[None]:
    return TargetInfo(name, f"{name}@0", "mi355x", T, GPU, None, ranked=ranked)


def turn(prompt: int, rid: str = "x", priority: int = 0) -> RoutingRequest:
    return RoutingRequest(rid, "t", "glm", "chat/completions", True, prompt, 64, tuple(range(1, prompt // 256 + 1)),
                          2.22, group_key=1, priority=priority)


@pytest.mark.parametrize("ranked", [True, False])
def test_a_cached_turn_behind_long_cold_prompts_keeps_its_replica_where_they_queue_behind_it(ranked):
    """A 20k-token conversation turn with all but 544 tokens cached on r0, where three cold 12k-token prompts wait
    (sent at their prefill level, 3). Where r0 prefills by priority the turn (level 7) goes after at most the one under
    way: predicted within its SLA, it stays (prefix_hit). In arrival order it would wait for all three (~2.3 s): past
    its SLA, kept there only as the policy's trade of a late turn against recomputing its context (`warm_over_sla`;
    flow control would hold it for room)."""
    eng = engine()
    cold = ((3, 36_000, sq(12_000, 12_000, 12_000)),) if ranked else ()
    loads = {"r0": LoadView(36_000, 3, cold), "r1": LoadView()}
    req = turn(20_000)
    cached = {"r0@0": len(req.hashes) - 2}
    d = eng.decide(req, [info("r0", ranked), info("r1", ranked)], cached, loads)
    r0 = d.features["r0"]
    if ranked:
        assert r0.rank == 7  # 544 uncached tokens: prefill level 7 (normal class 0)
        assert r0.ttft_raw == pytest.approx(predict_ttft(T, LoadView(12_000, 3), r0.uncached_tokens))
        assert d.chosen.name == "r0" and d.branch == "prefix_hit"
    else:
        assert r0.rank is None
        assert r0.ttft_raw == pytest.approx(predict_ttft(T, LoadView(36_000, 3), r0.uncached_tokens))
        assert r0.ttft > req.ttft_sla_s and d.branch == "warm_over_sla"


def test_flow_control_boost_puts_a_request_ahead_in_the_prediction():
    """Two cold prompts of the same length: the one sent 10 higher (a flow under its share) has only the prompt under
    way ahead of it; the other, the whole queue."""
    eng = engine()
    loads = {"r0": LoadView(48_000, 4, ((4, 48_000, sq(12_000, 12_000, 12_000, 12_000)),))}
    plain = eng.decide(turn(12_000), [info("r0", True)], {}, loads).features["r0"]
    boosted = eng.decide(turn(12_000, priority=10), [info("r0", True)], {}, loads).features["r0"]
    assert (plain.rank, boosted.rank) == (3, 13)  # 12k uncached tokens: prefill level 3
    assert plain.ttft_raw == pytest.approx(predict_ttft(T, LoadView(48_000, 4), 12_000))
    assert boosted.ttft_raw == pytest.approx(predict_ttft(T, LoadView(12_000, 4), 12_000))


def dispatch(eng: RoutingEngine, req: RoutingRequest, loads: MemoryLoadTracker | RedisLoadTracker,
             index: MemoryPrefixIndex) -> Attempt:
    d = eng.decide(req, [info("r0", True)], {}, {"r0": LoadView()})
    a = Attempt(req, d.chosen, d)
    apply_effects(eng.dispatched(a), index, loads)
    return a


def test_the_engines_effects_keep_each_rank_in_the_memory_view():
    eng, loads, index = engine(), MemoryLoadTracker(), MemoryPrefixIndex()
    short = dispatch(eng, turn(300, "a"), loads, index)
    long = dispatch(eng, turn(20_000, "b"), loads, index)
    assert (short.rank, long.rank) == (8, 2)
    assert loads.view("r0") == LoadView(20_300, 2, ((8, 300, sq(300)), (2, 20_000, sq(20_000))))
    apply_effects(eng.first_token(short, 0.2), index, loads)
    assert loads.view("r0") == LoadView(20_000, 2, ((2, 20_000, sq(20_000)),))
    apply_effects(eng.finished(long, failed=True), index, loads)  # ended before its first token
    apply_effects(eng.finished(short), index, loads)
    assert loads.view("r0") == LoadView()


def test_a_reservation_is_ranked_as_its_decision():
    r = Reservations()
    r.reserve("a", "r0", 12_000, 4)
    r.reserve("b", "r0", 500, None)
    assert r.overlay({"r0": LoadView(1_000, 1, ((9, 1_000, sq(1_000)),))})["r0"] == \
        LoadView(13_500, 3, ((9, 1_000, sq(1_000)), (4, 12_000, sq(12_000))))


def test_ranked_parts_reach_the_other_instance_and_an_older_reader_skips_them(redis_server):
    async def go():
        prefix = f"lr{time.monotonic_ns()}:"
        c1, c2 = aioredis.from_url(redis_server.url), aioredis.from_url(redis_server.url)
        a = RedisLoadTracker(c1, prefix=prefix, snapshot_ttl=0.0)
        b = RedisLoadTracker(c2, prefix=prefix, snapshot_ttl=0.0)
        await c1.zadd(f"{prefix}gateways", {a.id: time.time()})
        eng, index = engine(), MemoryPrefixIndex()
        short = dispatch(eng, turn(300, "a"), a, index)
        dispatch(eng, turn(20_000, "b"), a, index)
        await a.settle()
        want = LoadView(20_300, 2, ((8, 300, sq(300)), (2, 20_000, sq(20_000))))
        assert (await b.snapshot(["r0"]))["r0"] == want
        apply_effects(eng.first_token(short, 0.2), index, a)
        await a.settle()
        assert (await b.snapshot(["r0"]))["r0"] == LoadView(20_000, 2, ((2, 20_000, sq(20_000)),))
        # a gateway of the previous layout sums `<id>:p` and `<id>:n` of live ids, and the rest as requests
        fields = await c2.hgetall(f"{prefix}load:r0")
        old_p = old_n = 0.0
        for k, v in fields.items():
            gid, _, kind = k.decode().rpartition(":")
            if gid == a.id:
                if kind == "p":
                    old_p += float(v)
                else:
                    old_n += float(v)
        assert (old_p, old_n) == (20_000, 2)
        # the heartbeat's absolute publish writes the same fields
        await a._publish_all()
        assert (await b.snapshot(["r0"]))["r0"] == LoadView(20_000, 2, ((2, 20_000, sq(20_000)),))
        await c1.aclose()
        await c2.aclose()

    asyncio.run(go())


def test_a_dead_gateways_ranked_parts_are_not_counted(redis_server):
    async def go():
        prefix = f"ld{time.monotonic_ns()}:"
        c1, c2 = aioredis.from_url(redis_server.url), aioredis.from_url(redis_server.url)
        a = RedisLoadTracker(c1, prefix=prefix, snapshot_ttl=0.0)
        b = RedisLoadTracker(c2, prefix=prefix, snapshot_ttl=0.0, dead_after=3.0)
        await c1.zadd(f"{prefix}gateways", {a.id: time.time() - 60})  # its last heartbeat a minute ago
        dispatch(engine(), turn(20_000, "b"), a, MemoryPrefixIndex())
        await a.settle()
        assert (await b.snapshot(["r0"]))["r0"] == LoadView()
        await c1.aclose()
        await c2.aclose()

    asyncio.run(go())


def test_rank_is_none_on_targets_that_keep_arrival_order():
    eng = engine()
    d = eng.decide(replace(turn(300), priority=10), [info("r0", False)], {}, {"r0": LoadView()})
    assert d.features["r0"].rank is None
