"""The spec's measurement rules (6.4), one definition for the load runner and the virtual-clock experiments."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile by nearest rank over already sorted values (nan when empty)."""
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def window_throughput(arrivals: Iterable[float], finishes: Iterable[tuple[float, int]]) -> float:
    """Output tokens of requests finishing between the 10th- and 90th-percentile arrival times, per second of that
    window. `finishes`: (end time, output tokens) of completed requests."""
    arr = sorted(arrivals)
    lo, hi = arr[len(arr) // 10], arr[len(arr) * 9 // 10]
    if hi <= lo:
        return float("nan")
    return sum(tokens for end, tokens in finishes if lo <= end <= hi) / (hi - lo)
