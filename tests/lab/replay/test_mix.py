"""The multi-tenant mixer and its measures, and the flow controller on the virtual clock: nothing lost."""

from __future__ import annotations

import pytest

from gateway.config import Routing
from gateway.flow.settings import FlowControl, FlowPolicy
from gateway.recording.trace import TraceRecord
from gateway_lab.replay.cli import flow_what_if
from gateway_lab.replay.mix import Part, fair_shares, jain, mix, run_mix, tenant_name
from gateway_lab.replay.run import nodes_targets


def rec(ms: float, n: int, first: int = 0) -> TraceRecord:
    return TraceRecord(ms, n, 50, tuple(range(first, first + -(-n // 512))))


def test_mix_interleaves_parts_by_time_with_their_tenant_and_distinct_blocks():
    a = [rec(0, 1024), rec(1000, 1024)]
    b = [rec(0, 1024), rec(1000, 1024)]
    out = mix([Part(a, 1), Part(b, 2, speed=2.0)], window_s=0.6)
    assert [(r.timestamp_ms, r.tenant) for r in out] == [(0, 1), (0, 2), (500.0, 2)]
    assert not set(out[0].hash_ids) & set(out[1].hash_ids)  # same ids in the traces, isolated per tenant


def test_fair_shares_give_a_light_tenant_its_demand_and_split_the_rest_by_weight():
    assert fair_shares(100, {"a": 500, "b": 20}, {"a": 1, "b": 1}) == {"a": 80, "b": 20}
    assert fair_shares(90, {"a": 500, "b": 500, "c": 10}, {"a": 2, "b": 1, "c": 1}) == {"a": 53.333333333333336,
                                                                                         "b": 26.666666666666668,
                                                                                         "c": 10}


def test_jains_index_is_one_when_equal_and_one_over_n_when_one_takes_all():
    assert jain([1, 1, 1]) == 1.0
    assert abs(jain([1, 0, 0, 0]) - 0.25) < 1e-12


def test_under_overload_every_request_is_served_or_refused_with_a_reason():
    """Two tenants flooding one rank on the virtual clock through flow control: none is lost, each refusal names
    its reason, and the tenant over its share is the one refused."""
    heavy = [rec(i * 20.0, 6000, first=10 * i) for i in range(400)]  # ~50 req/s of 6k tokens: far past one rank
    light = [rec(i * 500.0, 2000, first=10 * i) for i in range(16)]
    trace = mix([Part(heavy, 1), Part(light, 2)])
    fc = FlowControl(enabled=True, max_queued_per_tenant=20, queue_timeout_s=3.0)
    dem = {tenant_name(1): 1.0, tenant_name(2): 1.0}
    r = run_mix(trace, nodes_targets(1)[:1], Routing(), fc, {t: FlowPolicy() for t in dem}, {}, "t", 8.0, dem)
    assert r.lost == 0
    rows = {t.tenant: t for t in r.tenants}
    assert set(rows[tenant_name(1)].refused) <= {"queue_full", "queue_timeout"} and rows[tenant_name(1)].refused
    assert not rows[tenant_name(2)].refused


def test_a_what_if_changes_flow_settings_as_the_config_would_and_a_bad_one_is_named():
    fc = flow_what_if(["under_share_priority=0", 'bands=[{"name": "critical", "engine_priority": 10}, '
                                                  '{"name": "standard"}]'])
    assert fc.under_share_priority == 0 and fc.bands[0].engine_priority == 10
    assert flow_what_if([]) == FlowControl()
    for bad in ("under_share_priority=99", "no_such_field=1"):
        with pytest.raises(SystemExit, match=bad.split("=")[0]):
            flow_what_if([bad])


def test_possible_demand_leaves_out_what_no_idle_rank_serves_within_the_sla_and_jain_reads_it():
    """A prompt too long to prefill within the SLA on an idle rank is owed nothing; its repeat, cached, is."""
    from gateway_lab.replay.mix import demand, jain_of, possible_demand
    from gateway_lab.sim.fleet import idle_ttft
    from gateway_lab.sim.profiles import profile

    rank, fc = profile("mi355x-glm52-tp4"), FlowControl()
    short, huge = rec(0, 2048), rec(1000, 81_920, first=100)  # whole blocks: the ideal cache holds all of it
    again = TraceRecord(2000, 81_920 + 512, 50, huge.hash_ids + (999,))
    assert idle_ttft(rank, 81_920, 0) > 2.22 >= idle_ttft(rank, 2048, 0)
    assert idle_ttft(rank, 82_432, 81_920) <= 2.22
    trace = [short, huge, again]
    owed = possible_demand(trace, fc, rank, 2.22, window_s=10)
    unit = (2048 * fc.prefill_weight + 50 * fc.output_weight
            + 512 * fc.prefill_weight + 81_920 * fc.cached_weight + 50 * fc.output_weight) / 10
    assert owed == pytest.approx(unit)
    assert owed < demand(trace, fc, window_s=10)
    # a light tenant that got all it could, the rest to the heavy one: fair on that reading, not on its whole demand
    assert jain_of({"b": owed, "a": 10 * owed}, {"b": owed, "a": 1e9}, {"a": 1, "b": 1}) == 1.0
    assert jain_of({"b": owed, "a": 10 * owed}, {"b": 2 * owed, "a": 1e9}, {"a": 1, "b": 1}) < 1.0
