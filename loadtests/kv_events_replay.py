"""routing.mode approximate vs precise vs hybrid on the virtual clock, at a chosen KV size per rank (which
`gateway replay --nodes` does not expose): the Mooncake conversation trace through the shipped routing engine, with
one (or a Redis-shared) index and with instances that each keep their own.

    .venv/bin/python -m loadtests.kv_events_replay --kv-per-rank 1200000          # ~90 s
    .venv/bin/python -m loadtests.kv_events_replay --wafer-seeds 12 --kv-per-rank 60000 --instances 1,2

`--wafer-seeds N`: instead of the trace, the HTTP benchmark's evicting Wafer workload (loadtests/kv_events_modes.py:
48 groups x 8k-token prefix, 10k-token prompts, 256 output tokens, Poisson 4 req/s for 120 s) as N seeded traces,
and the mean hit rate per mode over them: the deterministic counterpart of the HTTP runs, without their noise.

Precise and hybrid read the simulated engines' caches as lag-free events (gateway_lab/replay/kv_modes.py).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from tqdm import tqdm

from gateway.config import Routing
from gateway.recording.trace import BLOCK_TOKENS, TraceRecord, read_trace
from gateway.routing.features import TargetInfo
from gateway_lab.replay.bounds import ideal_hit_rate, lru_hit_rate
from gateway_lab.replay.kv_modes import install
from gateway_lab.replay.run import HEADERS, nodes_targets, replay
from gateway_lab.sim.profiles import ReplicaConfig

MODES = ("approximate", "precise", "hybrid")


def wafer_trace(seed: int, groups: int = 48, prefix_tokens: int = 8000, prompt_tokens: int = 10_000,
                output_tokens: int = 256, rate: float = 4.0, duration: float = 120.0) -> list[TraceRecord]:
    """The Wafer workload as a trace: a group's prefix blocks shared, the rest of each prompt its own."""
    rng = random.Random(seed)
    shared = prefix_tokens // BLOCK_TOKENS  # whole blocks inside the prefix
    blocks = -(-prompt_tokens // BLOCK_TOKENS)
    out: list[TraceRecord] = []
    t, fresh = 0.0, 1 << 40
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            return out
        g = rng.randrange(groups)
        ids = [g * 1000 + b for b in range(shared)] + list(range(fresh, fresh + blocks - shared))
        fresh += blocks - shared
        out.append(TraceRecord(t * 1000, prompt_tokens, output_tokens, tuple(ids)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="/work/shared/traces/conversation_trace.jsonl")
    p.add_argument("--wafer-seeds", type=int, default=0, help="replay N seeded Wafer traces instead of --trace")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--kv-per-rank", type=int, default=1_200_000, help="max_total_num_tokens of each TP4 rank")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--speculative-s", type=float, default=2.0, help="routing.kv_events.speculative_s (simulated s)")
    p.add_argument("--instances", default="1,2", help="gateway instances per run; above 1 each keeps its own index")
    p.add_argument("--shared", action="store_true", help="instances above 1 share one index and load view (as on one "
                   "Redis), each with its own precise index around it (its own in-flight entries)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    w = p.add_argument_group("the Wafer workload (--wafer-seeds); defaults: the HTTP benchmark's evicting scenario")
    w.add_argument("--wafer-groups", type=int, default=48)
    w.add_argument("--wafer-prefix-tokens", type=int, default=8000)
    w.add_argument("--wafer-prompt-tokens", type=int, default=10_000)
    w.add_argument("--wafer-output-tokens", type=int, default=256)
    w.add_argument("--wafer-rate", type=float, default=4.0, help="requests per second")
    w.add_argument("--wafer-duration", type=float, default=120.0, help="seconds of arrivals")
    p.add_argument("--branches", action="store_true", help="with --wafer-seeds: decision branches per mode, summed "
                   "over the seeds (requests, and what the best candidate held)")
    p.add_argument("--b200", type=int, default=0, help="per-token B200 replicas beside the nodes (the spill pool)")
    a = p.parse_args()
    targets = [(info, cfg.with_overrides(max_total_num_tokens=a.kv_per_rank) if info.prefix_cache else cfg)
               for info, cfg in nodes_targets(a.nodes, a.b200)]
    if a.wafer_seeds:
        wafer(a, targets)
        return
    trace = read_trace(a.trace, a.limit)
    kv = sum(cfg.max_total_num_tokens for _, cfg in targets)
    bounds = ideal_hit_rate(trace), lru_hit_rate(trace, kv)
    rows = []
    for n in (int(x) for x in a.instances.split(",")):
        for mode in MODES:
            routing = Routing(mode=mode, kv_events={"speculative_s": a.speculative_s})
            page = targets[0][1].page_size
            label = f"x{n} {'shared' if n == 1 or a.shared else 'unshared'} [{mode}]"
            # per arrival, as `gateway replay` does; closed (leave=False clears it) before the stdout line below
            bar = tqdm(total=len(trace), desc=label, unit="req", file=sys.stderr, leave=False, disable=a.no_progress)
            t0 = time.perf_counter()
            r = replay(trace, targets, routing, instances=n, shared=n == 1 or a.shared, bounds=bounds, label=label,
                       progress=None if a.no_progress else bar.update,
                       fleet_hook=lambda fleet, routing=routing, page=page: install(fleet, routing, page))
            wall = time.perf_counter() - t0
            bar.close()
            print(f"  {r.label}: {wall:.1f} s wall", flush=True)
            rows.append(r.row())
    print(f"\n{a.trace}: {len(trace)} requests on {a.nodes} nodes ({2 * a.nodes} ranks x {a.kv_per_rank / 1e6:.1f}M KV "
          f"tokens; speculative_s {a.speculative_s:g}); ideal hit {bounds[0] * 100:.1f}%, LRU bound {bounds[1] * 100:.1f}%")
    widths = [max(len(str(x)) for x in col) for col in zip(HEADERS, *rows, strict=False)]
    for i, line in enumerate([HEADERS, *rows]):
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def wafer(a: argparse.Namespace, targets: list[tuple[TargetInfo, ReplicaConfig]]) -> None:
    page = targets[0][1].page_size
    print("| instances | mode | mean hit | min..max over seeds | mean TTFT p95 (s) | mean within SLA | predicted / realized "
          "cached | index corrections | spill |\n|---|---|---|---|---|---|---|---|---|")
    instances = [int(x) for x in a.instances.split(",")]
    # one bar over all replays; the table rows go to stdout through tqdm.write so they do not land inside it
    bar = tqdm(total=len(instances) * a.wafer_seeds * len(MODES), desc="wafer", unit="replay", file=sys.stderr,
               leave=False, disable=a.no_progress)
    for n in instances:
        got: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
        extra = {m: [0, 0.0] for m in MODES}  # index corrections (summed), spill share (summed over seeds)
        branches: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}  # requests, best held, prompt
        cached = {m: [0.0, 0.0] for m in MODES}  # the router's predicted and the engines' realized cached tokens
        for seed in range(a.wafer_seeds):
            trace = wafer_trace(seed, a.wafer_groups, a.wafer_prefix_tokens, a.wafer_prompt_tokens,
                                a.wafer_output_tokens, a.wafer_rate, a.wafer_duration)
            for mode in MODES:
                routing = Routing(mode=mode, kv_events={"speculative_s": a.speculative_s})
                r = replay(trace, targets, routing, instances=n, shared=n == 1 or a.shared,
                           fleet_hook=lambda fleet, routing=routing: install(fleet, routing, page))
                got[mode].append((r.hit_rate, r.ttft_p95, r.within_sla))
                extra[mode][0] += r.corrections
                for b, v in r.branches.items():
                    acc = branches[mode].setdefault(b, [0, 0.0, 0.0])
                    acc[0] += int(v["requests"])
                    acc[1] += v["best"]
                    acc[2] += v["prompt"]
                extra[mode][1] += r.spill
                cached[mode][0] += sum(t[3] for t in r.timeline)
                cached[mode][1] += sum(t[4] for t in r.timeline)
                bar.update()
        for mode, rs in got.items():
            hits = [h for h, _, _ in rs]
            tqdm.write(f"| {n}{' (shared)' if n == 1 or a.shared else ' (unshared)'} | {mode} | {sum(hits) / len(hits) * 100:.2f}% | "
                       f"{min(hits) * 100:.1f}..{max(hits) * 100:.1f}% | {sum(x for _, x, _ in rs) / len(rs):.2f} | "
                       f"{sum(x for _, _, x in rs) / len(rs) * 100:.1f}% | "
                       f"{cached[mode][0] / max(cached[mode][1], 1):.3f} | {extra[mode][0]} | "
                       f"{extra[mode][1] / len(rs) * 100:.1f}% |", file=sys.stdout)
            sys.stdout.flush()
        tqdm.write(f"    {n} instance(s), hit per seed: " + "; ".join(
            f"{mode} " + " ".join(f"{h * 100:.2f}" for h, _, _ in rs) for mode, rs in got.items()), file=sys.stdout)
        if a.branches:
            for mode, bs in branches.items():
                tqdm.write(f"    {n} instance(s) [{mode}] branches: " + ", ".join(
                    f"{b} {int(v[0])} (best candidate held {v[1] / max(v[2], 1) * 100:.1f}%)"
                    for b, v in sorted(bs.items(), key=lambda kv: -kv[1][0])), file=sys.stdout)
    bar.close()


if __name__ == "__main__":
    main()
