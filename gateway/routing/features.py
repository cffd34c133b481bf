"""Per-candidate features, computed once before the policy runs (pure): predicted cached tokens from the prefix
match, load, predicted TTFT and the request's cost on that target. Policies only read these."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from gateway.prediction.pricing import request_cost
from gateway.prediction.ttft import FREE, LoadView, predict_ttft, regime
from gateway.routing.request import RoutingRequest
from gateway.settings.pools import GpuHourPricing, PerTokenPricing, PoolTiming

R = TypeVar("R")  # what the caller routes to: the gateway's Target; the virtual-clock fleet's own handle (or None)


@dataclass(frozen=True)
class TargetInfo(Generic[R]):
    """What the pure core needs to know about a target (the gateway builds it from upstreams.Target)."""

    name: str
    key: str  # index key: name@incarnation
    pool: str
    timing: PoolTiming
    pricing: PerTokenPricing | GpuHourPricing | None
    ref: R  # the caller's handle on the target, handed back in the decision (opaque here)
    weight: float = 1.0  # on-call preference: routing cost is divided by it (billing is not)
    prefix_cache: bool = True  # the gateway tracks its prefix cache (self-hosted engines; hosted APIs are opaque)

    @property
    def self_hosted(self) -> bool:
        return not isinstance(self.pricing, PerTokenPricing)


@dataclass(frozen=True)
class Candidate(Generic[R]):
    info: TargetInfo[R]
    matched_chunks: int
    cached_tokens: int
    uncached_tokens: int
    load: LoadView
    ttft: float
    ttft_raw: float
    cost: float
    regime: str = FREE  # prediction/ttft.regime at decision time: which correction applied and learns
    # the replica's own TTFT correction, what its pool's does not explain: ~1 for a healthy replica, ~6 for one whose
    # forwards run 6x slower (a gray failure); the policy leaves such a replica however warm it is
    slowness: float = 1.0

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def pool(self) -> str:
        return self.info.pool

    @property
    def self_hosted(self) -> bool:
        return self.info.self_hosted

    def explain(self) -> dict[str, Any]:
        return {"replica": self.name, "pool": self.info.pool, "cached_tokens": self.cached_tokens,
                "queued_prefill_tokens": round(self.load.queued_prefill_tokens), "inflight": round(self.load.inflight, 1),
                "regime": self.regime, "predicted_ttft_s": round(self.ttft, 3),
                "ttft_correction": round(self.ttft / self.ttft_raw, 3) if self.ttft_raw > 0 else None,
                "replica_slowness": round(self.slowness, 3),
                "cost_usd": round(self.cost, 8)}


def build_candidates(req: RoutingRequest, targets: Sequence[TargetInfo[R]], matches: Mapping[str, int],
                     loads: Mapping[str, LoadView], correction: Callable[[str, str, str | None], float],
                     chunk_tokens: int) -> list[Candidate[R]]:
    """`correction(pool, regime, replica)`: what a prediction is multiplied by on that replica (replica None: the
    pool's alone)."""
    out: list[Candidate[R]] = []
    expected_out = req.max_output_tokens
    pooled: dict[tuple[str, str], float] = {}  # (pool, regime) -> the pool's correction: one lookup, not one each
    for t in targets:
        chunks = matches.get(t.key, 0)
        cached = min(chunks * chunk_tokens, max(req.prompt_tokens - 1, 0))
        uncached = req.prompt_tokens - cached
        load = loads.get(t.name, LoadView())
        raw = predict_ttft(t.timing, load, uncached)
        reg = regime(t.timing, load)
        out_tokens = expected_out if expected_out is not None else t.timing.expected_output_tokens
        pool = pooled.get((t.pool, reg))
        if pool is None:
            pool = pooled[(t.pool, reg)] = correction(t.pool, reg, None)
        own = correction(t.pool, reg, t.name)
        out.append(Candidate(t, chunks, cached, uncached, load, raw * own, raw,
                             request_cost(t.pricing, req.prompt_tokens, cached, out_tokens) / max(t.weight, 1e-9), reg,
                             own / pool if pool > 0 else 1.0))
    return out
