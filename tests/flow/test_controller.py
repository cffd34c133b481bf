"""The flow controller's core on a fixed clock: order of service, weighted shares, bounded queues, timeouts."""

from __future__ import annotations

from gateway.flow.controller import FairTags, FlowController, Ticket
from gateway.flow.settings import FlowControl

CRITICAL, STANDARD, SHEDDABLE = 0, 1, 2


def ctl(**kw: object) -> FlowController:
    return FlowController(FlowControl.model_validate({"enabled": True, **kw}))


def tk(c: FlowController, tenant: str, now: float = 0.0, band: int = STANDARD, weight: float = 1.0,
       prompt: int = 1000, sla: float = 2.0, key: str = "") -> Ticket:
    return c.ticket(key or f"{tenant}-{now}", tenant, band, weight, prompt, 0, now, sla)


def drain(c: FlowController, n: int | None = None, now: float = 1.0) -> list[Ticket]:
    out = []
    while len(c) and (n is None or len(out) < n):
        t = c.head(now)
        assert t is not None
        c.grant(t, now)
        out.append(t)
    return out


def test_a_higher_band_is_served_before_any_lower_one():
    """Bands are strict: a sheddable or standard request waits while a critical one is queued, whatever arrived first."""
    c = ctl()
    for t in (tk(c, "low", 0, SHEDDABLE), tk(c, "std", 0.1, STANDARD), tk(c, "crit", 0.2, CRITICAL)):
        assert c.offer(t, t.arrived) == []
    assert [t.tenant for t in drain(c)] == ["crit", "std", "low"]


def test_a_tenants_requests_go_by_deadline():
    """Within one tenant, the earliest deadline first: a request with a tighter SLA overtakes an earlier one."""
    c = ctl()
    late = tk(c, "a", 0.0, sla=5.0, key="late")
    soon = tk(c, "a", 0.5, sla=1.0, key="soon")
    c.offer(late, 0.0)
    c.offer(soon, 0.5)
    assert [t.key for t in drain(c)] == ["soon", "late"]


def test_backlogged_tenants_share_by_weight_in_tokens():
    """Two tenants always backlogged, weights 3:1: served prefill-weighted tokens split 3:1, though the light one
    sends long prompts and the heavy one short ones (fair by tokens, not by requests)."""
    c = ctl(max_queued_per_tenant=10_000, max_queued=20_000)
    for i in range(2000):
        c.offer(tk(c, "heavy", i * 1e-3, weight=3.0, prompt=1000, key=f"h{i}"), i * 1e-3)
        c.offer(tk(c, "light", i * 1e-3, weight=1.0, prompt=4000, key=f"l{i}"), i * 1e-3)
    served = drain(c, 800)
    tokens = {"heavy": 0.0, "light": 0.0}
    for t in served:
        tokens[t.tenant] += t.cost
    assert abs(tokens["heavy"] / tokens["light"] - 3.0) < 0.1


def test_an_idle_tenant_banks_one_burst_at_most():
    """A tenant idle while another was served restarts `burst_credit` behind the band's virtual time: its next burst
    goes first (here 5 requests' worth), then it gets its share, not what would make up for all its idle time."""
    c = ctl(max_queued_per_tenant=10_000, max_queued=20_000, burst_credit=5000)
    for i in range(100):
        c.offer(tk(c, "busy", 0.0, key=f"b{i}"), 0.0)
    drain(c, 50)
    for i in range(50):
        c.offer(tk(c, "back", 1.0, key=f"k{i}"), 1.0)
    nxt = [t.tenant for t in drain(c, 26)]
    assert nxt[:6] == ["back"] * 6  # its burst credit, and the one at the virtual time itself
    assert nxt.count("back") == 16 and nxt.count("busy") == 10


def test_without_burst_credit_an_idle_tenant_starts_at_the_virtual_time():
    c = ctl(max_queued_per_tenant=10_000, max_queued=20_000, burst_credit=0)
    for i in range(100):
        c.offer(tk(c, "busy", 0.0, key=f"b{i}"), 0.0)
    drain(c, 50)
    for i in range(50):
        c.offer(tk(c, "back", 1.0, key=f"k{i}"), 1.0)
    nxt = [t.tenant for t in drain(c, 20)]
    assert nxt.count("back") == 10 and nxt.count("busy") == 10


def test_a_full_tenant_queue_refuses_that_tenant_only_with_429_and_retry_after():
    c = ctl(max_queued_per_tenant=2)
    assert c.offer(tk(c, "a", 0, key="a1"), 0) == [] and c.offer(tk(c, "a", 0, key="a2"), 0) == []
    r = c.offer(tk(c, "a", 0, key="a3"), 0)
    assert [(x.ticket.key, x.status, x.reason) for x in r] == [("a3", 429, "queue_full")]
    assert r[0].retry_after_s >= 1.0
    assert c.offer(tk(c, "b", 0, key="b1"), 0) == []  # another tenant still queues
    assert len(c) == 3


def test_full_queues_evict_the_newest_sheddable_request_for_a_higher_band():
    """The sheddable band absorbs the loss: a standard arrival at full queues takes a sheddable request's place (503
    evicted); a sheddable arrival at full queues is refused itself (nothing below it)."""
    c = ctl(max_queued=3)
    for i in range(3):
        c.offer(tk(c, f"s{i}", i, SHEDDABLE, key=f"s{i}"), i)
    r = c.offer(tk(c, "std", 5, STANDARD, key="std"), 5)
    assert [(x.ticket.key, x.status, x.reason) for x in r] == [("s2", 503, "evicted")]
    r = c.offer(tk(c, "s9", 6, SHEDDABLE, key="s9"), 6)
    assert [(x.ticket.key, x.status, x.reason) for x in r] == [("s9", 503, "overloaded")]
    assert [t.key for t in drain(c)] == ["std", "s0", "s1"]


def test_a_request_times_out_with_503_and_is_gone_from_the_queue():
    c = ctl(queue_timeout_s=3.0)
    a, b = tk(c, "a", 0.0, key="a"), tk(c, "a", 2.0, key="b")
    c.offer(a, 0.0)
    c.offer(b, 2.0)
    assert c.expire(2.9) == []
    r = c.expire(3.0)
    assert [(x.ticket.key, x.status, x.reason) for x in r] == [("a", 503, "queue_timeout")]
    assert len(c) == 1 and c.head(3.0) is b


def test_a_cancelled_request_leaves_no_charge():
    c = ctl()
    t = tk(c, "a", 0.0)
    c.offer(t, 0.0)
    assert c.cancel(t) and len(c) == 0 and c.depth("a") == 0
    assert c.tags.start(STANDARD, "a") == 0.0
    assert c.expire(100.0) == []  # its expiry entry is skipped


def test_a_lone_flow_is_not_contended_two_are():
    """One tenant alone is never held (its order is arrival order either way); two flows within the window are."""
    c = ctl(contention_window_s=10.0)
    tk(c, "a", 0.0)
    assert not c.contended(1.0)
    tk(c, "b", 2.0)
    assert c.contended(3.0)
    assert not c.contended(12.5)  # a's last sight is past the window


def test_fair_tags_merge_keeps_the_later_values():
    """Tags only grow: merging another instance's values never takes a flow back in time."""
    t = FairTags()
    t.charge(1, "a", 10.0)
    t.merge(1, "a", 5.0, 0.0)
    assert t.finish[(1, "a")] == 10.0
    t.merge(1, "a", 30.0, 20.0)
    assert t.finish[(1, "a")] == 30.0 and t.vtime[1] == 20.0


def test_requests_past_their_deadline_go_after_those_that_can_still_make_it():
    """Under overload plain earliest-deadline-first serves only late requests, each making the next one late; a
    request past its deadline waits until its tenant has none that can still make the SLA (then oldest first)."""
    c = ctl()
    old1, old2 = tk(c, "a", 0.0, sla=1.0, key="old1"), tk(c, "a", 0.1, sla=1.0, key="old2")
    fresh = tk(c, "a", 2.0, sla=1.0, key="fresh")
    for t in (old1, old2, fresh):
        c.offer(t, t.arrived)
    assert [t.key for t in drain(c, now=2.5)] == ["fresh", "old1", "old2"]
    assert len(c) == 0 and c.depth("a") == 0
