"""Real-time driver: runs a `Rank` on the asyncio clock, optionally k times faster than real time.

Simulated time = (loop time - t0) x time_scale. Steps are scheduled back to back on absolute deadlines
(a step starts when the previous one was due to end, not when the process got round to it), so timer jitter
does not accumulate; how late each step really completed is measured and reported as lag.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from gateway.background import BackgroundTask
from gateway_lab.sim.engine import Rank


class SimClock:
    def __init__(self, time_scale: float = 1.0) -> None:
        self.time_scale = time_scale
        self._t0 = asyncio.get_running_loop().time()

    def now(self) -> float:
        return (asyncio.get_running_loop().time() - self._t0) * self.time_scale

    def real(self, sim_t: float) -> float:
        return self._t0 + sim_t / self.time_scale

    async def sleep_until(self, sim_t: float) -> None:
        delay = self.real(sim_t) - asyncio.get_running_loop().time()
        # Always yield: at high time scales steps are shorter than the timer resolution, and a rank that never
        # awaited would starve the HTTP side of the same event loop.
        await asyncio.sleep(delay if delay > 0.0005 else 0)

    async def sleep(self, sim_seconds: float) -> None:
        await asyncio.sleep(sim_seconds / self.time_scale)


@dataclass
class LagStats:
    """How well wall time follows the model. For back-to-back forwards, the measured interval between
    completions is compared with the model's duration: `step_time_ratio` = sum measured / sum model (1.0 = the
    simulator neither falls behind nor runs ahead), `mean_step_error` = mean |measured / model - 1| (timer
    jitter), `within_5pct` = share of steps within 5%. Lag = how late a forward completed after its deadline."""

    steps: int = 0
    back_to_back: int = 0
    sum_measured: float = 0.0
    sum_model: float = 0.0
    sum_abs_rel_err: float = 0.0
    within_5pct: int = 0
    max_abs_rel_err: float = 0.0
    last_lag: float = 0.0  # simulated seconds the last step completed after its deadline
    max_lag: float = 0.0
    resyncs: int = 0
    recent_lags: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))

    def record(self, measured: float, model: float) -> None:
        err = abs(measured / model - 1.0)
        self.back_to_back += 1
        self.sum_measured += measured
        self.sum_model += model
        self.sum_abs_rel_err += err
        self.within_5pct += err <= 0.05
        self.max_abs_rel_err = max(self.max_abs_rel_err, err)

    def as_dict(self) -> dict[str, float]:
        n = max(self.back_to_back, 1)
        lags = sorted(self.recent_lags)
        return {
            "steps": self.steps,
            "step_time_ratio": self.sum_measured / self.sum_model if self.sum_model else 1.0,
            "mean_step_error": self.sum_abs_rel_err / n,
            "within_5pct": self.within_5pct / n,
            "max_step_error": self.max_abs_rel_err,
            "p99_lag_s": lags[int(0.99 * (len(lags) - 1))] if lags else 0.0,
            "last_lag_s": self.last_lag,
            "max_lag_s": self.max_lag,
            "resyncs": self.resyncs,
        }


class RealtimeRank:
    RESYNC_LAG = 0.5  # simulated seconds behind schedule before giving up on catching up

    def __init__(self, rank: Rank, clock: SimClock) -> None:
        self.rank = rank
        self.clock = clock
        self.lag = LagStats()
        self.last_output_time = -1.0
        self._wake = asyncio.Event()
        self._bg = BackgroundTask(self._run, f"rank-{self.rank.dp_rank}")

    def start(self) -> None:
        self._bg.start()

    async def stop(self) -> None:
        await self._bg.stop()

    def kick(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock, rank, lag = self.clock, self.rank, self.lag
        cursor: float | None = None  # model end time of the previous step while steps run back to back
        prev_real: float | None = None
        while True:
            now = clock.now()
            start = cursor if cursor is not None and now - cursor < self.RESYNC_LAG else now
            if start is now:
                if cursor is not None:
                    lag.resyncs += 1
                prev_real = None  # not back to back: the interval would include idle time or lag
            step = rank.plan(start)
            if step is None:
                cursor = None
                self._wake.clear()
                await self._wake.wait()
                continue
            end = start + step.duration
            await clock.sleep_until(end)
            done_real = loop.time()
            lag.steps += 1
            lag.last_lag = max(0.0, clock.now() - end)
            lag.max_lag = max(lag.max_lag, lag.last_lag)
            lag.recent_lags.append(lag.last_lag)
            if prev_real is not None and step.duration > 0:
                lag.record((done_real - prev_real) * clock.time_scale, step.duration)
            prev_real = done_real
            cursor = end
            rank.complete(step, end)
            # scheduler output reaches the front end after a decode step or a finished prefill; an intermediate
            # chunk of a long prefill sends nothing (what SGLang's /health waits on)
            if step.kind == "decode" or any(req.done_prefill for req, _ in step.picks):
                self.last_output_time = end
