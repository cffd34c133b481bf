"""Latency outlier ejection: a replica far slower than its pool's peers is taken out of routing for a while, Envoy's
outlier detection applied to time to first token and inter-token latency (`outlier_detection` in the config).

A gray failure — a replica not dead, not erroring, just slow (a throttled GPU, a bad NIC, a noisy neighbour) — passes
every health check and keeps its share. The per-replica TTFT correction (`prediction/ttft.py`) already moves new load
off it as its predictions rise; this module is the backstop for what the prediction does not cover (decode slowness,
which TTFT does not see) and what on-call should be told about.

Every `interval_s` (checked on each observation; no background task), per pool: each replica's statistic is the
median of its last `min_samples` observations in the window — the TTFT residual (observed / predicted for the pool,
`replica_stats.py`) and the decode inter-token latency (a stream's ITL without the prefills that cut in between its
tokens: a healthy replica sent long prompts slows its streams' tokens by those prefills, which is load, not a fault;
replica_stats.py `decode_itl`). A replica whose statistic is more than `ttft_factor` (`itl_factor`) times the
median of its peers' — with at least `min_hosts` replicas judged — for `consecutive` evaluations in a row is ejected
for `base_ejection_s` x the number of ejections in a row (capped at `max_ejection_s`).

- Saturation: while requests wait in flow control for the pool (on any instance), and for `window_s` after, no
  replica of it is ejected on latency (`hold_while_saturated`): their latencies then say where the load landed.
- Floor: an ejection never takes a pool's replicas out of routing (ejected, unhealthy, drained, breaker open) beyond
  `max_ejection_percent` of them, with at least one allowed once the pool has `min_hosts`: a fleet-wide slowdown makes
  no replica an outlier, and a pool is never emptied by this module.
- Probes back in: when the ejection ends the replica is routable again on a clean slate (its window and its own TTFT
  correction forgotten), but through its probe gate (`gateway/probe_gate.py`): one request at a time, like a
  half-open breaker's trial, until an evaluation finds its first `probe_samples` requests (TTFT and ITL) well; then
  the gate closes and it gets its full share. While the gate is open it is judged from its first request on (the
  median of what it has), so a still-slow replica is ejected again, for longer, after one slow request: each slow
  probe is a client's request, and in a window of a few hundred requests each one moves the fleet's TTFT p95
  (docs/results/2026-11-27-gray-failure.md: three 6x probes moved it by about 5 points, one by under 1). After the
  gate it is on probation until judged clean on `min_samples`: judged on its last `probe_samples` requests, in one
  evaluation. Each evaluation that finds it well after `base_ejection_s` back takes one off the count.
- Only the worst outlier of a pool is ejected per evaluation, so the floor counts what is really out.

Each ejection, return and passed probe is a structured log event (`replica_ejected`, `replica_returned`,
`replica_probe_passed`), a counter
(`gateway_replica_ejections{reason="latency_ttft|latency_itl"}`) and a gauge (`gateway_replica_ejected`), and shows in
`/admin/state` with why. State is this module's; the target's `ejected` flag is its one write to the target.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.config import OutlierDetection
from gateway.dispatch.replica_stats import ReplicaStats
from gateway.probe_gate import ProbeGate

log = logging.getLogger("gateway.outliers")

REASONS = ("latency_ttft", "latency_itl")
SUSPECT_SAMPLES = 3  # observations that judge a replica its own TTFT correction calls slow


@dataclass
class Ejection:
    replica: str
    pool: str
    reason: str  # latency_ttft | latency_itl
    value: float  # the replica's statistic (TTFT residual, or ITL in seconds)
    peers: float  # its peers' median of the same
    since: float
    until: float
    count: int  # ejections in a row (the length's multiplier)
    signals: dict[str, float] = field(default_factory=dict)  # every reason it was an outlier on -> x its peers

    def as_dict(self, now: float) -> dict[str, Any]:
        return {"reason": self.reason, "value": round(self.value, 4), "peers_median": round(self.peers, 4),
                "times_peers": round(self.value / self.peers, 2) if self.peers > 0 else None,
                "signals": {k: round(v, 2) for k, v in self.signals.items()},
                "for_s": round(max(0.0, now - self.since), 1), "remaining_s": round(max(0.0, self.until - now), 1),
                "ejections_in_a_row": self.count}


@dataclass
class _Track:
    streak: int = 0  # evaluations in a row found an outlier
    count: int = 0  # ejections in a row
    back_at: float = -math.inf  # when it last returned (or the count last decayed)
    held: str = ""  # why an outlier was not ejected (the floor), for admin state
    probation: bool = False  # back from an ejection and not yet judged clean on min_samples
    saturated: str = ""  # why an outlier was not ejected (its pool saturated), for admin state


def detector_stats(cfg: OutlierDetection, clock: Callable[[], float] = time.monotonic) -> ReplicaStats:
    """The replica window the detector judges from, as `cfg` sets it (the gateway's and the virtual clock's)."""
    return ReplicaStats(cfg.window_s, recent=cfg.min_samples, clock=clock, lookback_s=cfg.lookback_s)


class LatencyOutliers:
    def __init__(self, cfg: OutlierDetection, stats: ReplicaStats,
                 by_pool: Callable[[], Mapping[str, Sequence[Any]]], *, metrics: Any = None, corrector: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`by_pool`: pool -> its targets (each with `name`, `pool`, `state.ejected`, `state.probe` and `routable(probe=)`);
        `corrector`: the TTFT corrector whose per-replica factor a returning replica sheds."""
        self.cfg = cfg
        self.stats = stats
        self.by_pool = by_pool
        self.metrics = metrics
        self.corrector = corrector
        self.clock = clock
        self.ejections: dict[str, Ejection] = {}  # replica -> its current ejection
        self._track: dict[str, _Track] = {}
        self._gates: dict[str, ProbeGate] = {}  # replica -> its probe gate, while it is open
        # (pool, its targets) -> requests waiting in the gateway for its capacity, on this instance or another
        # (flow control's queue and waits board; set once flow control is built, gateway/app.py): while any
        # wait, the pool is saturated and latency says where the load landed
        self.waiting: Callable[[str, list[str]], int] = lambda pool, targets: 0
        self._saturated: dict[str, tuple[float, int]] = {}  # pool -> when requests last waited for it, how many
        self._last = -math.inf

    # -- reading ---------------------------------------------------------------------------------------------------
    def ejected(self, name: str) -> Ejection | None:
        return self.ejections.get(name)

    def status(self, name: str) -> dict[str, Any]:
        now = self.clock()
        e = self.ejections.get(name)
        tr = self._track.get(name)
        out: dict[str, Any] = {"ejected": e.as_dict(now) if e else None}
        if tr is not None and tr.held and e is None:
            out["held_by_floor"] = tr.held
        if tr is not None and tr.saturated and e is None:
            out["held_by_saturation"] = tr.saturated
        gate = self._gates.get(name)
        if gate is not None:  # back from an ejection, one request at a time
            out["probing"] = {"probes": gate.probes, "in_flight": gate.holder is not None}
        return out

    def attempt_ended(self, name: str, attempt: str) -> None:
        """An attempt on `name` ended (dispatch feedback): a probing replica's slot is free for the next request, once
        its pool is judged with that probe in it (its TTFT and ITL are recorded by now): a slow probe ejects the
        replica before a second request can take the slot, whenever the last evaluation was."""
        gate = self._gates.get(name)
        if gate is None or gate.holder != attempt:
            return
        gate.release(attempt)
        for pool, targets in self.by_pool().items():
            if self.cfg.enabled and any(t.name == name for t in targets):
                self._judge(pool, targets, self.clock())

    # -- evaluating ------------------------------------------------------------------------------------------------
    def tick(self) -> None:
        """Evaluate if `interval_s` has passed since the last evaluation (called on every observation)."""
        if self.cfg.enabled and self.clock() - self._last >= self.cfg.interval_s:
            self.evaluate()

    def evaluate(self) -> None:
        now = self._last = self.clock()
        for pool, targets in self.by_pool().items():
            for t in targets:
                e = self.ejections.get(t.name)
                if e is not None and now >= e.until:
                    self._return(t, e, now)
            self._judge(pool, targets, now)

    def _statistics(self, targets: Sequence[Any]) -> dict[str, dict[str, float]]:
        """reason -> replica -> its statistic, for routable replicas with enough recent observations."""
        out: dict[str, dict[str, float]] = {r: {} for r in REASONS}
        for t in targets:
            if t.name in self.ejections or not t.routable(probe=False):
                continue
            tr = self._track.get(t.name)
            n = self.cfg.probe_samples if tr is not None and tr.probation else self.cfg.min_samples
            # through its probe gate, each request is a client's paying the slowness: judged from the first one
            # (passing still takes probe_samples: `_probed`)
            # a replica its own TTFT correction already calls slow (a run of slow first tokens moves it at once:
            # prediction/ttft.py) is judged from SUSPECT_SAMPLES: routing moves its traffic off it, so waiting for
            # min_samples leaves it unjudged, and the decay of that correction sends it requests again, not one at a
            # time as the probe gate does
            suspect = self.corrector is not None and self.corrector.replica_factor(t.name) >= self.cfg.ttft_factor
            if suspect and t.name not in self._gates:
                n = min(n, SUSPECT_SAMPLES)  # its last few: older ones are from before it slowed
            least = 1 if t.name in self._gates else n
            ttft, itl = self.stats.recent(t.name, n)
            if len(ttft) >= least:
                out["latency_ttft"][t.name] = statistics.median(ttft)
            if len(itl) >= least:
                out["latency_itl"][t.name] = statistics.median(itl)
        return out

    def _judge(self, pool: str, targets: Sequence[Any], now: float) -> None:
        cfg = self.cfg
        if cfg.hold_while_saturated and (waiting := self.waiting(pool, [t.name for t in targets])):
            self._saturated[pool] = (now, waiting)
        factors = {"latency_ttft": cfg.ttft_factor, "latency_itl": cfg.itl_factor}
        worst: tuple[float, Any, str, float, float] | None = None  # (times peers, target, reason, value, peers)
        flagged: dict[str, dict[str, float]] = {}  # replica -> reason -> x its peers
        for reason, values in self._statistics(targets).items():
            if len(values) < cfg.min_hosts:
                continue
            for t in targets:
                v = values.get(t.name)
                if v is None:
                    continue
                peers = statistics.median([x for name, x in values.items() if name != t.name])
                if peers > 0 and v > factors[reason] * peers:
                    flagged.setdefault(t.name, {})[reason] = v / peers
                    if worst is None or v / peers > worst[0]:
                        worst = (v / peers, t, reason, v, peers)
        for t in targets:
            tr = self._track.setdefault(t.name, _Track())
            if t.name in flagged:
                tr.streak += 1
            elif t.name not in self.ejections:
                tr.streak, tr.held, tr.saturated = 0, "", ""
                if t.name in self._gates and self._probed(t.name):
                    self._passed(t)
                if tr.probation and min(map(len, self.stats.recent(t.name, cfg.min_samples))) >= cfg.min_samples:
                    tr.probation = False  # judged clean on a full sample: an ordinary replica again
                if tr.count and now - tr.back_at >= cfg.base_ejection_s:
                    tr.count, tr.back_at = tr.count - 1, now  # well behaved for a while: the next ejection is shorter
        if worst is None:
            return
        _, t, reason, value, peers = worst
        tr = self._track[t.name]
        if tr.streak < (1 if tr.probation else cfg.consecutive):
            return
        at, waiting = self._saturated.get(pool, (-math.inf, 0))
        if cfg.hold_while_saturated and not tr.probation and now - at < cfg.window_s:
            # requests wait (or waited, within the window the statistics cover) in the gateway for this pool's
            # capacity: every replica is as busy as routing can make it, their latencies differ by how the load
            # landed (a rank prefilling long prompts stalls its streams, a full batch decodes slower), and taking
            # one out leaves the same load on fewer; a replica slow itself is still routed around by its own TTFT
            # correction, and one that stalls or errors still ejected
            if not tr.saturated:
                log.info("replica %s of pool %s is a latency outlier (%s %.3g, %.1fx its peers' %.3g) but not "
                         "ejected: %d requests waited in flow control for the pool %.0f s ago", t.name, pool, reason,
                         value, value / peers, peers, waiting, now - at,
                         extra={"event": "replica_ejection_held", "replica": t.name, "pool": pool, "reason": reason,
                                "value": round(value, 4), "peers_median": round(peers, 4), "waiting": waiting,
                                "prefill_load": self._load(t)})
            tr.saturated = f"the pool is saturated: {waiting} requests waited in flow control for it " \
                           f"{now - at:.0f} s ago (latency says where the load landed)"
            return
        allowed = math.floor(len(targets) * cfg.max_ejection_percent / 100)
        if cfg.max_ejection_percent > 0 and len(targets) >= cfg.min_hosts:
            allowed = max(1, allowed)
        out = sum(1 for x in targets if x.name in self.ejections or not x.routable(probe=False))
        if out + 1 > allowed:
            if not tr.held:
                log.warning("replica %s of pool %s is a latency outlier (%s %.3g, %.1fx its peers' %.3g) but not "
                            "ejected: %d of %d replicas are already out of routing (max_ejection_percent %g)",
                            t.name, pool, reason, value, value / peers, peers, out, len(targets),
                            cfg.max_ejection_percent,
                            extra={"event": "replica_ejection_held", "replica": t.name, "pool": pool,
                                   "reason": reason, "out_of_routing": out, "replicas": len(targets)})
            tr.held = f"{out} of {len(targets)} replicas already out of routing (max_ejection_percent " \
                      f"{cfg.max_ejection_percent:g})"
            return
        self._eject(t, reason, value, peers, now, flagged[t.name])

    def _load(self, t: Any) -> dict[str, float]:
        """Its prefill load in the window beside its pool peers' medians (in the ejection's log line: on-call's first
        question, was it busy?)."""
        tokens, queued = self.stats.prefill_load(t.name)
        peers = [self.stats.prefill_load(x.name) for x in self.by_pool().get(t.pool, ()) if x.name != t.name]
        return {"tokens": tokens, "queued_p50": round(queued),
                "peers_tokens": statistics.median([p[0] for p in peers]) if peers else 0,
                "peers_queued_p50": round(statistics.median([p[1] for p in peers])) if peers else 0}

    def _probed(self, name: str) -> bool:
        """Enough evidence through the gate: `probe_samples` TTFTs and ITLs, or — traffic with no streamed latency to
        judge (non-streamed requests) — twice as many probes ended without them."""
        n = self.cfg.probe_samples
        ttft, itl = self.stats.recent(name, n)
        gate = self._gates[name]
        return (len(ttft) >= n and len(itl) >= n) or (gate.probes >= 2 * n and gate.holder is None)

    def _passed(self, t: Any) -> None:
        gate = self._gates.pop(t.name)
        gate.close()
        log.info("replica %s of pool %s passed its probe (%d requests): its full share again", t.name, t.pool,
                 gate.probes, extra={"event": "replica_probe_passed", "replica": t.name, "pool": t.pool,
                                     "probes": gate.probes})

    def _eject(self, t: Any, reason: str, value: float, peers: float, now: float, signals: dict[str, float]) -> None:
        gate = self._gates.pop(t.name, None)
        if gate is not None:
            gate.close()  # out of routing altogether; opened again when this ejection ends
        tr = self._track[t.name]
        tr.count += 1
        tr.streak, tr.held, tr.saturated = 0, "", ""
        length = min(self.cfg.max_ejection_s, self.cfg.base_ejection_s * tr.count)
        e = self.ejections[t.name] = Ejection(t.name, t.pool, reason, value, peers, now, now + length, tr.count,
                                              dict(signals))
        t.state.ejected = True
        if self.metrics is not None:
            self.metrics.ejections.labels(t.pool, t.name, reason).inc()
            self.metrics.replica_ejected.labels(t.pool, t.name).set(1)
        what = "TTFT residual" if reason == "latency_ttft" else "inter-token latency"
        log.warning("replica %s of pool %s ejected for %.0f s: its %s %.3g is %.1fx its peers' median %.3g "
                    "(ejection %d in a row)", t.name, t.pool, length, what, value, value / peers, peers, e.count,
                    extra={"event": "replica_ejected", "replica": t.name, "pool": t.pool, "reason": reason,
                           "value": round(value, 4), "peers_median": round(peers, 4), "ejected_s": length,
                           "signals": {k: round(v, 2) for k, v in signals.items()},
                           "ejections_in_a_row": e.count, "prefill_load": self._load(t)})

    def _return(self, t: Any, e: Ejection, now: float) -> None:
        del self.ejections[t.name]
        t.state.ejected = False
        self.stats.reset(t.name)  # judged again on what it does from now on
        if self.corrector is not None:
            self.corrector.reset_replica(t.name)  # offered its share again: the probe
        tr = self._track.setdefault(t.name, _Track())
        tr.back_at, tr.probation = now, True
        gate = self._gates[t.name] = t.state.probe
        gate.open()  # one request at a time until it has shown it is well
        if self.metrics is not None:
            self.metrics.replica_ejected.labels(t.pool, t.name).set(0)
        log.info("replica %s of pool %s back in routing after %.0f s ejected (%s), probing", t.name, t.pool, now - e.since,
                 e.reason, extra={"event": "replica_returned", "replica": t.name, "pool": t.pool, "reason": e.reason,
                                  "ejected_s": round(now - e.since, 1)})
