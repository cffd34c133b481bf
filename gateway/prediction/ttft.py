"""TTFT prediction per replica (pure), and its online correction per pool.

    TTFT = (base + (queued prefill tokens + this request's uncached tokens) / prefill rate + slot wait) x correction

- Prefill is strictly FCFS ahead of decode in SGLang, so a request waits for every uncached token queued before it.
- Slot wait: past `max_running` in-flight requests, a new one waits for running requests to finish; at a full
  batch one frees every (expected output / tokens per step) x decode step / max_running seconds on average — the
  knee that sets the node's ceiling (spec 6.3, step 3).
- The correction is an EWMA of observed / predicted, per pool, clamped, so a pool that runs slower or faster
  than configured is learned from its own traffic. With `z` > 0 it is the EWMA mean plus z EWMA standard
  deviations of that ratio: a request is then planned against an upper quantile of its TTFT (z 1.65 ≈ its p95,
  what a p95 SLA promises) rather than its mean — near the knee, where TTFT spreads, spill starts earlier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.config import PoolTiming


@dataclass(frozen=True)
class LoadView:
    queued_prefill_tokens: float = 0.0  # uncached tokens dispatched to the replica and not yet at first token
    inflight: float = 0.0  # requests dispatched and not finished


def slot_interval(t: PoolTiming) -> float:
    return (t.expected_output_tokens / t.tokens_per_step) * t.decode_step_s / t.max_running


def predict_ttft(t: PoolTiming, load: LoadView, uncached_tokens: int, correction: float = 1.0) -> float:
    prefill = (load.queued_prefill_tokens + uncached_tokens) / t.prefill_tokens_per_s
    waiting_for_slot = max(0.0, load.inflight + 1 - t.max_running)
    return (t.base_s + prefill + waiting_for_slot * slot_interval(t)) * correction


class TtftCorrector:
    """Per-pool EWMA of observed/predicted TTFT (mean, and spread when `z` > 0)."""

    def __init__(self, alpha: float = 0.05, lo: float = 0.5, hi: float = 3.0, z: float = 0.0) -> None:
        self.alpha = alpha
        self.lo = lo
        self.hi = hi
        self.z = z
        self.factor: dict[str, float] = {}  # what predictions are multiplied by
        self._mean: dict[str, float] = {}
        self._var: dict[str, float] = {}

    def get(self, pool: str) -> float:
        return self.factor.get(pool, 1.0)

    def observe(self, pool: str, predicted_uncorrected: float, observed: float) -> None:
        if predicted_uncorrected <= 0 or observed <= 0:
            return
        ratio = min(self.hi, max(self.lo, observed / predicted_uncorrected))
        mean = self._mean.get(pool, 1.0)
        d = ratio - mean
        mean = min(self.hi, max(self.lo, mean + self.alpha * d))
        var = (1 - self.alpha) * (self._var.get(pool, 0.0) + self.alpha * d * d)  # EW variance (West's update)
        self._mean[pool], self._var[pool] = mean, var
        self.factor[pool] = min(self.hi, max(self.lo, mean + self.z * math.sqrt(var)))
