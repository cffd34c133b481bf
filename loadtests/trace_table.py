"""Every trace's share of the LRU bound in one table: this router against least-loaded on a fixed set of traces the
router was not tuned on, on the virtual clock (`gateway replay`'s `replay()`, the shipped engine).

    .venv/bin/python -m loadtests.trace_table                        # the whole set (about 10 min of CPU)
    .venv/bin/python -m loadtests.trace_table --only agent-long,wafer --branches
    .venv/bin/python -m loadtests.trace_table --json loadtests/out/trace_table.json

The set: the Mooncake conversation trace at 2, 4 and 8 nodes; four multi-turn agent traces from
`loadtests/agent_workload.py` with other parameters (session counts, turn counts, think times, tool outputs, shared
system prompts); the Wafer workload (shared 12k-token group prefixes + 8k new tokens, 1k out) written as a trace.

The speed (one rule, never per trace): the arrivals are compressed until the fleet's estimated busy share in the
trace's busiest 5 minutes (replayed time) is `--load` (default 0.6). The work of a request is what the timing model
charges a rank for it when it gets the hits the LRU bound gives it: its uncached prefill (in chunks, each against its
context) plus its decode steps at half the batch cap; the busy share is the window's work over its rank-seconds. The
hits are the bound's, so the rule does not depend on the policy measured; the busiest window, not the mean, because
generated traces front-load their sessions (a mean over the whole span left one of them overloaded at "0.5").
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.config import Routing
from gateway.recording.trace import BLOCK_TOKENS, TraceRecord, read_trace
from gateway.routing import registry
from gateway_lab.replay.bounds import ideal_hit_rate, lru_hit_rate, lru_hits
from gateway_lab.replay.cli import branch_table, tail_table
from gateway_lab.replay.run import ReplayResult, nodes_targets, replay
from gateway_lab.sim.profiles import ReplicaConfig
from gateway_lab.sim.wafer_groups import OUTPUT_TOKENS, PREFIX_TOKENS, PROMPT_TOKENS
from loadtests.agent_workload import Params, generate

CONVERSATION = "/work/shared/traces/conversation_trace.jsonl"
MINE = "prefix_sla_cost"
BASELINE = "least_loaded"
TARGET_OF_BOUND = 0.97
WINDOW_S = 300.0  # the speed rule's window (replayed seconds)
LOAD = 0.6  # the speed rule's busy share in that window


@dataclass(frozen=True)
class Case:
    name: str
    nodes: int
    make: Callable[[], list[TraceRecord]]
    what: str


def wafer_trace(groups: int, requests: int, seed: int = 0) -> list[TraceRecord]:
    """The Wafer workload as a trace: Poisson arrivals (1 req/s; the speed rule sets the rate), each a uniformly drawn
    group's 12k-token prefix + 8k new tokens, 1k output. The prefix's full blocks carry the group's ids; the block
    it ends in is mixed with new tokens, so it is new (the trace shares 23 blocks, 11,776 tokens)."""
    rng = random.Random(seed)
    ids = iter(range(10**9))
    prefix = [[next(ids) for _ in range(PREFIX_TOKENS // BLOCK_TOKENS)] for _ in range(groups)]
    out, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(1.0)
        g = prefix[rng.randrange(groups)]
        tail = [next(ids) for _ in range(math.ceil(PROMPT_TOKENS / BLOCK_TOKENS) - len(g))]
        out.append(TraceRecord(round(t * 1000, 3), PROMPT_TOKENS, OUTPUT_TOKENS, tuple(g + tail)))
    return out


def _conversation(limit: int | None = None) -> Callable[[], list[TraceRecord]]:
    return lambda: read_trace(CONVERSATION, limit)


def _agent(**kw: Any) -> Callable[[], list[TraceRecord]]:
    return lambda: generate(Params(**kw))


CASES = [
    Case("conversation", 2, _conversation(), "Mooncake conversation trace"),
    Case("conversation", 4, _conversation(), "Mooncake conversation trace"),
    Case("conversation", 8, _conversation(), "Mooncake conversation trace"),
    Case("agent-default", 2, _agent(), "agent_workload defaults (600 sessions, 8 turns, 40 system prompts)"),
    Case(
        "agent-long",
        2,
        _agent(sessions=150, rate=0.2, turns_mean=24, think_mean_s=3, tool_median=2_500, seed=1),
        "150 long sessions (24 turns), short think times, big tool outputs",
    ),
    Case(
        "agent-short",
        2,
        _agent(
            sessions=2_000, rate=2.0, turns_mean=3, systems=8, system_median=8_000, zipf=1.4, tool_median=800, seed=2
        ),
        "2,000 short sessions (3 turns) on 8 long shared system prompts",
    ),
    Case(
        "agent-wide",
        4,
        _agent(
            sessions=800,
            rate=1.0,
            systems=200,
            zipf=0.8,
            system_median=1_500,
            tool_median=5_000,
            output_median=150,
            think_mean_s=15,
            burst_p=0.2,
            seed=3,
        ),
        "800 sessions on 200 short system prompts, 5k-token tool outputs, long think times, bursty",
    ),
    Case("wafer", 4, lambda: wafer_trace(64, 2_000), "Wafer: 64 groups of 12k shared + 8k new tokens, 1k out"),
]


def work_seconds(r: TraceRecord, hit: int, cfg: ReplicaConfig) -> float:
    """Rank time the timing model charges for one request with `hit` cached tokens: chunked prefill + decode."""
    t, ctx, left = cfg.timing, hit, r.input_length - hit
    prefill = 0.0
    while left > 0:
        n = min(left, cfg.chunked_prefill_size)
        prefill += t.prefill_time([(n, ctx + n / 2)])
        ctx, left = ctx + n, left - n
    batch = cfg.max_running_requests / 2
    return prefill + r.output_length / t.alpha * t.decode_time(int(batch)) / batch


def peak_busy(ts: Sequence[float], work: Sequence[float], window_s: float, ranks: int) -> float:
    """The busiest `window_s` of arrivals (trace time): its work over the window's rank-seconds."""
    best = acc = 0.0
    j = 0
    for i, t in enumerate(ts):
        acc += work[i]
        while ts[j] < t - window_s:
            acc -= work[j]
            j += 1
        best = max(best, acc)
    return best / (window_s * ranks)


def speed_for(
    trace: Sequence[TraceRecord], targets: Sequence[tuple[Any, ReplicaConfig]], load: float, window_s: float = WINDOW_S
) -> float:
    """The speed at which the busiest `window_s` (replayed time) of the trace's work, at the LRU bound's hits, keeps
    the fleet's ranks `load` busy (bisection; the busy share grows with the speed). A trace shorter than the window
    at that speed is taken whole."""
    kv = sum(cfg.max_total_num_tokens for _, cfg in targets)
    cfg = targets[0][1]
    work = [work_seconds(r, h, cfg) for r, h in zip(trace, lru_hits(trace, kv), strict=True)]
    ts = [r.timestamp_ms / 1000 for r in trace]
    span = max(ts[-1] - ts[0], 1e-3)
    lo, hi = 0.01, 100.0
    while hi - lo > 0.005:
        mid = (lo + hi) / 2
        if mid * peak_busy(ts, work, min(window_s * mid, span), len(targets)) < load:
            lo = mid
        else:
            hi = mid
    return round(lo, 2)


@dataclass
class Row:
    trace: str
    nodes: int
    speed: float
    requests: int
    lru_bound: float
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # policy -> hit, p50, p95, within SLA, seconds

    def cells(self, policies: Sequence[str]) -> list[Any]:
        mine, base = self.runs[policies[0]], self.runs.get(BASELINE)
        of = mine["hit"] / self.lru_bound if self.lru_bound else 0.0
        out = [
            self.trace,
            f"{self.nodes} ({2 * self.nodes} ranks)",
            f"{self.speed:g}",
            self.requests,
            f"{self.lru_bound * 100:.1f}%",
            f"{mine['hit'] * 100:.1f}%",
            f"{of * 100:.1f}%",
        ]
        out += [_p95(self.runs[p]) for p in policies]
        out += [f"{self.runs[p]['within_sla'] * 100:.1f}%" for p in policies]
        ok = of >= TARGET_OF_BOUND and (base is None or mine["p95"] <= base["p95"])
        return out + ["yes" if ok else "NO"]


def _p95(run: dict[str, Any]) -> str:
    lo, hi = run.get("p95_range", (run["p95"], run["p95"]))
    return f"{run['p95']:.2f}" + (f" ({lo:.2f}..{hi:.2f})" if hi > lo else "")


def headers(policies: Sequence[str]) -> list[str]:
    short = {MINE: "this router", BASELINE: "least-loaded", "round_robin": "round-robin"}
    return (
        ["trace", "nodes", "speed", "requests", "LRU bound", "hit", "of bound"]
        + [f"p95 {short.get(p, p)}" for p in policies]
        + [f"within SLA {short.get(p, p)}" for p in policies]
        + [f">= {TARGET_OF_BOUND * 100:.0f}% and p95 <= least-loaded"]
    )


def run_case(
    case: Case,
    policies: Sequence[str],
    load: float,
    routing: Routing,
    details: bool,
    trace_cache: dict[str, list[TraceRecord]],
    jitter: float = 0.0,
    seeds: int = 1,
) -> Row:
    """Each policy on the case's trace at the rule's speed; with `jitter`, replayed under seeds 1..`seeds` and
    averaged (the p95's range kept: whether a difference is larger than the run-to-run noise)."""
    trace = trace_cache.setdefault(case.name, case.make())
    targets = nodes_targets(case.nodes)
    speed = speed_for(trace, targets, load)
    kv = sum(c.max_total_num_tokens for _, c in targets)
    bounds = ideal_hit_rate(trace), lru_hit_rate(trace, kv)
    row = Row(case.name, case.nodes, speed, len(trace), bounds[1])
    for policy in policies:
        rc = routing.model_copy(update={"policy": registry.params_for(policy, routing.policy)})
        t0 = time.process_time()
        res: list[ReplayResult] = [
            replay(trace, targets, rc, speed=speed, bounds=bounds, label=policy, seed=seed, jitter=jitter)
            for seed in (range(1, seeds + 1) if jitter else [0])
        ]

        def mean(xs: Sequence[float]) -> float:
            return sum(xs) / len(xs)

        p95s = [r.ttft_p95 for r in res]
        row.runs[policy] = {
            "hit": mean([r.hit_rate for r in res]),
            "p50": mean([r.ttft_p50 for r in res]),
            "p95": mean(p95s),
            "p95_range": [min(p95s), max(p95s)],
            "p99": mean([r.ttft_p99 for r in res]),
            "within_sla": mean([r.within_sla for r in res]),
            "cpu_s": time.process_time() - t0,
            "branches": res[0].branches,
            "tail": res[0].tail,
        }
        print(
            f"  {case.name} @ {case.nodes} nodes, speed {speed:g}, {policy}: hit {row.runs[policy]['hit'] * 100:.1f}% "
            f"(bound {bounds[1] * 100:.1f}%), p95 {mean(p95s):.2f} s ({min(p95s):.2f}..{max(p95s):.2f}), "
            f"{row.runs[policy]['cpu_s']:.0f} s CPU",
            file=sys.stderr,
        )
        if details and policy == policies[0]:
            print(f"\n{case.name} @ {case.nodes} nodes, {policy}:\n{branch_table(res[0])}\n{tail_table(res[0])}\n")
    return row


def _table(head: list[str], rows: list[list[Any]]) -> str:
    return "\n".join("| " + " | ".join(str(c) for c in r) + " |" for r in [head, ["---"] * len(head), *rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated trace names ("
        + ", ".join(dict.fromkeys(c.name for c in CASES))
        + "); NAME@NODES for one fleet",
    )
    ap.add_argument("--policies", default=f"{MINE},{BASELINE}", help="the first is the one measured against the bound")
    ap.add_argument(
        "--load",
        type=float,
        default=LOAD,
        help="the estimated busy share of the fleet in the trace's busiest 5 minutes that sets the speed",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="what-if a routing field or a field of the first policy (VALUE as JSON), e.g. load_bound_factor=3",
    )
    ap.add_argument("--branches", action="store_true", help="also print the first policy's branches and tail per run")
    ap.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="lognormal sigma of each engine forward (as gateway "
        "replay --jitter); with --seeds: each run averaged over seeds 1..N",
    )
    ap.add_argument("--seeds", type=int, default=1, help="with --jitter: seeds per run")
    ap.add_argument("--json", dest="json_out", help="write every run (with branches and tail) here")
    a = ap.parse_args(argv)
    policies = [p.strip() for p in a.policies.split(",")]
    for p in policies:
        if p not in registry.POLICIES:
            ap.error(f"unknown policy {p!r} ({', '.join(registry.POLICIES)})")
    wanted = {w.strip() for w in a.only.split(",")} if a.only else None
    cases = [c for c in CASES if wanted is None or c.name in wanted or f"{c.name}@{c.nodes}" in wanted]
    if not cases:
        ap.error("--only matched no trace")
    routing = Routing()
    if a.set:
        what_if = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.set)}
        top = {k: v for k, v in what_if.items() if k in Routing.model_fields}  # routing.X, else routing.policy.X
        policy = {k: v for k, v in what_if.items() if k not in top}
        routing = Routing.model_validate(
            {**routing.model_dump(), **top, "policy": {**routing.policy.model_dump(), **policy}}
        )
    cache: dict[str, list[TraceRecord]] = {}
    t0 = time.process_time()
    rows = [run_case(c, policies, a.load, routing, a.branches, cache, a.jitter, a.seeds) for c in cases]
    if a.set:
        print(f"\nwhat-if: {', '.join(a.set)}")
    print(
        f"\nthis router against the LRU bound; speed: the fleet's estimated busy share "
        f"{a.load:g} in the busiest {WINDOW_S / 60:.0f} minutes (loadtests/trace_table.py); TTFT SLA {routing.ttft_sla_ms / 1000:.2f} s; {time.process_time() - t0:.0f} s CPU"
    )
    print(_table(headers(policies), [r.cells(policies) for r in rows]))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"load": a.load, "policies": policies, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
