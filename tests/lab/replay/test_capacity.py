"""The capacity sweep behind `gateway replay --bands --capacity/--overload`: what it finds, and one real point."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import Routing
from gateway.recording.trace import TraceRecord
from gateway_lab.replay import capacity
from gateway_lab.replay.run import nodes_targets


def fake(edge: float, dips: tuple[float, ...] = ()) -> Any:
    """A fleet that meets the target up to `edge` (and misses at each speed in `dips`)."""

    def point(trace: Any, targets: Any, routing: Any, speed: float) -> capacity.Point:
        ok = speed <= edge + 1e-9 and speed not in dips
        return capacity.Point(speed, 100, 0.9, 0.995 if ok else 0.98, 1.0, 1.0)

    return point


def test_the_sweep_steps_up_then_halves_to_the_resolution(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(capacity, "point", fake(1.3))
    cap, points = capacity.sweep([], [], Routing(), step=0.5, resolution=0.05)
    assert cap == pytest.approx(1.3, abs=0.05) and cap <= 1.3
    speeds = [p.speed for p in points]
    assert speeds == sorted(speeds) and 1.5 in speeds and 1.0 in speeds  # the miss that bounds it is printed


def test_the_capacity_is_below_the_first_miss_even_when_a_faster_speed_meets_the_target(monkeypatch):
    monkeypatch.setattr(capacity, "point", fake(3.0, dips=(1.0,)))
    cap, _ = capacity.sweep([], [], Routing(), step=0.5, resolution=0.25)
    assert cap == 0.75  # every speed below it meets the target; 1.0 does not, whatever comes after


def test_no_capacity_when_the_first_step_misses_and_the_next_steps_are_shown(monkeypatch):
    monkeypatch.setattr(capacity, "point", fake(0.0))
    cap, points = capacity.sweep([], [], Routing(), step=0.25, beyond=2)
    assert cap == 0.0 and [p.speed for p in points] == [0.25, 0.5, 0.75]


def test_a_point_replays_the_whole_trace_as_one_tenant():
    trace = [TraceRecord(i * 2000.0, 1024, 20, (0, 100 + i, 200 + i)) for i in range(12)]
    p = capacity.point(trace, nodes_targets(1), Routing(), 1.0)
    assert p.requests == 12 and p.within_sla_possible == 1.0 and p.passes(capacity.TARGET)


def test_a_bands_window_past_the_traces_end_replays_every_request():
    from gateway.flow.settings import FlowControl
    from gateway_lab.replay.mix import priority_bands

    trace = [TraceRecord(i * 1000.0 / 3, 1024, 20, (0, 100 + i, 200 + i)) for i in range(9)]
    runs = priority_bands(trace, nodes_targets(1), Routing(), FlowControl(), 1.0, 1e9)
    assert [sum(t.requests for t in r.tenants) for r in runs[1:]] == [9, 9, 9]  # the last one too
