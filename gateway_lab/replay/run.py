"""Replay a trace through the shipped routing engine on the virtual clock (`sim/fleet.py`), and summarize it.

A trace record becomes what the gateway and the engine would see: the router gets chunk hashes at the gateway's
`chunk_tokens` (chunk j of block b is keyed by (block id, offset), so equal block ids give equal chunk hashes exactly
where the trace says the prompts share KV), the cold-placement group key the gateway derives from them, the
prompt length and the SLA; the simulated engine gets page keys at its own page size built the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.config import GatewayConfig, Routing
from gateway.flow.settings import FlowControl
from gateway.prefix.hashing import MAX_CHUNKS, group_key
from gateway.recording.trace import BLOCK_TOKENS, TraceRecord
from gateway.routing.features import TargetInfo
from gateway.routing.request import RoutingRequest
from gateway_lab.replay.bounds import ideal_hit_rate, lru_hit_rate
from gateway_lab.sim.fleet import Fleet, Job, Record, cost_usd, mi355x_targets
from gateway_lab.sim.profiles import ReplicaConfig, profile
from gateway_lab.sim.stats import nearest_rank


def _keys(r: TraceRecord, unit: int, n: int, salt: int) -> list[int]:
    """Chain keys for the first n units of `unit` tokens: the block holding the unit's last token, and the offset."""
    ids = r.hash_ids
    return [hash((salt, ids[((j + 1) * unit - 1) // BLOCK_TOKENS], ((j + 1) * unit - 1) % BLOCK_TOKENS))
            for j in range(n)]


def to_job(r: TraceRecord, i: int, chunk_tokens: int, page_size: int, sla_s: float, model: str = "glm-5.2") -> Job:
    n_chunks = min(r.input_length // chunk_tokens, MAX_CHUNKS)
    hashes = tuple(_keys(r, chunk_tokens, n_chunks, 1))
    req_id = f"t{i}"
    req = RoutingRequest(req_id, f"tenant-{r.tenant}", model, "chat/completions", True, r.input_length, None, hashes,
                         sla_s, "cost", "spill", group_key(hashes, hash(req_id)))
    return Job(req, _keys(r, page_size, r.input_length // page_size, 2), r.input_length, r.output_length)


def targets_from_config(cfg: GatewayConfig, model: str | None = None) -> list[tuple[TargetInfo[Any], ReplicaConfig]]:
    """The model's targets as the gateway builds them (registry -> target_info): SGLang replicas simulated as MI355X
    TP4 ranks, hosted endpoints as B200 replicas."""
    from gateway.routing.pipeline import target_info
    from gateway.upstreams import UpstreamRegistry

    route = next((m for m in cfg.models if model is None or m.name == model), None)
    if route is None:
        raise ValueError(f"model {model!r} is not in the config (models: {[m.name for m in cfg.models]})")
    reg = UpstreamRegistry(cfg, keys={p.name: None for p in cfg.pools})  # nothing is called: no API keys needed
    mi, b2 = profile("mi355x-glm52-tp4"), profile("b200-glm52")
    return [(target_info(t), mi if t.caps.self_hosted else b2) for pool in route.pools for t in reg.by_pool.get(pool, [])]


@dataclass
class ReplayResult:
    label: str
    requests: int
    hit_rate: float
    ideal_hit_rate: float
    lru_hit_rate: float
    ttft_mean: float
    ttft_p50: float
    ttft_p95: float
    ttft_p99: float
    slowdown_p95: float
    within_sla: float
    spill: float
    usd_per_mtok_out: float
    shed: int
    branches: dict[str, dict[str, float]] = field(default_factory=dict)
    sim_seconds: float = 0.0
    # per minute of arrivals: [start s, requests, prompt, predicted cached, realized cached, best candidate held]
    timeline: list[list[float]] = field(default_factory=list)
    tail: dict[str, Any] = field(default_factory=dict)  # tail_summary(): what the requests over p95 waited for
    corrections: int = 0  # engine-reported cached tokens below the index's prediction (the entries were dropped)

    def row(self) -> list[Any]:
        return [self.label, self.requests, f"{self.hit_rate * 100:.1f}%", f"{self.lru_hit_rate * 100:.1f}%",
                f"{self.hit_rate / self.lru_hit_rate * 100:.0f}%" if self.lru_hit_rate else "-",
                f"{self.ttft_mean:.2f}", f"{self.ttft_p50:.2f}", f"{self.ttft_p95:.2f}", f"{self.ttft_p99:.2f}",
                f"{self.slowdown_p95:.2f}", f"{self.within_sla * 100:.1f}%", f"{self.spill * 100:.1f}%",
                f"{self.usd_per_mtok_out:.3f}", self.corrections]


HEADERS = ["run", "requests", "hit", "LRU bound", "of bound", "TTFT mean", "p50", "p95", "p99", "slowdown p95",
           "within SLA", "spill", "$/Mtok out", "index corrections"]


def replay(trace: Sequence[TraceRecord], targets: Sequence[tuple[TargetInfo[Any], ReplicaConfig]], routing: Routing,
           *, instances: int = 1, shared: bool = True, speed: float = 1.0, label: str | None = None,
           progress: Callable[[], None] | None = None, fleet_hook: Callable[[Fleet], None] | None = None,
           bounds: tuple[float, float] | None = None, seed: int = 0, jitter: float = 0.0,
           schedule: str = "priority", flow: FlowControl | None = None) -> ReplayResult:
    """Run the trace (arrivals divided by `speed`) and summarize. `bounds`: (ideal, LRU) if already computed;
    `jitter`: lognormal sigma of every engine forward's duration, drawn per rank from `seed` (0: the timing model
    exactly, so every replay of one trace is the same); `schedule`: how the self-hosted engines order their queue,
    "priority" or "shortest-prefill-first" (sim/fleet.py); `flow`: the gateway's flow control between admission
    and routing (gateway/flow/; every tenant on the defaults)."""
    fleet = Fleet(targets, routing, instances, shared, seed=seed, jitter=jitter, schedule=schedule, flow=flow)
    if fleet_hook:
        fleet_hook(fleet)
    fleet.on_arrival = progress
    sla = routing.ttft_sla_ms / 1000
    page = targets[0][1].page_size

    def arrivals() -> Iterator[tuple[float, Callable[[], Job]]]:
        for i, r in enumerate(trace):
            yield r.timestamp_ms / 1000 / speed, functools.partial(to_job, r, i, routing.chunk_tokens, page, sla)

    fleet.feed(arrivals())
    recs = fleet.run()
    if bounds is None:
        kv = sum(cfg.max_total_num_tokens for info, cfg in targets if info.prefix_cache)
        bounds = ideal_hit_rate(trace), lru_hit_rate(trace, kv)
    infos = {i.name: i for i in fleet.infos}
    name = label or (routing.policy.type if instances == 1 else
                     f"{routing.policy.type} x{instances} {'shared' if shared else 'unshared'}")
    out = summarize(name, recs, infos, sla, bounds, fleet.loop.now)
    out.corrections = fleet.corrections
    return out


def summarize(label: str, recs: Sequence[Record], infos: dict[str, TargetInfo[Any]], sla: float,
              bounds: tuple[float, float], sim_seconds: float = 0.0) -> ReplayResult:
    done = [r for r in recs if r.ttft is not None]
    ttft = sorted(r.ttft for r in done if r.ttft is not None)
    slow = sorted(r.ttft / r.idle_ttft for r in done if r.ttft is not None and r.idle_ttft)
    prompt = sum(r.prompt for r in done) or 1
    out_tokens = sum(r.output for r in done) or 1
    branches: dict[str, dict[str, float]] = {}
    for r in done:  # where the hits go: per decision branch, predicted vs realized, and what the best candidate held
        b = branches.setdefault(r.branch, {"requests": 0, "prompt": 0, "predicted": 0, "cached": 0, "best": 0})
        b["requests"] += 1
        b["prompt"] += r.prompt
        b["predicted"] += r.predicted_cached
        b["cached"] += r.cached
        b["best"] += r.best_cached
    timeline: dict[int, list[float]] = {}
    for r in done:  # predicted vs real cached tokens over time (does the index drift from the engines?)
        w = timeline.setdefault(int(r.arrival // 60), [int(r.arrival // 60) * 60.0, 0, 0, 0, 0, 0])
        for k, v in enumerate((1, r.prompt, r.predicted_cached, r.cached, r.best_cached), 1):
            w[k] += v
    return ReplayResult(
        label, len(recs), sum(r.cached for r in done) / prompt, bounds[0], bounds[1],
        sum(ttft) / len(ttft) if ttft else float("nan"), nearest_rank(ttft, 0.5), nearest_rank(ttft, 0.95),
        nearest_rank(ttft, 0.99), nearest_rank(slow, 0.95), sum(x <= sla for x in ttft) / max(1, len(ttft)),
        sum(not r.self_hosted for r in done) / max(1, len(done)),
        sum(cost_usd(infos[r.name], r) for r in done) / out_tokens * 1e6, sum(1 for r in recs if not r.name),
        branches, sim_seconds, [timeline[k] for k in sorted(timeline)], tail_summary(done, nearest_rank(ttft, 0.95)))


def tail_summary(done: Sequence[Record], p95: float) -> dict[str, Any]:
    """Why the slowest 5% were slow: `alone` requests would be over p95 even alone on an idle replica holding their
    cached prefix (long prompts with little cached: only more hits shorten them), the rest waited behind other
    requests (the part routing can move). Per branch, and how close the TTFT predictions were (observed / predicted,
    with and without the learned correction)."""
    over = [r for r in done if r.ttft is not None and r.ttft > p95]
    by: dict[str, list[int]] = {}
    for r in over:
        alone = r.idle_ttft is not None and r.idle_ttft > p95
        by.setdefault(r.branch, [0, 0])[0 if alone else 1] += 1
    pairs = [(r.ttft, r.predicted_ttft, r.predicted_raw) for r in done
             if r.ttft is not None and r.predicted_ttft > 0 and r.predicted_raw > 0]

    def ratio(k: int) -> float:  # k: 1 the corrected prediction, 2 the raw one
        return nearest_rank(sorted(x[0] / x[k] for x in pairs), 0.5) if pairs else 0.0

    def mae(k: int) -> float:
        return sum(abs(x[0] - x[k]) for x in pairs) / len(pairs) if pairs else 0.0

    return {"p95_s": p95, "over": len(over), "alone": sum(a for a, _ in by.values()),
            "waited": sum(w for _, w in by.values()), "branches": {b: {"alone": a, "waited": w} for b, (a, w) in by.items()},
            "observed_over_predicted_p50": ratio(1), "observed_over_raw_p50": ratio(2),
            "abs_error_s": mae(1), "abs_error_raw_s": mae(2)}


def nodes_targets(nodes: int, b200: int = 0) -> list[tuple[TargetInfo[Any], ReplicaConfig]]:
    return mi355x_targets(nodes * 2, b200)
