"""Preemption, the queue's lookahead and the gate's reading of a decision, on a fixed clock (pure: no I/O), and
preemption on the virtual-clock fleet: a higher band's request takes a replica from a lower band's prefill, and the
request it cancelled is queued again and served, not lost."""

from __future__ import annotations

from gateway.config import PoolTiming, Routing
from gateway.flow.controller import FlowController, Ticket
from gateway.flow.gate import Pass, within
from gateway.flow.preempt import choose
from gateway.flow.settings import FlowControl, FlowPolicy
from gateway.prediction.ttft import LoadView
from gateway.recording.trace import TraceRecord
from gateway.routing.decision import Decision, Inputs
from gateway.routing.features import Candidate, TargetInfo
from gateway.routing.request import RoutingRequest
from gateway_lab.replay.mix import Part, mix, run_mix, tenant_name
from gateway_lab.replay.run import nodes_targets

CRITICAL, STANDARD, SHEDDABLE = 0, 1, 2


def ctl(**kw: object) -> FlowController:
    return FlowController(FlowControl.model_validate({"enabled": True, **kw}))


def tk(c: FlowController, tenant: str, now: float = 0.0, band: int = STANDARD, prompt: int = 1000,
       key: str = "") -> Ticket:
    return c.ticket(key or f"{tenant}-{now}", tenant, band, 1.0, prompt, 0, now, 2.0)


def sent(c: FlowController, t: Ticket, target: str, uncached: int, now: float = 0.0) -> Ticket:
    c.offer(t, now)
    c.grant(t, now)
    c.sent(t, target, uncached)
    return t


def test_a_request_passed_over_does_not_hold_the_queue_behind_it():
    """A head the fleet has no room for (its one warm replica is busy) is skipped for this pass: the next request in
    the same fair order is offered, its own tenant's next included, and the skipped one keeps its place."""
    c = ctl()
    a1, a2, b1 = tk(c, "a", 0.0, key="a1"), tk(c, "a", 0.1, key="a2"), tk(c, "b", 0.2, key="b1")
    for t in (a1, a2, b1):
        c.offer(t, t.arrived)
    first = c.head(1.0)
    assert first is not None
    second = c.head(1.0, {first})
    assert second is not None and second is not first
    third = c.head(1.0, {first, second})
    assert {first, second, third} == {a1, a2, b1}
    assert c.head(1.0, {a1, a2, b1}) is None
    assert c.head(1.0) is first  # nothing was removed


def test_a_flow_under_its_share_is_told_apart_from_a_backlogged_one():
    """A tenant that has used less than its share (it was idle while another was served) is behind the band's
    virtual time; the backlogged tenant, just served, is not."""
    c = ctl(burst_credit=10_000)
    for i in range(5):
        t = tk(c, "flood", i * 0.01, key=f"f{i}")
        c.offer(t, t.arrived)
        c.grant(t, t.arrived)
    flood, quiet = tk(c, "flood", 1.0, key="f9"), tk(c, "quiet", 1.0, key="q")
    assert not c.under_share(flood)
    assert c.under_share(quiet)


def cand(name: str, ttft: float) -> Candidate[None]:
    return Candidate(TargetInfo(name, f"{name}@0", "p", PoolTiming(), None, None), 0, 0, 1000, LoadView(), ttft, ttft,
                     0.0)


def test_the_gate_goes_on_the_policys_next_choice_within_the_bound():
    """The policy may rank first a warm replica past the bound (it trades this request's wait for the fleet's
    recompute); a held request then goes on the first target of the policy's own ranking within the bound, and the
    decision says so; with none within, it waits."""
    req = RoutingRequest("r", "t", "m", "chat/completions", True, 1000, 10)
    warm, cold, slow = cand("warm", 6.0), cand("cold", 1.5), cand("slow", 4.0)
    d = Decision.of([warm, slow, cold], "warm_over_sla", Inputs.of(req))
    go = within(d, 2.0)
    assert go is not None and go.chosen is cold and go.branch == "flow_bound"
    assert [c.name for c in go.ranked] == ["cold", "warm", "slow"]
    assert within(d, 7.0) is d
    assert within(d, 1.0) is None


def test_preemption_takes_the_replica_where_least_stays_ahead_and_only_from_lower_bands():
    """A critical request may cancel standard and sheddable requests without a first byte, never its own band's;
    it picks the replica where the least prefill stays ahead once they are cancelled, and only when that is within
    what it can still wait."""
    c = ctl()
    rate = {"r0": 10_000.0, "r1": 10_000.0}
    sent(c, tk(c, "crit-other", 0.0, CRITICAL, key="c0"), "r0", 5_000)
    sent(c, tk(c, "shed", 0.0, SHEDDABLE, key="s0"), "r0", 30_000)
    s1 = sent(c, tk(c, "shed", 0.0, SHEDDABLE, key="s1"), "r1", 30_000)
    d1 = sent(c, tk(c, "std", 0.0, STANDARD, key="d1"), "r1", 20_000)
    head = tk(c, "crit", 1.0, CRITICAL, key="head")
    p = choose(head, c.inflight(), rate, allowance_s=1.0)
    assert p is not None and p.target == "r1" and set(p.victims) == {s1, d1} and p.ahead_after_s == 0.0
    std = choose(tk(c, "std2", 1.0, STANDARD), c.inflight(), rate, 1.0)  # on r1 the standard request stays ahead
    assert std is not None and std.target == "r0" and [v.key for v in std.victims] == ["s0"]
    c.first_byte(s1)
    c.first_byte(d1)  # first bytes sent: not preemptible any more; r0 keeps 0.5 s of critical prefill ahead
    assert choose(head, c.inflight(), rate, allowance_s=0.4) is None
    p = choose(head, c.inflight(), rate, allowance_s=1.0)
    assert p is not None and p.target == "r0" and p.ahead_after_s == 0.5


def test_a_preempted_request_is_queued_again_in_its_place_not_charged_twice_and_never_refused_for_room():
    """Preempted: back in its tenant's queue before later arrivals, with a new queue timeout, past the tenant's queue
    bound (it was admitted once), and its second grant does not charge its flow again. It is preempted once at most."""
    c = ctl(max_queued_per_tenant=1, queue_timeout_s=5.0)
    first = sent(c, tk(c, "shed", 0.0, SHEDDABLE, key="first"), "r0", 30_000)
    charged = c.tags.finish[(SHEDDABLE, "shed")]
    later = tk(c, "shed", 1.0, SHEDDABLE, key="later")
    assert c.offer(later, 1.0) == []  # the tenant's one queued request
    c.requeue(first, 3.0)
    assert first.state == "queued" and first.preempted == 1 and c.depth("shed") == 2
    assert all(r.ticket is not first for r in c.expire(6.0))  # its first timeout (at 5 s) no longer applies
    assert c.head(6.0) is first
    c.grant(first, 6.0)
    assert c.tags.finish[(SHEDDABLE, "shed")] == charged
    c.sent(first, "r0", 10_000)
    head = tk(c, "crit", 6.0, CRITICAL)
    assert choose(head, c.inflight(), {"r0": 10_000.0}, 10.0) is None  # once at most


def test_a_preempted_requests_new_timeout_runs_from_its_requeue():
    c = ctl(queue_timeout_s=5.0)
    t = sent(c, tk(c, "shed", 0.0, SHEDDABLE, key="t"), "r0", 30_000)
    c.requeue(t, 4.0)
    assert c.expire(8.9) == []
    assert [(r.ticket.key, r.reason) for r in c.expire(9.0)] == [("t", "queue_timeout")]


def rec(ms: float, n: int, first: int) -> TraceRecord:
    return TraceRecord(ms, n, 20, tuple(range(first, first + -(-n // 512))))


def test_on_the_virtual_clock_a_critical_request_preempts_a_sheddable_prefill_and_nothing_is_lost():
    """One replica busy with a sheddable tenant's 60k-token prompts (~4 s of prefill each); a critical request
    arrives mid-prefill. Without preemption it waits for the prefill and misses its SLA; with it, the sheddable
    request is cancelled before its first token, the critical one meets its SLA, and the cancelled one is queued
    again and served (or refused with a reason): none lost."""
    shed = [rec(i * 100.0, 60_000, 1000 * i) for i in range(3)]
    crit = [rec(500.0, 1_000, 0)]
    trace = mix([Part(shed, 1), Part(crit, 2)])
    pol = {tenant_name(1): FlowPolicy(band="sheddable"), tenant_name(2): FlowPolicy(band="critical")}
    dem = {t: 1.0 for t in pol}
    fc = FlowControl(enabled=True, queue_timeout_s=60.0)
    runs = {p: run_mix(trace, nodes_targets(1)[:1], Routing(), fc, pol, {}, "t", 30.0, dem, preempt=p)
            for p in (False, True)}
    sla = Routing().ttft_sla_ms / 1000
    rows = {p: {t.tenant: t for t in r.tenants} for p, r in runs.items()}
    assert rows[False][tenant_name(2)].within_sla == 0.0  # waited behind the sheddable prefill
    assert rows[True][tenant_name(2)].within_sla == 1.0 and rows[True][tenant_name(2)].ttft_p95 <= sla
    assert rows[True][tenant_name(1)].preempted >= 1
    assert runs[True].lost == 0 and sum(t.requests for t in runs[True].tenants) == len(trace)
    served_or_refused = rows[True][tenant_name(1)]
    assert served_or_refused.requests == 3


def test_a_request_passed_over_keeps_the_target_it_waits_for():
    """Passing over a request whose decision wants a busy warm replica lets the next request go elsewhere, never
    onto that replica: it would take the room the request passed over is waiting for."""
    req = RoutingRequest("r", "t", "m", "chat/completions", True, 1000, 10)
    c = ctl()
    waiting = tk(c, "a", 0.0, key="waiting")
    p = Pass(lookahead=2)
    assert p.passed(waiting, Decision.of([cand("warm", 6.0), cand("cold", 3.0)], "warm_over_sla", Inputs.of(req)))
    on_warm = Decision.of([cand("warm", 1.0)], "prefix_hit", Inputs.of(req))
    on_cold = Decision.of([cand("cold", 1.0)], "cold_ring", Inputs.of(req))
    assert p.free(on_warm, waiting) is None and p.free(on_cold, waiting) is on_cold
    assert not p.passed(tk(c, "b", 0.0, key="b"), on_cold)  # two passed over: the pass ends
