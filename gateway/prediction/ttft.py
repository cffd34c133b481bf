"""TTFT prediction per replica (pure), and its online correction per pool.

    TTFT = (base + (queued prefill tokens + this request's uncached tokens) / prefill rate + slot wait) x correction

- Prefill is strictly FCFS ahead of decode in SGLang, so a request waits for every uncached token queued before it.
- Slot wait: past `max_running` in-flight requests, a new one waits for running requests to finish; at a full
  batch one frees every (expected output / tokens per step) x decode step / max_running seconds on average — the
  knee that sets the node's ceiling (spec 6.3, step 3).
- The correction is an EWMA of observed / predicted, per pool and load regime, clamped, so a pool that runs slower
  or faster than configured is learned from its own traffic. With `z` > 0 it is the EWMA mean plus z EWMA standard
  deviations of that ratio: a request is then planned against an upper quantile of its TTFT (z 1.65 ≈ its p95,
  what a p95 SLA promises) rather than its mean — near the knee, where TTFT spreads, spill starts earlier.
- Regimes: with a free running slot the model is close (FCFS prefill is exactly the queued tokens); once the batch
  is full the wait depends on when running requests finish, which the model knows only on average (measured on the
  virtual clock at 1.5x load: observed/predicted p95 1.3 with a free slot, 5.6 without). One correction for both
  would either miss the SLA when full or spill needlessly when not, so each regime learns its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.settings.pools import PoolTiming


@dataclass(frozen=True)
class LoadView:
    queued_prefill_tokens: float = 0.0  # uncached tokens dispatched to the replica and not yet at first token
    inflight: float = 0.0  # requests dispatched and not finished


FREE, SLOT_WAIT = "free", "slot_wait"


# Until a pool has shown how it does with a full batch, assume the worst the clamp allows: a request sent there would
# otherwise be planned on the free-slot factor and miss (16 of 16 such dispatches on the virtual clock at 1.5x).
PRIOR = {FREE: 1.0, SLOT_WAIT: 3.0}


def regime(t: PoolTiming, load: LoadView) -> str:
    return SLOT_WAIT if load.inflight + 1 > t.max_running else FREE


def slot_interval(t: PoolTiming) -> float:
    return (t.expected_output_tokens / t.tokens_per_step) * t.decode_step_s / t.max_running


def predict_ttft(t: PoolTiming, load: LoadView, uncached_tokens: int, correction: float = 1.0) -> float:
    prefill = (load.queued_prefill_tokens + uncached_tokens) / t.prefill_tokens_per_s
    waiting_for_slot = max(0.0, load.inflight + 1 - t.max_running)
    return (t.base_s + prefill + waiting_for_slot * slot_interval(t)) * correction


class TtftCorrector:
    """Per (pool, regime) EWMA of observed/predicted TTFT (mean, and spread when `z` > 0)."""

    def __init__(self, alpha: float = 0.05, lo: float = 0.5, hi: float = 3.0, z: float = 0.0,
                 split_regimes: bool = True) -> None:
        self.alpha = alpha
        self.split_regimes = split_regimes  # False: one correction per pool (the ablation in tests)
        self.lo = lo
        self.hi = hi
        self.z = z
        self.factor: dict[tuple[str, str], float] = {}  # what predictions are multiplied by, per (pool, regime)
        self._mean: dict[tuple[str, str], float] = {}
        self._var: dict[tuple[str, str], float] = {}

    def get(self, pool: str, regime_: str = FREE) -> float:
        """What a prediction for this pool in this regime is multiplied by (the regime's prior until it is seen)."""
        if not self.split_regimes:
            regime_ = FREE
        return self.factor.get((pool, regime_), PRIOR[regime_])

    def observe(self, pool: str, predicted_uncorrected: float, observed: float, regime_: str = FREE) -> None:
        if predicted_uncorrected <= 0 or observed <= 0:
            return
        key = (pool, regime_ if self.split_regimes else FREE)
        ratio = min(self.hi, max(self.lo, observed / predicted_uncorrected))
        mean = self._mean.get(key, PRIOR[key[1]])
        d = ratio - mean
        mean = min(self.hi, max(self.lo, mean + self.alpha * d))
        var = (1 - self.alpha) * (self._var.get(key, 0.0) + self.alpha * d * d)  # EW variance (West's update)
        self._mean[key], self._var[key] = mean, var
        self.factor[key] = min(self.hi, max(self.lo, mean + self.z * math.sqrt(var)))


DRAIN_SHARE = 0.5  # of the prefill rate: long contexts prefill slower, and co-batched requests finish together
DRAIN_BELOW = 1 / 8  # of max_running in flight: past it nothing is credited


class QueueDrain:
    """How much of each replica's tracked prefill queue is already done (stateful, clock passed in); opt-in
    (`routing.queue_drain`).

    The tracked queue counts a request's uncached tokens until its first token, so a 60k-token prompt that is 80%
    prefilled still counts in full: on the conversation trace the warm replica a request left had a tracked queue
    ~1.4x its real remaining work (38k vs 26k tokens at the median), enough to call it infeasible and lose the hit.
    SGLang prefills FCFS and without pause while work is queued and a slot is free, so the done part grows at a share
    of the prefill rate while the replica has work and few requests in flight; a drop in the tracked queue (a first
    token, from any gateway) removes done tokens first. Off by default: near capacity without a spill pool it makes
    the fleet bistable (docs/routing.md: the Wafer workload on 4 nodes at 0.95x, 3 of 8 seeds tip into overload).
    """

    def __init__(self) -> None:
        self._state: dict[str, tuple[float, float, float, bool]] = {}  # name -> (done, tracked queue, at, draining)

    def remaining(self, name: str, t: PoolTiming, load: LoadView, now: float) -> LoadView:
        q = load.queued_prefill_tokens
        done, last_q, at, draining = self._state.get(name, (0.0, q, now, False))
        done = max(0.0, done - max(0.0, last_q - q))  # released tokens were the first in line
        if q <= 0:
            done = 0.0
        elif draining:  # it was prefilling since `at`; otherwise the start is unknown: credit none
            done = min(q, done + DRAIN_SHARE * t.prefill_tokens_per_s * max(0.0, now - at))
        self._state[name] = (done, q, now, q > 0 and load.inflight < t.max_running * DRAIN_BELOW)
        return LoadView(q - done, load.inflight)
