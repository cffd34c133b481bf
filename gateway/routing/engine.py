"""The routing engine: the decision and the feedback rules as one synchronous core, with no I/O.

Both the gateway (`routing/pipeline.py` for the decision, `dispatch/feedback.py` for the feedback) and the
virtual-clock fleet (`sim/fleet.py`, behind `gateway replay`) call this one object, so a replay measures the shipped
code, not a copy of it.

- `decide(req, targets, matches, loads)`: features -> policy -> Decision (every candidate's features kept).
- `prefill_level(attempt)`: what the request adds to its tenant class's priority on the chosen target, so engines
  that schedule by priority prefill short (cached) requests before long cold ones (`routing.shortest_prefill_first`).
- Feedback: `dispatched`, `first_token`, `usage`, `finished` take an `Attempt` and return the state changes as
  values (`IndexWrite`, `IndexDrop`, `LoadDelta`). The caller applies them: the gateway to Redis or memory
  (async), the fleet to its in-memory index and loads (sync). The one piece of state the engine holds itself is the
  TTFT corrector, which is per process in the gateway too.

The rules (see docs/routing.md): at dispatch a speculative index entry (`speculative_ttl_s`) and the uncached
tokens as queued prefill; at the first token the entry is confirmed for `residency_ttl_s`, the prefill load is
released and the observed TTFT teaches the corrector; when the engine reports more than a chunk fewer cached
tokens than predicted the entries beyond the real hit are dropped (`correct`); an attempt that fails before its
first token withdraws what it speculatively wrote beyond what the replica already held (`withdraw`).
Only targets with a prefix cache the gateway tracks (`TargetInfo.prefix_cache`) get index entries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gateway.prediction.ttft import FREE, LoadView, QueueDrain, TtftCorrector
from gateway.routing.decision import Decision
from gateway.routing.features import Candidate, R, TargetInfo, build_candidates
from gateway.routing.policy import Policy
from gateway.routing.request import RoutingRequest


@dataclass(frozen=True, slots=True)
class IndexWrite:
    replica: str  # index key (name@incarnation)
    hashes: tuple[int, ...]
    ttl: float


@dataclass(frozen=True, slots=True)
class IndexDrop:
    replica: str
    hashes: tuple[int, ...]
    reason: str  # correct (engine reported fewer cached tokens) | withdraw (failed before the first token)


@dataclass(frozen=True, slots=True)
class LoadDelta:
    replica: str  # target name
    prefill_tokens: float
    requests: float


Effect = IndexWrite | IndexDrop | LoadDelta


class Named(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def pool(self) -> str: ...


class Attempt:
    """One dispatch of a request to one target, with the features it was chosen on."""

    def __init__(self, req: RoutingRequest, target: Named, decision: Decision[Any]) -> None:
        self.req = req
        cand: Candidate[Any] | None = decision.features.get(target.name)
        self.info: TargetInfo[Any] | None = cand.info if cand else None
        self.name: str = target.name
        self.pool: str = target.pool
        self.key: str = cand.info.key if cand else getattr(target, "index_key", target.name)
        self.indexed = bool(cand and cand.info.prefix_cache and req.hashes)
        self.predicted_cached = cand.cached_tokens if cand else 0
        self.matched_chunks = cand.matched_chunks if cand else 0
        self.uncached = cand.uncached_tokens if cand else req.prompt_tokens
        self.ttft_raw = cand.ttft_raw if cand else 0.0
        self.ttft = cand.ttft if cand else 0.0
        self.regime = cand.regime if cand else FREE
        self.queued_prefill = cand.load.queued_prefill_tokens if cand else 0.0  # on the target, at the decision
        self.prefill_open = False
        self.open = False
        # when the request went to the target (monotonic; 0 until the dispatcher sends it): what the engine took is
        # measured from here, not from the request's arrival — a wait in the gateway (flow control's queue, a large
        # body's front half, an earlier failed attempt) is not the target's, and its prediction did not include it
        self.sent_at = 0.0


class RoutingEngine:
    def __init__(self, policy: Policy, *, uses_prefix: bool, chunk_tokens: int,
                 corrector: TtftCorrector, speculative_ttl_s: float, residency_ttl_s: float,
                 queue_drain: bool = False, shortest_prefill_first: bool = False) -> None:
        self.policy = policy
        self.uses_prefix = uses_prefix  # False: the policy ignores prefixes, so callers may skip the lookup
        self.chunk_tokens = chunk_tokens
        self.corrector = corrector
        self.speculative_ttl_s = speculative_ttl_s
        self.residency_ttl_s = residency_ttl_s
        self.drain = QueueDrain() if queue_drain else None
        self.shortest_prefill_first = shortest_prefill_first

    # -- the decision ------------------------------------------------------------------------------------------
    def decide(self, req: RoutingRequest, targets: Sequence[TargetInfo[R]], matches: Mapping[str, int],
               loads: Mapping[str, LoadView], now: float | None = None,
               engine_loads: Mapping[str, LoadView | None] | None = None) -> Decision[R]:
        """`matches`: index key -> matched chunks; `loads`: target name -> the gateways' tracked load; `now`: the
        caller's clock (the queue's done part is estimated from it; None: taken as tracked); `engine_loads`: the
        engines' own gauges, a floor under the estimate."""
        views = {}
        for t in targets:
            v = loads.get(t.name, LoadView())
            if self.drain is not None and now is not None:
                v = self.drain.remaining(t.name, t.timing, v, now)
            views[t.name] = merged_load(v, engine_loads.get(t.name) if engine_loads else None)
        cands = build_candidates(req, targets, matches if self.uses_prefix else {}, views, self.corrector.get,
                                 self.chunk_tokens)
        decision = self.policy(req, cands)
        if len(decision.features) < len(cands):  # keep every candidate's features for feedback and explain
            decision = replace(decision, features={c.name: c for c in cands})
        return decision

    # -- the engine's queue order ------------------------------------------------------------------------------
    def prefill_level(self, a: Attempt) -> int:
        """What the request adds to its tenant class's priority on this target (`routing.shortest_prefill_first`):
        SGLang with priority scheduling prefills its waiting queue by priority, so a cached turn that adds a few
        hundred tokens need not wait for the long cold prompts queued before it (one already being prefilled in chunks
        still finishes first). 0 where the target's queued prefill is past FAIR_AFTER_SLAS x the request's SLA: an
        overloaded replica stays first come, first served, or short requests arriving without pause would starve the
        long ones (the agent sessions at 2x: p95 35 s instead of 14 s)."""
        if not self.shortest_prefill_first or a.info is None or not a.info.self_hosted:
            return 0
        if a.queued_prefill / a.info.timing.prefill_tokens_per_s > FAIR_AFTER_SLAS * a.req.ttft_sla_s:
            return 0
        return prefill_level(a.uncached)

    # -- feedback ----------------------------------------------------------------------------------------------
    def dispatched(self, a: Attempt) -> list[Effect]:
        a.open = a.prefill_open = True
        out: list[Effect] = [LoadDelta(a.name, a.uncached, 1)]
        if a.indexed:
            out.append(IndexWrite(a.key, tuple(a.req.hashes), self.speculative_ttl_s))
        return out

    def first_token(self, a: Attempt, observed_ttft: float | None) -> list[Effect]:
        out: list[Effect] = []
        if a.prefill_open:
            a.prefill_open = False
            out.append(LoadDelta(a.name, -a.uncached, 0))
        if a.indexed:
            out.append(IndexWrite(a.key, tuple(a.req.hashes), self.residency_ttl_s))
        if observed_ttft is not None and a.ttft_raw > 0:
            self.corrector.observe(a.pool, a.ttft_raw, observed_ttft, a.regime, a.name, alone=a.queued_prefill <= 0)
        return out

    def usage(self, a: Attempt, reported_cached: int | None) -> list[Effect]:
        if reported_cached is None or not a.indexed or reported_cached >= a.predicted_cached - self.chunk_tokens:
            return []
        real_chunks = reported_cached // self.chunk_tokens
        return [IndexDrop(a.key, tuple(a.req.hashes[real_chunks:a.matched_chunks]), "correct")]

    def finished(self, a: Attempt, failed: bool = False) -> list[Effect]:
        out: list[Effect] = []
        before_first_token = a.prefill_open
        if a.prefill_open:
            a.prefill_open = False
            out.append(LoadDelta(a.name, -a.uncached, 0))
        if a.open:
            a.open = False
            out.append(LoadDelta(a.name, 0, -1))
        if failed and before_first_token and a.indexed:
            # the replica never prefilled this prompt: withdraw the speculative entries beyond what it held
            out.append(IndexDrop(a.key, tuple(a.req.hashes[a.matched_chunks:]), "withdraw"))
        return out


PREFILL_LEVELS = 9  # within a class: 0..9, below SGLang's default preemption threshold (10) and the classes' spacing
FAIR_AFTER_SLAS = 2.0  # queued prefill (in seconds, x the request's SLA) past which a replica keeps arrival order


def prefill_level(uncached_tokens: int) -> int:
    """9 for <= 256 uncached tokens, one less per doubling, 0 from 128k. Levels of one class differ by at most 9, so
    they reorder the queue but never preempt a running request (SGLang preempts for a difference above 10)."""
    if uncached_tokens <= 256:
        return PREFILL_LEVELS
    return max(0, PREFILL_LEVELS + 8 - (uncached_tokens - 1).bit_length())


def merged_load(tracked: LoadView, engine: LoadView | None) -> LoadView:
    """The gateways' count, floored by the engine's own gauges (which lag, but see traffic from anywhere)."""
    if engine is None:
        return tracked
    return LoadView(max(tracked.queued_prefill_tokens, engine.queued_prefill_tokens), max(tracked.inflight, engine.inflight))
