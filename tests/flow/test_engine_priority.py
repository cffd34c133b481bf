"""Flow control's engine priority: a request of a flow under its share is dispatched with a higher engine priority
(`flow.under_share_priority`, plus its band's `engine_priority`), read from the controller's fair tags; an
over-share flow's is not raised; and nothing is sent to an engine that does not schedule by priority. On a fixed
clock for the controller, and through the real app over loopback HTTP to simulated SGLang servers, whose record of
the `priority` field as received says what the gateway sent."""

from __future__ import annotations

import functools

import httpx
import pytest
from pydantic import ValidationError

from gateway.config import Routing, hash_key
from gateway.flow.controller import FlowController, Ticket
from gateway.flow.settings import FlowControl, FlowPolicy
from gateway.recording.trace import TraceRecord
from gateway_lab.replay.mix import Part, mix, tenant_name
from gateway_lab.replay.run import nodes_targets, to_job
from gateway_lab.sim.fleet import Fleet
from tests.gateway_fixtures import KEY_A, KEY_B, config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until

CRITICAL, STANDARD = 0, 1


def ctl(**kw: object) -> FlowController:
    return FlowController(FlowControl.model_validate({"enabled": True, **kw}))


def tk(c: FlowController, tenant: str, now: float, band: int = STANDARD, key: str = "") -> Ticket:
    return c.ticket(key or f"{tenant}-{now}", tenant, band, 1.0, 1000, 0, now, 2.0)


def flood(c: FlowController, n: int = 5, band: int = STANDARD) -> None:
    for i in range(n):
        t = tk(c, "flood", i * 0.01, band, key=f"f{i}")
        c.offer(t, t.arrived)
        c.grant(t, t.arrived)


def test_an_under_share_flow_is_boosted_and_an_over_share_one_is_not():
    """After a backlogged tenant was served, a quiet tenant's request is granted with the boost; the backlogged
    tenant's next is not — and once the quiet one has used its share (its burst credit spent), neither is it."""
    c = ctl(burst_credit=2_000)
    flood(c)
    quiet, again = tk(c, "quiet", 1.0, key="q"), tk(c, "flood", 1.0, key="f9")
    for t in (quiet, again):
        c.offer(t, 1.0)
    c.grant(quiet, 1.0)
    c.grant(again, 1.0)
    assert (quiet.boost, again.boost) == (10, 0)
    spent = []
    for i in range(6):  # each of ~1000 prefill-weighted tokens: past its 2000 of credit it is at its share
        t = tk(c, "quiet", 2.0 + i, key=f"q{i}")
        c.offer(t, t.arrived)
        c.grant(t, t.arrived)
        spent.append(t.boost)
    assert spent[0] == 10 and spent[-1] == 0


def test_a_request_charged_without_queueing_is_boosted_by_the_same_rule():
    """The gate lets a request straight through (nothing waiting, or no contention): `charge` reads its standing
    the same way, before its own cost moves its tag."""
    c = ctl()
    flood(c)
    quiet = tk(c, "quiet", 1.0)
    c.charge(quiet, 1.0)
    assert quiet.boost == 10
    alone = ctl()
    first = tk(alone, "only", 0.0)
    alone.charge(first, 0.0)
    assert first.boost == 0  # a lone flow is never under its share: nobody's share to be under


def test_the_knob_off_and_the_bands_own_priority():
    """`under_share_priority: 0` sends no boost; a band's `engine_priority` is added for every request of the band,
    under its share or not."""
    off = ctl(under_share_priority=0)
    flood(off)
    quiet = tk(off, "quiet", 1.0)
    off.charge(quiet, 1.0)
    assert quiet.boost == 0
    bands = [{"name": "critical", "engine_priority": 20}, {"name": "standard"}]
    c = ctl(bands=bands, under_share_priority=5)
    flood(c, band=CRITICAL)
    crit_quiet, crit_flood, std = tk(c, "quiet", 1.0, CRITICAL), tk(c, "flood", 1.0, CRITICAL), tk(c, "s", 1.0)
    for t in (crit_quiet, crit_flood, std):
        c.charge(t, 1.0)
    assert (crit_quiet.boost, crit_flood.boost, std.boost) == (25, 20, 0)


@pytest.mark.parametrize("field", ["under_share_priority", "bands"])
def test_a_boost_out_of_range_fails_the_load_naming_the_field(field):
    bad = {"under_share_priority": -1} if field == "under_share_priority" else \
        {"bands": [{"name": "critical", "engine_priority": 1000}], "default_band": "critical"}
    with pytest.raises(ValidationError, match=field):
        FlowControl.model_validate(bad)


def rec(ms: float, n: int, first: int) -> TraceRecord:
    return TraceRecord(ms, n, 20, tuple(range(first, first + -(-n // 512))))


@pytest.mark.parametrize("knob", [10, 0])
def test_on_the_virtual_clock_the_fleet_sends_the_boost_as_the_gateway_does(knob):
    """The virtual-clock fleet runs the same controller: a tenant flooding one replica with 20k-token prompts is
    never boosted; the quiet tenant's requests that go while it is under its share are, by `under_share_priority`
    over what its class and prefill level give it (levels stay below 10: nothing else reaches 10 here)."""
    flood = [rec(10 + i * 50.0, 20_000, 100_000 * (i + 1)) for i in range(30)]
    quiet = [rec(0.0, 500, 0)] + [rec(1000.0 + 500 * i, 1_000, 1000 + i * 10) for i in range(4)]
    trace = mix([Part(quiet, 1), Part(flood, 2)])
    fc = FlowControl(enabled=True, queue_timeout_s=60.0, under_share_priority=knob)
    targets = nodes_targets(1)[:1]
    fleet = Fleet(targets, Routing(), flow=fc, flow_tenants={tenant_name(1): FlowPolicy(), tenant_name(2): FlowPolicy()})
    page, chunk = targets[0][1].page_size, Routing().chunk_tokens
    fleet.feed((r.timestamp_ms / 1000, functools.partial(to_job, r, i, chunk, page, 2.22)) for i, r in enumerate(trace))
    recs = [r for r in fleet.run() if r.name]
    quiet_prio = [r.priority for r in recs if r.tenant == tenant_name(1)]
    flood_prio = [r.priority for r in recs if r.tenant == tenant_name(2)]
    assert len(quiet_prio) == 5 and len(flood_prio) == 30
    assert max(flood_prio) < 10
    assert (max(quiet_prio) >= 10) is (knob > 0), quiet_prio


def post(url: str, key: str) -> None:
    body = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("scheduling", [True, False], ids=["priority-scheduling", "no-priority-scheduling"])
def test_the_gateway_sends_the_boost_only_to_engines_that_schedule_by_priority(scheduling):
    """Tenant A sends three requests, then tenant B one (B is under its share: A was served, B was not), then A one
    more. On a server with priority scheduling B's request carries A's priority + 10 (same class, same prefill
    level), A's never more; on a server without, no request carries a priority at all (the gateway knows the server
    does not schedule by it, and `--abort-on-priority-when-disabled` would refuse one)."""
    sims, reps = start_sims(1, enable_priority_scheduling=scheduling, abort_on_priority_when_disabled=not scheduling)
    tenants = [{"name": n, "api_key_hashes": [hash_key(k)], "models": ["glm-5.2"]}
               for n, k in (("tenant-a", KEY_A), ("tenant-b", KEY_B))]
    gw = start_gateway(config([sglang_pool("p", sims.urls)], tenants=tenants, flow={"enabled": True},
                              routing={"load_poll_s": 0.1}))
    try:
        target = lambda: gw.app.state.gateway.registry.by_pool["p"][0]  # noqa: E731
        wait_until(lambda: gw.call(lambda: target().priority_scheduling) is scheduling, timeout=10,
                   what="the preflight read enable_priority_scheduling")
        for key in (KEY_A, KEY_A, KEY_A, KEY_B, KEY_A):
            post(gw.urls[0], key)
        sent = list(reps[0].priorities)[-5:]
        if not scheduling:
            assert sent == [None] * 5
            return
        a1, a2, a3, b, a4 = sent
        assert all(isinstance(p, int) for p in sent), sent
        assert a1 == a2 == a3 == a4 and b == a1 + 10, sent
    finally:
        gw.stop()
        sims.stop()
