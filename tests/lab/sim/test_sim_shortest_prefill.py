"""SGLang 0.5.21+'s `--schedule-policy shortest-prefill-first` in the simulated scheduler, step by step on one rank:
the waiting queue by uncached work, requests that share an uncached prefix with an earlier one behind the rest, the
running chunk capped so that shorter waiting prefills share its forward, one chunked request at a time, and the
start-up checks SGLang makes (not with priority scheduling, not before 0.5.21, not without a radix cache)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from gateway.cli import main
from gateway.recording.trace import TraceRecord, write_trace
from gateway_lab.sim.cli import add_arguments, config_from_args
from gateway_lab.sim.engine import Rank
from gateway_lab.sim.profiles import for_version, profile
from gateway_lab.sim.sim_request import EventKind, SimRequest

SPF = "shortest-prefill-first"


def rank(**over) -> Rank:
    return Rank(profile("mi355x-glm52-tp4", **over))


def req(r: Rank, rid: str, n: int, t: float, base: int | None = None, firsts: list[str] | None = None) -> SimRequest:
    """n prompt tokens; requests with the same `base` share their tokens (and so their pages) up to the shorter one."""
    tokens = np.arange(n, dtype=np.uint32) + (base if base is not None else sum(map(ord, rid)) * 1_000_000)

    def sink(ev) -> None:
        if ev.kind is EventKind.FIRST and firsts is not None:
            firsts.append(rid)

    q = SimRequest(rid, r.cache.page_keys(tokens), n, 8, "length", t, sink)
    r.submit(q)
    return q


def step(r: Rank, now: float) -> list[tuple[str, int]]:
    s = r.plan(now)
    assert s is not None and s.kind == "prefill"
    r.complete(s, now + s.duration)
    return [(q.rid, n) for q, n in s.picks]


@pytest.mark.parametrize("policy", ["fcfs", SPF])
def test_the_running_chunk_makes_room_for_a_shorter_prefill(policy: str) -> None:
    """A 100k-token prompt is being prefilled 16k at a time when a 1,000-token one arrives. In arrival order the short
    one waits for the whole long prefill; shortest-prefill-first caps the long chunk at the budget minus the short
    one's pages (16,384 - 1,024), so its first token comes out of the very next forward."""
    r = rank(schedule_policy=policy)
    firsts: list[str] = []
    req(r, "long", 100_000, 0.0, firsts=firsts)
    assert step(r, 0.0) == [("long", 16_384)]
    req(r, "short", 1_000, 0.5, firsts=firsts)
    picks = step(r, 1.0)
    if policy == SPF:
        assert picks == [("long", 15_360), ("short", 1_000)] and firsts == ["short"]
    else:
        assert picks == [("long", 16_384)] and firsts == []
        t = 2.0
        while not firsts:
            step(r, t)
            t += 1.0
        assert firsts == ["long", "short"]


def test_waiting_order_is_uncached_work_then_arrival_with_duplicate_prefixes_last() -> None:
    """Fresh requests go shortest first; one whose prefix is cached counts only what it must compute; one that shares
    its uncached first page with a request ahead of it waits behind the rest (SGLang's in-batch prefix dedup)."""
    r = rank(schedule_policy=SPF)
    req(r, "warm-prefix", 8_000, 0.0, base=7)
    step(r, 0.0)
    req(r, "a-5000", 5_000, 1.0)
    req(r, "b-2000", 2_000, 2.0, base=11)
    req(r, "c-3000-shares-b", 3_000, 3.0, base=11)
    req(r, "warm-9000", 9_000, 4.0, base=7)  # 8,000 cached: 1,000 to compute
    assert [q for q, _ in step(r, 5.0)] == ["warm-9000", "b-2000", "a-5000", "c-3000-shares-b"]


def test_only_one_request_is_chunked_at_a_time() -> None:
    """While the capped request is still chunked, a waiting request too long for what is left of the budget is not
    split into a second chunked request: it waits for the next forward."""
    r = rank(schedule_policy=SPF)
    req(r, "long", 100_000, 0.0)
    step(r, 0.0)
    req(r, "short", 1_000, 1.0)
    req(r, "medium", 30_000, 1.1)
    assert step(r, 2.0) == [("long", 15_360), ("short", 1_000)]
    assert sum(q.started for q in r.waiting) == 1


def test_warm_requests_are_never_deferred_as_duplicates() -> None:
    """The dedup only looks at requests with nothing cached: two turns whose shared first page is cached both keep
    their place by work, ahead of a longer fresh prompt."""
    r = rank(schedule_policy=SPF)
    req(r, "ctx", 4_000, 0.0, base=5)
    step(r, 0.0)
    req(r, "fresh-3000", 3_000, 1.0)
    req(r, "turn-a", 6_000, 2.0, base=5)  # 2,000 to compute
    req(r, "turn-b", 5_000, 3.0, base=5)  # 1,000 to compute
    assert [q for q, _ in step(r, 4.0)] == ["turn-b", "turn-a", "fresh-3000"]


@pytest.mark.parametrize("budget, waiting, cap", [
    (4096, [257], 4096 - 320),  # one waiter: its pages (5 x 64) come off the chunk
    (4096, [3_840], 4096 - 3_840),
    (4096, [4_032], 64),  # the most that still leaves the chunk a page
    (4096, [4_033], None),  # a page more would leave the chunk nothing: no cap
    (4096, [20_000], None),  # not shorter than what the chunk still needs: no cap
    (100, [10], None),  # a budget under two pages is never capped
    (4096, [500, 600, 30_000], 4096 - 512 - 640),  # stops at the first that is not shorter
])
def test_chunk_cap_boundaries(budget: int, waiting: list[int], cap: int | None) -> None:
    """SGLang's shortest_prefill_chunk_limit, at page 64: reserve whole pages for the waiting requests, in order,
    that need less than the chunked request still does, keeping at least one page for it."""
    r = rank(schedule_policy=SPF, chunked_prefill_size=budget, max_prefill_tokens=budget)
    req(r, "long", 100_000, 0.0)
    r.waiting[0].started, r.waiting[0].prefilled = True, 10_000
    for i, n in enumerate(waiting):
        req(r, f"w{i}", n, 1.0 + i)
    assert r._shortest_prefill_pass(2.0, budget) == cap


@pytest.mark.parametrize("over, says", [
    ({"enable_priority_scheduling": True}, "schedule_policy must be 'fcfs' or 'lof'"),
    ({"disable_radix_cache": True}, "requires prefix caching"),
    ({"schedule_policy": "lpm"}, "the simulator models"),
])
def test_start_up_refusals_as_sglang_makes_them(over: dict, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        profile("mi355x-glm52-tp4", **{"schedule_policy": SPF, **over}).check_schedule()


def test_shortest_prefill_first_needs_0_5_21() -> None:
    with pytest.raises(ValueError, match=r"added in 0\.5\.21"):
        for_version(profile("mi355x-glm52-tp4", schedule_policy=SPF), "0.5.13").check_schedule()
    profile("mi355x-glm52-tp4", schedule_policy=SPF).check_schedule()  # 0.5.23, radix cache, no priority: fine


def test_gateway_sim_refuses_the_combination_sglang_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args(["--schedule-policy", SPF])).schedule_policy == SPF
    for argv, says in ((["--schedule-policy", SPF, "--enable-priority-scheduling"], "must be 'fcfs' or 'lof'"),
                       (["--schedule-policy", SPF, "--sglang-version", "0.5.9"], "added in 0.5.21")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            config_from_args(p.parse_args(argv))


def test_replay_schedule_reaches_the_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`gateway replay --schedule`: two long cold prompts occupy both ranks of one node, four short ones arrive
    while they prefill. In arrival order the short ones wait for a long prefill; with shortest-prefill-first they
    share its next forward, so the median TTFT (a short request) falls several-fold."""
    recs = [TraceRecord(0, 100_000, 4, tuple(range(i * 1000, i * 1000 + 196))) for i in (1, 2)]
    recs += [TraceRecord(300 + 10 * i, 600, 4, (90_000 + i * 10, 90_001 + i * 10)) for i in range(4)]
    p = tmp_path / "t.jsonl"
    with p.open("w") as f:
        write_trace(recs, f)
    p50 = {}
    for schedule in ("priority", SPF):
        out = tmp_path / f"{schedule}.json"
        assert main(["replay", str(p), "--nodes", "1", "--no-progress", "--schedule", schedule,
                     "--json", str(out)]) == 0
        p50[schedule] = json.loads(out.read_text())["results"][0]["ttft_p50"]
    assert f"engines {SPF}" in capsys.readouterr().out
    assert p50[SPF] * 3 < p50["priority"], p50
    assert main(["replay", str(p), "--http", "http://127.0.0.1:9", "--schedule", SPF]) == 2
    assert "with --http the endpoint's own engines decide" in capsys.readouterr().err


def test_a_capped_chunk_that_finishes_lets_the_next_request_be_split() -> None:
    """The one-chunked-request rule holds only while the capped request stays chunked: when its last piece fits
    under the cap, a waiting request too long for the rest of the budget is split as usual (scheduler.py resets
    chunked_req once add_chunked_req does not truncate)."""
    r = rank(schedule_policy=SPF)
    req(r, "long", 16_384 + 3_000, 0.0)
    step(r, 0.0)
    req(r, "short", 500, 1.0)
    req(r, "big", 20_000, 1.1)
    picks = step(r, 2.0)
    assert picks[:2] == [("long", 3_000), ("short", 500)] and picks[2][0] == "big" and picks[2][1] > 10_000
