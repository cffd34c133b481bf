"""loadtests/trace_table.py: the LRU bound per request, the speed rule and the Wafer workload as a trace."""

import pytest

from gateway.recording.trace import BLOCK_TOKENS, TraceRecord
from gateway_lab.replay.bounds import ideal_hit_rate, lru_hit_rate, lru_hits
from gateway_lab.replay.run import nodes_targets
from loadtests.trace_table import peak_busy, speed_for, wafer_trace, work_seconds


def rec(t_s: float, ids: tuple[int, ...], n: int | None = None) -> TraceRecord:
    return TraceRecord(t_s * 1000, n if n is not None else len(ids) * BLOCK_TOKENS, 100, ids)


def test_lru_hits_are_the_bound_per_request():
    """The second request repeats the first's three blocks: all three hit; the third shares one block with them but
    with a cache of 3 blocks the fourth request's new blocks evicted it first (deepest first is evicted last)."""
    trace = [rec(0, (1, 2, 3)), rec(1, (1, 2, 3)), rec(2, (1, 4, 5)), rec(3, (1, 2, 3))]
    assert lru_hits(trace, 100 * BLOCK_TOKENS) == [0, 3 * BLOCK_TOKENS, BLOCK_TOKENS, 3 * BLOCK_TOKENS]
    small = lru_hits(trace, 3 * BLOCK_TOKENS)
    assert small[:3] == [0, 3 * BLOCK_TOKENS, BLOCK_TOKENS] and small[3] < 3 * BLOCK_TOKENS
    total = sum(r.input_length for r in trace)
    assert lru_hit_rate(trace, 3 * BLOCK_TOKENS) == pytest.approx(sum(small) / total)


def test_work_counts_only_what_the_bound_leaves_uncached():
    cfg = nodes_targets(1)[0][1]
    r = rec(0, tuple(range(40)))
    cold, warm = work_seconds(r, 0, cfg), work_seconds(r, 32 * BLOCK_TOKENS, cfg)
    assert cold > warm > 0
    assert work_seconds(r, r.input_length, cfg) < warm  # decode only


def test_the_speed_puts_the_busiest_window_at_the_load():
    """A steady stream: at the rule's speed the busiest window's work over the fleet's rank-seconds is the load; a
    fleet twice as large is given about twice the speed; the same work squeezed into the first half of the span (a
    front-loaded trace) gets about half the speed."""
    steady = [rec(i * 1.0, tuple(range(i * 40, i * 40 + 40))) for i in range(3000)]
    two, four = nodes_targets(2), nodes_targets(4)
    s2, s4 = speed_for(steady, two, 0.6), speed_for(steady, four, 0.6)
    cfg = two[0][1]
    work = [work_seconds(r, h, cfg) for r, h in zip(steady, lru_hits(steady, 4 * cfg.max_total_num_tokens))]
    ts = [r.timestamp_ms / 1000 for r in steady]
    assert s2 * peak_busy(ts, work, min(300 * s2, ts[-1]), len(two)) == pytest.approx(0.6, abs=0.02)
    assert s4 / s2 == pytest.approx(2.0, rel=0.1)
    front = [rec(i * 0.5, r.hash_ids) for i, r in enumerate(steady)] + [rec(2999.0, (999_999,))]
    assert speed_for(front, two, 0.6) / s2 == pytest.approx(0.5, rel=0.15)


def test_wafer_as_a_trace_shares_each_group_prefix_full_blocks():
    trace = wafer_trace(4, 200, seed=1)
    assert all(r.input_length == 20_000 and len(r.hash_ids) == 40 for r in trace)
    by_group: dict[tuple[int, ...], list[TraceRecord]] = {}
    for r in trace:
        by_group.setdefault(r.hash_ids[:23], []).append(r)
    assert len(by_group) == 4  # 12,000 tokens: 23 full blocks per group, then new ones
    assert len({r.hash_ids[23] for r in trace}) == len(trace)
    # first request of each group is cold, the rest hit the 23 shared blocks
    assert ideal_hit_rate(trace) == pytest.approx((len(trace) - 4) * 23 * BLOCK_TOKENS / (20_000 * len(trace)))
