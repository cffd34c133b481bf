"""TTFT prediction per replica (pure), and its online correction per pool and per replica.

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
- Per replica: a second EWMA, of observed / (prediction x the pool's correction), multiplies the pool's. A replica
  that runs slower than its peers (a throttled GPU, a noisy neighbour: a gray failure, not dead, just slow) sees its
  own predictions rise within a few dozen of its requests, so the policy's SLA check moves new load off it; the pool's
  correction learns from observed / (prediction x the replica's), so one slow replica does not raise its peers'.
  A replica factor nothing observes decays back towards 1 (half-life `replica_half_life_s`): a replica routing left
  alone is offered traffic again, which is how it shows it has recovered.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
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

SHIFT_AFTER = 3  # free-regime residuals in a row that make a step change in a replica's factor
SHIFT_RATIO = 2.0  # ... each beyond this x its factor (a 6x gray failure is; a healthy replica's residuals are not)


def regime(t: PoolTiming, load: LoadView) -> str:
    return SLOT_WAIT if load.inflight + 1 > t.max_running else FREE


def slot_interval(t: PoolTiming) -> float:
    return (t.expected_output_tokens / t.tokens_per_step) * t.decode_step_s / t.max_running


def predict_ttft(t: PoolTiming, load: LoadView, uncached_tokens: int, correction: float = 1.0) -> float:
    prefill = (load.queued_prefill_tokens + uncached_tokens) / t.prefill_tokens_per_s
    waiting_for_slot = max(0.0, load.inflight + 1 - t.max_running)
    return (t.base_s + prefill + waiting_for_slot * slot_interval(t)) * correction


class TtftCorrector:
    """Per (pool, regime) EWMA of observed/predicted TTFT (mean, and spread when `z` > 0), times a per-replica EWMA
    of what is left (`per_replica`)."""

    def __init__(self, alpha: float = 0.05, lo: float = 0.5, hi: float = 3.0, z: float = 0.0,
                 split_regimes: bool = True, per_replica: bool = True, replica_alpha: float = 0.1,
                 replica_lo: float = 0.5, replica_hi: float = 10.0, replica_half_life_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.alpha = alpha
        self.split_regimes = split_regimes  # False: one correction per pool (the ablation in tests)
        self.lo = lo
        self.hi = hi
        self.z = z
        self.factor: dict[tuple[str, str], float] = {}  # what predictions are multiplied by, per (pool, regime)
        self._mean: dict[tuple[str, str], float] = {}
        self._var: dict[tuple[str, str], float] = {}
        self.per_replica = per_replica
        self.replica_alpha = replica_alpha
        # wider than the pool's clamp: a replica 6x slower than its peers must be able to say so
        self.replica_lo, self.replica_hi = replica_lo, replica_hi
        self.replica_half_life_s = replica_half_life_s
        self.clock = clock
        self._replica: dict[str, tuple[float, float, int]] = {}  # name -> (factor, when last observed, observations)
        self._streak: dict[str, deque[float]] = {}  # name -> its last SHIFT_AFTER free-regime residuals

    def get(self, pool: str, regime_: str = FREE, replica: str | None = None) -> float:
        """What a prediction for this pool in this regime (on this replica) is multiplied by (the regime's prior
        until it is seen)."""
        if not self.split_regimes:
            regime_ = FREE
        f = self.factor.get((pool, regime_), PRIOR[regime_])
        return f * self.replica_factor(replica) if replica is not None else f

    def replica_factor(self, replica: str) -> float:
        """The replica's own factor, decayed towards 1 for the time nothing has observed it."""
        entry = self._replica.get(replica)
        if entry is None or not self.per_replica:
            return 1.0
        factor, at, _ = entry
        age = max(0.0, self.clock() - at)
        return 1.0 + (factor - 1.0) * math.pow(0.5, age / self.replica_half_life_s)

    def replica_observations(self, replica: str) -> int:
        entry = self._replica.get(replica)
        return entry[2] if entry else 0

    def reset_replica(self, replica: str) -> None:
        """Forget what was learned about a replica (it comes back from an ejection on a clean slate)."""
        self._replica.pop(replica, None)
        self._streak.pop(replica, None)

    def observe(self, pool: str, predicted_uncorrected: float, observed: float, regime_: str = FREE,
                replica: str | None = None, alone: bool = False) -> None:
        """`alone`: nothing was queued for prefill on the replica when the request was routed there (its prediction
        was its own prefill only): only such first tokens can make a step change in the replica's factor."""
        if predicted_uncorrected <= 0 or observed <= 0:
            return
        key = (pool, regime_ if self.split_regimes else FREE)
        own = self.replica_factor(replica) if replica is not None else 1.0
        pool_mean = self._mean.get(key, PRIOR[key[1]])  # the mean, not the planning quantile: residuals centre on 1
        ratio = min(self.hi, max(self.lo, observed / (predicted_uncorrected * own)))
        mean = self._mean.get(key, PRIOR[key[1]])
        d = ratio - mean
        mean = min(self.hi, max(self.lo, mean + self.alpha * d))
        var = (1 - self.alpha) * (self._var.get(key, 0.0) + self.alpha * d * d)  # EW variance (West's update)
        self._mean[key], self._var[key] = mean, var
        self.factor[key] = min(self.hi, max(self.lo, mean + self.z * math.sqrt(var)))
        if replica is not None and self.per_replica:
            residual = observed / (predicted_uncorrected * pool_mean)  # what the pool's correction does not explain
            residual = min(self.replica_hi, max(self.replica_lo, residual))
            n = self.replica_observations(replica)
            # in log space: a geometric mean, so the full-batch regime's heavy tail (one wait 5x the model) moves a
            # replica's factor as much as one 5x faster request would, not far more; a replica slow on every
            # request moves it all the same
            f = math.exp(math.log(own) + self.replica_alpha * (math.log(residual) - math.log(own)))
            shifted = self._shift(replica, residual, own, key[1]) if alone else None
            if shifted is not None:
                f = shifted
            self._replica[replica] = (min(self.replica_hi, max(self.replica_lo, f)), self.clock(), n + 1)

    def _shift(self, replica: str, residual: float, own: float, regime_: str) -> float | None:
        """A step change: the replica's last SHIFT_AFTER free-regime residuals all beyond SHIFT_RATIO x its factor
        (or all under it / SHIFT_RATIO) — the factor is then their geometric mean. The EWMA alone needs ~20 requests to
        pass 3x; at a quarter of a request a second per replica that is over a minute of clients paying a 6x slower
        replica. Only the free regime counts, and only first tokens with nothing queued ahead (`alone`): with a full
        batch one wait of 5x the model is ordinary, and behind a queue the residual carries the queue's estimate
        (on the conversation trace at 1.5x its speed on 4 nodes, counting those moved healthy replicas' factors and
        cost 0.3 points within the SLA)."""
        if regime_ != FREE:
            return None
        seen = self._streak.get(replica)
        if seen is None:
            seen = self._streak[replica] = deque(maxlen=SHIFT_AFTER)
        seen.append(residual)
        if len(seen) < SHIFT_AFTER:
            return None
        if all(r > SHIFT_RATIO * own for r in seen) or all(r * SHIFT_RATIO < own for r in seen):
            mean = math.exp(sum(math.log(r) for r in seen) / len(seen))
            seen.clear()  # the next step needs a fresh run of evidence
            return mean
        return None


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
