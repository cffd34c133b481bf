"""TTFT prediction per replica (pure), and its online correction per pool.

    TTFT = (base + (queued prefill tokens + this request's uncached tokens) / prefill rate + slot wait) x correction

- Prefill is strictly FCFS ahead of decode in SGLang, so a request waits for every uncached token queued before it.
- Slot wait: past `max_running` in-flight requests, a new one waits for running requests to finish; at a full
  batch one frees every (expected output / tokens per step) x decode step / max_running seconds on average — the
  knee that sets the node's ceiling (spec 6.3, step 3).
- The correction is an EWMA of observed / predicted, per pool, clamped, so a pool that runs slower or faster
  than configured is learned from its own traffic.
"""

from __future__ import annotations

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
    """Per-pool EWMA of observed/predicted TTFT."""

    def __init__(self, alpha: float = 0.05, lo: float = 0.5, hi: float = 3.0) -> None:
        self.alpha = alpha
        self.lo = lo
        self.hi = hi
        self.factor: dict[str, float] = {}

    def get(self, pool: str) -> float:
        return self.factor.get(pool, 1.0)

    def observe(self, pool: str, predicted_uncorrected: float, observed: float) -> None:
        if predicted_uncorrected <= 0 or observed <= 0:
            return
        ratio = min(self.hi, max(self.lo, observed / predicted_uncorrected))
        cur = self.factor.get(pool, 1.0)
        self.factor[pool] = min(self.hi, max(self.lo, cur + self.alpha * (ratio - cur)))
