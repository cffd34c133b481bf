"""The simulated scheduler's priority rules, step by step on one rank (no clock): SGLang's order (priority, then
arrival; higher first unless low-values-first) and preemption only past the threshold."""

import numpy as np

from gateway_lab.sim.engine import Rank
from gateway_lab.sim.profiles import profile
from gateway_lab.sim.sim_request import SimRequest


def rank(**over):
    return Rank(profile("mi355x-glm52-tp4", max_running_requests=1, **over))


def req(r: Rank, rid: str, prio: int, t: float, out: int = 50) -> SimRequest:
    tokens = np.arange(100, dtype=np.uint32) + sum(map(ord, rid))
    q = SimRequest(rid, r.cache.page_keys(tokens, rid), len(tokens), out, "length", t, lambda ev: None, priority=prio)
    r.submit(q)
    return q


def run_prefill(r: Rank, now: float) -> list[str]:
    step = r.plan(now)
    assert step is not None and step.kind == "prefill"
    r.complete(step, now + step.duration)
    return [q.rid for q, _ in step.picks]


def test_priority_order_then_arrival_and_preemption_past_the_threshold():
    r = rank(enable_priority_scheduling=True)
    req(r, "running-low", -10, 0.0)
    assert run_prefill(r, 0.0) == ["running-low"]
    req(r, "normal", 0, 1.0)
    req(r, "high", 10, 2.0)
    req(r, "high-later", 10, 3.0)
    assert [q.rid for q in r.waiting] == ["high", "high-later", "normal"]
    # high beats the running low by 20 > 10: it is retracted, and re-queued behind normal (0 > -10)
    assert run_prefill(r, 4.0) == ["high"]
    assert [q.rid for q in r.running] == ["high"]
    assert [q.rid for q in r.waiting] == ["high-later", "normal", "running-low"]
    assert r.waiting[-1].preempted == 1 and r.waiting[-1].reserved == 0
    # high-later ties with the running high: no preemption, it waits
    assert r.plan(5.0).kind == "decode"


def test_threshold_is_strict_and_preemption_can_be_disabled():
    for over, preempts in (({}, False), ({"priority_scheduling_preemption_threshold": 9}, True),
                           ({"priority_scheduling_preemption_threshold": 9, "disable_priority_preemption": True}, False)):
        r = rank(enable_priority_scheduling=True, **over)
        req(r, "running", -10, 0.0)
        run_prefill(r, 0.0)
        req(r, "normal", 0, 1.0)  # beats it by exactly 10
        step = r.plan(2.0)
        assert (step.kind == "prefill") is preempts, over


def test_low_values_first_and_fcfs_without_priority_scheduling():
    r = rank(enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    req(r, "busy", 0, 0.0)
    run_prefill(r, 0.0)
    for i, p in enumerate((5, -5, 0)):
        req(r, f"p{p}", p, 1.0 + i)
    assert [q.rid for q in r.waiting] == ["p-5", "p0", "p5"]
    fcfs = rank()
    for i, p in enumerate((5, -5, 0)):
        req(fcfs, f"p{p}", p, 1.0 + i)
    assert [q.rid for q in fcfs.waiting] == ["p5", "p-5", "p0"]
