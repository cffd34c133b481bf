"""What each replica was observed to do, over a sliding window: time to first token (and its residual against the
router's prediction), inter-token latency, and attempt outcomes (ok, error, timeout). Fed by dispatch feedback, read
by the latency outlier detector (`outliers.py`), `/admin/state` and explain. The clock is injected.

`view` summarises the whole window and, apart, the last `recent` observations (what the outlier detector judges: a
replica slowed a few seconds ago still has a window median from before). The residual is observed TTFT / the prediction corrected for the pool (not for the replica itself): how much slower
this replica is than the pool's model says, which is comparable across replicas whatever their load. A stream's
inter-token latency is kept twice: its mean, what the client saw (the window's figures), and its decode share, the
mean without the prefills that cut in between its tokens (`decode_itl`, below), which a replica's load
does not move and its own slowness does (what `recent` gives the outlier detector). Observations are kept per
replica, at most `max_samples` of each kind, so memory is bounded whatever the traffic.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

OUTCOMES = ("ok", "error", "timeout")


@dataclass(frozen=True)
class ReplicaView:
    """One replica's window, summarised (None: nothing observed in the window)."""

    ttft_samples: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_residual_p50: float | None  # observed / predicted (pool-corrected): 1 is as the pool's model says
    itl_samples: int
    itl_p50_s: float | None
    recent_ttft_residual_p50: float | None  # over the last `recent` only: what the outlier detector judges
    recent_itl_p50_s: float | None  # decode steps' share (the outlier detector's), over the last `recent`
    attempts: int
    error_rate: float | None
    timeout_rate: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        return {"ttft_samples": self.ttft_samples, "ttft_p50_s": _r(self.ttft_p50_s, 4),
                "ttft_p95_s": _r(self.ttft_p95_s, 4), "ttft_residual_p50": _r(self.ttft_residual_p50, 3),
                "itl_samples": self.itl_samples, "itl_p50_s": _r(self.itl_p50_s, 5),
                "recent_ttft_residual_p50": _r(self.recent_ttft_residual_p50, 3),
                "recent_itl_p50_s": _r(self.recent_itl_p50_s, 5), "attempts": self.attempts,
                "error_rate": _r(self.error_rate, 4), "timeout_rate": _r(self.timeout_rate, 4)}


def _r(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


@dataclass
class _Window:
    ttft: deque[tuple[float, float, float]]  # (at, observed s, residual)
    itl: deque[tuple[float, float, float]]  # (at, seconds per token, of which the decode steps')
    outcomes: deque[tuple[float, str]] = field(default_factory=deque)
    # (at, uncached prompt tokens sent, prefill tokens queued on it at the decision)
    prefill: deque[tuple[float, int, float]] = field(default_factory=deque)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class ReplicaStats:
    def __init__(self, window_s: float = 20.0, max_samples: int = 512, recent: int = 8,
                 clock: Callable[[], float] = time.monotonic, lookback_s: float = 0.0) -> None:
        self.window_s = window_s
        # `recent` reaches back this far for a replica with fewer than `recent` observations in the window: at a
        # quarter of a request a second a replica never has 8 in 20 s, and one left unjudged keeps its share
        self.lookback_s = max(window_s, lookback_s)
        self.recent_n = recent  # the outlier detector's min_samples: its view of "now"
        self.max_samples = max_samples
        self.clock = clock
        self._w: dict[str, _Window] = {}

    def _window(self, name: str) -> _Window:
        w = self._w.get(name)
        if w is None:
            n = self.max_samples
            w = self._w[name] = _Window(deque(maxlen=n), deque(maxlen=n), deque(maxlen=n), deque(maxlen=n))
        return w

    def ttft(self, name: str, observed_s: float, predicted_s: float) -> None:
        if observed_s <= 0 or predicted_s <= 0:
            return
        self._window(name).ttft.append((self.clock(), observed_s, observed_s / predicted_s))

    def itl(self, name: str, seconds_per_token: float, decode_s: float | None = None) -> None:
        """`decode_s`: the stream's decode share (default: all of it), what `recent` gives the outlier detector."""
        if seconds_per_token > 0:
            d = seconds_per_token if decode_s is None or not 0 < decode_s <= seconds_per_token else decode_s
            self._window(name).itl.append((self.clock(), seconds_per_token, d))

    def prefill(self, name: str, tokens: int, queued: float = 0.0) -> None:
        """A request sent with `tokens` uncached prompt tokens, `queued` prefill tokens ahead of it (the router's
        view at the decision): prefill the replica runs ahead of its decode steps."""
        self._window(name).prefill.append((self.clock(), max(0, tokens), max(0.0, queued)))

    def prefill_load(self, name: str) -> tuple[int, float]:
        """Uncached prompt tokens sent to the replica within the window (of the last `max_samples` requests), and
        the median of the prefill queued on it at their decisions."""
        w = self._w.get(name)
        if w is None:
            return 0, 0.0
        self._trim(w)
        cut = self.clock() - self.window_s
        sent = [x for x in w.prefill if x[0] >= cut]
        return sum(x[1] for x in sent), statistics.median([x[2] for x in sent]) if sent else 0.0

    def outcome(self, name: str, kind: str) -> None:
        """`kind`: ok | error | timeout (one attempt's end, as far as the replica is concerned)."""
        self._window(name).outcomes.append((self.clock(), kind))

    def reset(self, name: str) -> None:
        """Forget a replica's window (it comes back from an ejection and is judged on fresh evidence)."""
        self._w.pop(name, None)

    def _trim(self, w: _Window) -> None:
        cut = self.clock() - self.lookback_s
        for dq in (w.ttft, w.itl, w.outcomes, w.prefill):
            while dq and dq[0][0] < cut:
                dq.popleft()

    def recent(self, name: str, n: int) -> tuple[list[float], list[float]]:
        """The last `n` TTFT residuals and decode inter-token latencies within the lookback (fewer if fewer were seen):
        those of the window, or older ones as far back as `lookback_s` where the window holds fewer than `n`."""
        w = self._w.get(name)
        if w is None:
            return [], []
        self._trim(w)
        return [x[2] for x in list(w.ttft)[-n:]], [x[2] for x in list(w.itl)[-n:]]

    def view(self, name: str) -> ReplicaView:
        w = self._w.get(name)
        if w is None:
            return ReplicaView(0, None, None, None, 0, None, None, None, 0, None, None)
        self._trim(w)
        cut = self.clock() - self.window_s  # the summaries are of the window; only `recent` looks further back
        ttft = [x for x in w.ttft if x[0] >= cut]
        ttfts = [x[1] for x in ttft]
        residuals = [x[2] for x in ttft]
        itl_w = [x for x in w.itl if x[0] >= cut]
        itls = [x[1] for x in itl_w]
        kinds = [x[1] for x in w.outcomes if x[0] >= cut]
        n = len(kinds)
        recent_res, recent_itl = residuals[-self.recent_n:], [x[2] for x in itl_w[-self.recent_n:]]
        return ReplicaView(
            len(ttfts), statistics.median(ttfts) if ttfts else None, _quantile(ttfts, 0.95) if ttfts else None,
            statistics.median(residuals) if residuals else None, len(itls), statistics.median(itls) if itls else None,
            statistics.median(recent_res) if recent_res else None, statistics.median(recent_itl) if recent_itl else None,
            n, kinds.count("error") / n if n else None, kinds.count("timeout") / n if n else None)


def decode_itl(mean: float, gaps: Sequence[float] | None, burst_s: float = 0.0) -> float:
    """The part of a stream's mean inter-token latency that is the replica's decode speed: the mean scaled by its
    typical decode step over its mean read spacing. An engine runs queued prefill before its next decode step
    (SGLang: strictly), so on a busy healthy replica many of a stream's gaps hold whole prefills and the mean (even
    the median gap, once prefills follow each other) rises with the load, while the gaps between prefills are still
    one decode step each: the first quartile of the gaps is that step. A replica slow itself makes every step slow,
    the quartile with them. Gaps under `burst_s` (no engine step is that short: tokens that reached the gateway
    together) are left out, as is a stream with fewer than 4 gaps left (its mean is all there is). The latency
    outlier detector judges this, so a busy replica is not ejected for the prefills it was sent
    (docs/on-call-replicas.md)."""
    if not gaps:
        return mean
    steps = sorted(g for g in gaps if g >= burst_s)
    avg = sum(gaps) / len(gaps)
    if len(steps) < 4 or avg <= 0:
        return mean
    return mean * min(1.0, steps[len(steps) // 4] / avg)


def judged_itl(mean: float, gaps: Sequence[float] | None, decode_step_s: float, tokens_per_step: float) -> float | None:
    """What the outlier detector judges of a stream on a pool whose model decodes a full batch in `decode_step_s`,
    `tokens_per_step` tokens a step: its decode share, gaps under a tenth of that step left out (no engine step is
    shorter; at one request it is about a third); None for a stream faster than a tenth of the model's decode (its
    tokens reached the gateway in a burst, the first one seen late), which says nothing of the replica's speed."""
    decode = decode_itl(mean, gaps, decode_step_s / 10)
    return decode if decode >= decode_step_s / tokens_per_step / 10 else None
