"""Latency outlier ejection on a virtual clock: a replica far slower than its peers (TTFT residual or inter-token
latency) is ejected after consecutive evaluations, never below the floor of healthy capacity, returns after its
ejection on a clean slate through its probe gate (one request at a time until it has shown it is well), and is
ejected again, for longer, if it is still slow."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from gateway.config import OutlierDetection
from gateway.dispatch.outliers import SUSPECT_SAMPLES, LatencyOutliers
from gateway.dispatch.replica_stats import ReplicaStats
from gateway.observability.metrics import GatewayMetrics
from gateway.prediction.ttft import FREE, TtftCorrector
from gateway.probe_gate import ProbeGate


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class State:
    ejected: bool = False
    drained: bool = False
    probe: ProbeGate = field(default_factory=ProbeGate)


@dataclass(eq=False)
class FakeTarget:
    """What the detector reads of a target: name, pool, the routable() answer, the ejected flag it writes and the
    probe gate it opens and closes."""

    name: str
    pool: str = "p"
    state: State = field(default_factory=State)

    def routable(self, probe: bool = True) -> bool:
        return not self.state.ejected and not self.state.drained and (not probe or self.state.probe.available())


CFG = OutlierDetection(interval_s=1.0, window_s=20.0, min_samples=8, min_hosts=3, ttft_factor=2.5, itl_factor=2.5,
                       consecutive=2, base_ejection_s=30.0, max_ejection_s=300.0, max_ejection_percent=25.0)


class Fleet:
    def __init__(self, n: int = 4, cfg: OutlierDetection = CFG) -> None:
        self.clock = Clock()
        self.stats = ReplicaStats(cfg.window_s, clock=self.clock)
        self.targets = [FakeTarget(f"r{i}", state=State(probe=ProbeGate(clock=self.clock))) for i in range(n)]
        self.metrics = GatewayMetrics()
        self.corrector = TtftCorrector(clock=self.clock)
        self.det = LatencyOutliers(cfg, self.stats, lambda: {"p": self.targets}, metrics=self.metrics,
                                   corrector=self.corrector, clock=self.clock)
        self.served: list[tuple[str, str]] = []  # (replica, attempt), every request served

    def second(self, slow: dict[str, float] | None = None, itl_slow: dict[str, float] | None = None) -> None:
        """One virtual second: each routable replica is offered 4 requests (TTFT residual 1, ITL 20 ms, times the
        given factors), each through its probe gate and ending at the second's end, then the detector ticks. A
        probing replica so takes one a second."""
        served: list[tuple[str, str]] = []
        for t in self.targets:
            if not t.routable():
                continue
            for i in range(4):
                attempt = f"{t.name}@{self.clock.now}#{i}"
                if not t.state.probe.acquire(attempt):
                    break
                served.append((t.name, attempt))
                self.stats.ttft(t.name, 1.0 * (slow or {}).get(t.name, 1.0), 1.0)
                self.stats.itl(t.name, 0.02 * (itl_slow or {}).get(t.name, 1.0))
                self.stats.outcome(t.name, "ok")
        self.served += served
        self.clock.now += 1.0
        for name, attempt in served:
            self.det.attempt_ended(name, attempt)
        self.det.tick()

    def ejected(self) -> set[str]:
        return {t.name for t in self.targets if t.state.ejected}

    def metric(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)


def test_a_ttft_outlier_is_ejected_after_consecutive_evaluations_and_logged(caplog):
    f = Fleet()
    for _ in range(5):
        f.second()
    assert f.ejected() == set()
    with caplog.at_level(logging.INFO, logger="gateway.outliers"):
        seconds = 0
        while not f.ejected():
            f.second(slow={"r2": 6.0})
            seconds += 1
            assert seconds < 10
    assert f.ejected() == {"r2"}
    assert seconds >= CFG.consecutive  # one bad evaluation is not "stays far above"
    e = f.det.ejected("r2")
    assert e is not None and e.reason == "latency_ttft" and e.value / e.peers == pytest.approx(6.0)
    status = f.det.status("r2")["ejected"]
    assert status["reason"] == "latency_ttft" and status["times_peers"] == pytest.approx(6.0)
    assert status["remaining_s"] == pytest.approx(CFG.base_ejection_s, abs=1.0)
    assert f.metric("gateway_replica_ejections_total", pool="p", replica="r2", reason="latency_ttft") == 1
    assert f.metric("gateway_replica_ejected", pool="p", replica="r2") == 1
    events = [r for r in caplog.records if getattr(r, "event", None) == "replica_ejected"]
    assert len(events) == 1 and events[0].replica == "r2" and events[0].reason == "latency_ttft"


def test_an_itl_outlier_is_ejected_though_its_ttft_is_fine():
    f = Fleet()
    for _ in range(10):
        f.second(itl_slow={"r1": 6.0})
    assert f.ejected() == {"r1"}
    assert f.det.ejected("r1").reason == "latency_itl"


def test_a_fleet_wide_slowdown_ejects_no_one():
    """Everyone 6x slower is not an outlier: the comparison is against peers, not against a fixed target."""
    f = Fleet()
    for _ in range(20):
        f.second(slow={t.name: 6.0 for t in f.targets}, itl_slow={t.name: 6.0 for t in f.targets})
    assert f.ejected() == set()


def test_the_floor_holds_whatever_the_outliers():
    """Two slow replicas of four with max_ejection_percent 25: one is ejected, the other is held (and says why) —
    the pool keeps three quarters of its replicas in routing."""
    f = Fleet()
    for _ in range(15):
        f.second(slow={"r0": 6.0, "r1": 8.0})
    assert f.ejected() == {"r1"}  # the worst first
    held = f.det.status("r0")
    assert held["ejected"] is None and "already out of routing" in held["held_by_floor"]


def test_a_drained_replica_counts_against_the_floor():
    f = Fleet()
    f.targets[3].state.drained = True  # on-call took one out already: 1 of 4 is the most that may be out
    for _ in range(15):
        f.second(slow={"r0": 6.0})
    assert f.ejected() == set()


def test_too_few_peers_eject_no_one():
    f = Fleet(n=2)
    for _ in range(15):
        f.second(slow={"r0": 6.0})
    assert f.ejected() == set()


def test_it_returns_on_a_clean_slate_and_a_still_slow_replica_is_ejected_again_for_longer():
    f = Fleet()
    for _ in range(5):
        f.corrector.observe("p", 1.0, 6.0, FREE, "r2")
    while not f.ejected():
        f.second(slow={"r2": 6.0})
    first = f.det.ejected("r2")
    assert first.until - first.since == CFG.base_ejection_s
    while f.ejected():  # no traffic reaches it while ejected
        f.second()
    assert f.clock.now - first.since == pytest.approx(CFG.base_ejection_s, abs=1.0)
    assert f.stats.view("r2").ttft_samples == 0 and f.corrector.replica_factor("r2") == 1.0  # the probe: its share
    assert f.metric("gateway_replica_ejected", pool="p", replica="r2") == 0
    while not f.ejected():  # still slow: back out on its probe (probe_samples, one evaluation)
        f.second(slow={"r2": 6.0})
    second = f.det.ejected("r2")
    assert second.count == 2 and second.until - second.since == 2 * CFG.base_ejection_s


def test_a_recovered_replica_stays_in():
    f = Fleet()
    while not f.ejected():
        f.second(slow={"r2": 6.0})
    for _ in range(int(CFG.base_ejection_s) + 30):  # the fault cleared while it was out
        f.second()
    assert f.ejected() == set()
    assert f.stats.view("r2").ttft_samples > 0


def test_disabled_ejects_nothing():
    f = Fleet(cfg=CFG.model_copy(update={"enabled": False}))
    for _ in range(15):
        f.second(slow={"r0": 6.0})
    assert f.ejected() == set()


def test_replica_stats_window_and_rates():
    clock = Clock()
    s = ReplicaStats(window_s=10.0, clock=clock)
    for kind in ("ok", "ok", "error", "timeout"):
        s.outcome("r", kind)
    s.ttft("r", 2.0, 1.0)
    s.itl("r", 0.05)
    v = s.view("r")
    assert (v.attempts, v.error_rate, v.timeout_rate, v.ttft_residual_p50, v.itl_p50_s) == (4, 0.25, 0.25, 2.0, 0.05)
    for _ in range(10):
        s.ttft("r", 1.0, 1.0)
    v = s.view("r")
    assert (v.ttft_residual_p50, v.recent_ttft_residual_p50) == (1.0, 1.0) and v.ttft_samples == 11
    s = ReplicaStats(window_s=10.0, recent=3, clock=clock)
    for ratio in (1.0, 1.0, 1.0, 1.0, 6.0, 6.0, 6.0):  # slowed a moment ago: the window's median is from before
        s.ttft("r", ratio, 1.0)
    v = s.view("r")
    assert (v.ttft_residual_p50, v.recent_ttft_residual_p50) == (1.0, 6.0)
    clock.now += 11.0
    v = s.view("r")
    assert (v.attempts, v.ttft_samples, v.error_rate) == (0, 0, None)


def test_a_probe_back_in_costs_one_request_not_a_full_sample():
    """Back from an ejection the replica is on probation: a still-slow one is ejected again on its first request
    through the probe gate, in one evaluation; one judged clean on min_samples leaves probation."""
    f = Fleet()
    while not f.ejected():
        f.second(slow={"r2": 6.0})
    while f.ejected():
        f.second()
    served = 0
    while not f.ejected():
        for t in f.targets:  # one request each per step, so the count of slow ones is exact
            f.stats.ttft(t.name, 6.0 if t.name == "r2" else 1.0, 1.0)
            f.stats.itl(t.name, 0.02)
        served += 1
        f.clock.now += CFG.interval_s
        f.det.tick()
    assert served == 1
    while f.ejected():
        f.second()
    for _ in range(5):
        f.second()  # recovered: 4 requests a second, judged clean on min_samples
    assert not f.det._track["r2"].probation


def _eject_then_return(f: Fleet, name: str = "r2") -> None:
    while not f.ejected():
        f.second(slow={name: 6.0})
    while f.ejected():
        f.second()


def test_a_returning_replica_takes_one_request_at_a_time_until_it_has_shown_it_is_well(caplog):
    """Back from an ejection the replica gets one request at a time (its probe slot held from dispatch to the
    attempt's end; routing skips it meanwhile), not its full share at once: a still-slow replica would otherwise
    take several slow requests before the first of them tells. Judged well on probe_samples, it gets its share."""
    f = Fleet()
    _eject_then_return(f)
    r2 = f.targets[2]
    gate = r2.state.probe
    assert gate.probing and f.det.status("r2")["probing"] == {"probes": 0, "in_flight": False}
    assert r2.routable() and gate.acquire("a")
    assert not r2.routable() and r2.routable(probe=False)  # skipped by routing, still in routing for the detector
    assert not gate.acquire("b")
    f.det.attempt_ended("r2", "other")  # another attempt's end frees nothing
    assert not gate.acquire("b")
    f.det.attempt_ended("r2", "a")
    assert r2.routable()
    f.served.clear()
    with caplog.at_level(logging.INFO, logger="gateway.outliers"):
        seconds = 0
        while gate.probing:
            f.second()
            seconds += 1
            assert seconds < 10
    probes = sum(name == "r2" for name, _ in f.served)
    assert probes == seconds == CFG.probe_samples  # one a second, just enough to be judged
    assert "probing" not in f.det.status("r2") and f.ejected() == set()
    passed = [r.probes for r in caplog.records if getattr(r, "event", None) == "replica_probe_passed"]
    assert passed == [probes + 1]  # and the one by hand above
    f.served.clear()
    f.second()
    assert sum(name == "r2" for name, _ in f.served) == 4  # its full share again


def test_a_still_slow_replica_is_probed_one_request_at_a_time_and_each_ejection_is_longer():
    """Still slow when its ejection ends: it serves one request (each probe is a client's request) and is ejected
    again for base_ejection_s x its ejections in a row — the third for three times the first."""
    f = Fleet()
    while not f.ejected():
        f.second(slow={"r2": 6.0})
    lengths = []
    for _ in range(2):
        while f.ejected():
            f.second()
        f.served.clear()
        while not f.ejected():
            f.second(slow={"r2": 6.0})
        assert sum(name == "r2" for name, _ in f.served) == 1
        e = f.det.ejected("r2")
        lengths.append(e.until - e.since)
        assert not f.targets[2].state.probe.probing  # closed while out; opened again at the next return
    assert lengths == [2 * CFG.base_ejection_s, 3 * CFG.base_ejection_s]


def test_a_probe_slot_never_ended_is_free_again_after_stale_s():
    """An attempt whose end is never reported cannot shut a replica out: the gate slows, never blocks."""
    clock = Clock()
    gate = ProbeGate(stale_s=60.0, clock=clock)
    assert gate.acquire("x") and gate.acquire("y")  # closed: every request goes
    gate.open()
    assert gate.acquire("a") and not gate.available()
    clock.now += 59.0
    assert not gate.acquire("b")
    clock.now += 1.0
    assert gate.acquire("b") and gate.holder == "b"
    gate.release("a")  # the abandoned attempt's late end frees nothing
    assert not gate.available()
    gate.close()
    assert gate.available()


def test_one_fast_probe_among_slow_ones_does_not_pass_it():
    """Passing takes probe_samples requests judged well; a slow one among them (after a fast first) ejects it."""
    f = Fleet()
    _eject_then_return(f)
    f.second()  # a fast first probe
    assert f.targets[2].state.probe.probing and f.ejected() == set()
    f.second(slow={"r2": 8.0})
    f.second(slow={"r2": 8.0})
    assert f.ejected() == {"r2"}


def test_a_probe_is_judged_when_it_ends_before_its_slot_is_free_again():
    """With evaluations far apart, a slow probe whose end frees the slot would let a second request through before
    the next evaluation: its end judges the pool first, so a still-slow replica serves exactly one request per
    return (decode slowness shows only at a stream's end)."""
    f = Fleet()
    _eject_then_return(f)
    f.det.cfg = CFG.model_copy(update={"interval_s": 60.0})  # from here, no evaluation falls due
    f.det._last = f.clock.now
    gate = f.targets[2].state.probe
    assert gate.probing and gate.acquire("probe")
    f.stats.ttft("r2", 1.0, 1.0)
    f.stats.itl("r2", 0.12)  # 6x its peers' 20 ms
    f.det.attempt_ended("r2", "probe")
    assert f.ejected() == {"r2"} and not f.targets[2].routable()


def test_a_replica_with_little_traffic_is_judged_on_its_lookback():
    """A quarter of a request a second per replica never makes min_samples (8) in the 20 s window: each replica is
    then judged on its last 8 within `lookback_s`, so a slow one is still ejected (with the window alone, never)."""
    def run(lookback_s: float) -> int | None:
        cfg = CFG.model_copy(update={"lookback_s": lookback_s})
        clock = Clock()
        stats = ReplicaStats(cfg.window_s, recent=cfg.min_samples, clock=clock, lookback_s=cfg.lookback_s)
        targets = [FakeTarget(f"r{i}", state=State(probe=ProbeGate(clock=clock))) for i in range(4)]
        det = LatencyOutliers(cfg, stats, lambda: {"p": targets}, clock=clock)
        for second in range(180):
            clock.now = float(second)
            if second % 4 == 0:  # one request to each replica every 4 s
                for t in targets:
                    stats.ttft(t.name, 6.0 if t.name == "r3" and second >= 60 else 1.0, 1.0)
            det.tick()
            if targets[3].state.ejected:
                return second - 60
        return None

    assert run(20.0) is None  # the window alone: 5 observations each, nobody judged
    after = run(60.0)
    assert after is not None and after <= 40  # 5 of its last 8 slow: its 5th slow request at 16 s, then 2 evaluations


def test_the_window_figures_stay_the_window_when_the_lookback_is_longer():
    clock = Clock()
    s = ReplicaStats(window_s=10.0, recent=8, clock=clock, lookback_s=60.0)
    for _ in range(4):
        s.ttft("r", 6.0, 1.0)
    clock.now += 30.0
    s.ttft("r", 1.0, 1.0)
    v = s.view("r")
    assert (v.ttft_samples, v.ttft_residual_p50) == (1, 1.0)  # admin state: the window
    assert s.recent("r", 8)[0] == [6.0, 6.0, 6.0, 6.0, 1.0]  # the detector: back to the lookback
    clock.now += 31.0
    assert s.recent("r", 8)[0] == [1.0]


def test_a_replica_its_correction_calls_slow_is_judged_on_its_last_few():
    """Routing moves traffic off a replica whose own TTFT correction is high (the policy's `slow_replica`), so it
    would not reach min_samples: with its factor at or past ttft_factor it is judged on its last SUSPECT_SAMPLES,
    which a run of slow first tokens fills (its older, fast observations do not outvote them)."""
    f = Fleet()
    for _ in range(10):
        f.second()
    for _ in range(SUSPECT_SAMPLES):  # three slow requests, nothing else on it
        f.stats.ttft("r2", 6.0, 1.0)
        f.corrector.observe("p", 1.0, 6.0, FREE, "r2", alone=True)
    assert f.corrector.replica_factor("r2") >= CFG.ttft_factor  # the step change (prediction/ttft.py)
    for _ in range(CFG.consecutive):
        f.clock.now += CFG.interval_s
        f.det.evaluate()
    assert f.ejected() == {"r2"}


def test_a_healthy_replica_with_a_few_slow_answers_is_not_suspect():
    f = Fleet()
    for _ in range(10):
        f.second()
    for _ in range(SUSPECT_SAMPLES - 1):
        f.stats.ttft("r2", 6.0, 1.0)
        f.corrector.observe("p", 1.0, 6.0, FREE, "r2", alone=True)
    f.corrector.observe("p", 1.0, 1.0, FREE, "r2", alone=True)
    f.stats.ttft("r2", 1.0, 1.0)
    for _ in range(CFG.consecutive + 1):
        f.clock.now += CFG.interval_s
        f.det.evaluate()
    assert f.ejected() == set()


@pytest.mark.parametrize("waiting", [0, 5])
def test_no_latency_ejection_from_a_saturated_pool(waiting: int, caplog):
    """While requests wait in flow control for the pool, a replica far slower than its peers is held (shown in its
    status, logged once) rather than ejected: its latency says where the load landed. With none waiting it is
    ejected as ever."""
    f = Fleet()
    f.det.waiting = lambda pool, targets: waiting
    with caplog.at_level(logging.INFO, logger="gateway.outliers"):
        for _ in range(12):
            f.second(itl_slow={"r2": 4.0})
    if waiting:
        assert f.ejected() == set()
        assert "5 requests waited in flow control" in f.det.status("r2")["held_by_saturation"]
        held = [r for r in caplog.records if getattr(r, "event", "") == "replica_ejection_held"]
        assert len(held) == 1 and held[0].waiting == 5 and set(held[0].prefill_load) >= {"tokens", "peers_tokens"}
        # the queue drained: the statistics still cover the saturated window, so the hold lasts window_s more
        f.det.waiting = lambda pool, targets: 0
        for _ in range(int(CFG.window_s) - 3):
            f.second(itl_slow={"r2": 4.0})
        assert f.ejected() == set()
        for _ in range(5):  # then it is judged as ever, the hold gone
            f.second(itl_slow={"r2": 4.0})
        assert f.ejected() == {"r2"} and "held_by_saturation" not in f.det.status("r2")
    else:
        assert f.ejected() == {"r2"} and f.det.ejected("r2").reason == "latency_itl"
