"""`gateway replay TRACE`: what-if a trace ran through this router against a given fleet, on the virtual clock.

    gateway replay trace.jsonl --nodes 2                      # 2 MI355X nodes (4 TP4 ranks, 2.4M-token KV each)
    gateway replay trace.jsonl --nodes 4 --speed 2 --compare  # the configured policy, every other one, 2 unshared
    gateway replay trace.jsonl --config deploy/gateway.example.yaml --policy least_loaded --json out.json

The fleet is a gateway config's model (SGLang replicas simulated as MI355X TP4 ranks, hosted endpoints as B200
replicas) or `--nodes N [--b200 M]`. The routing is the shipped engine (`routing/engine.py`) built from the config's
`routing:` section (defaults without a config), `--policy` overriding it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from typing import Any

from pydantic import ValidationError

from gateway.config import ConfigError, Routing, load_config
from gateway.flow.settings import FlowControl
from gateway.recording.trace import TraceError, read_trace
from gateway.routing import registry
from gateway_lab.replay.bounds import ideal_hit_rate, lru_hit_rate
from gateway_lab.replay.kv_modes import install as install_mode
from gateway_lab.replay.run import HEADERS, ReplayResult, nodes_targets, replay, targets_from_config
from gateway_lab.sim.fleet import Fleet
from gateway_lab.sim.profiles import SHORTEST_PREFILL_FIRST


def register(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a trace through this router on the virtual clock (or over --http)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake JSONL (512-token hash_ids) or a gateway recording")
    fleet = p.add_mutually_exclusive_group()
    fleet.add_argument("--config", help="a gateway config: its model's pools are the fleet, its routing section the router")
    fleet.add_argument("--nodes", type=int, default=None, help="simulated MI355X nodes, 2 TP4 ranks each (default 2)")
    p.add_argument("--b200", type=int, default=0, help="with --nodes: B200 replicas priced per token (the spill pool)")
    p.add_argument("--model", help="with --config: which model's pools (default: the first)")
    p.add_argument("--policy", choices=list(registry.POLICIES), help="override the routing policy (its "
                   "parameters from the config when it is the configured one, else its defaults)")
    p.add_argument("--compare", action="store_true",
                   help="one table: the configured policy, every other registered one, and the configured one on 2 "
                   "instances with unshared state")
    p.add_argument("--instances", type=int, default=1, help="gateway instances (requests dealt round-robin)")
    p.add_argument("--modes", default=None, help="routing.mode per run, comma-separated: approximate,precise,hybrid "
                   "(precise/hybrid read the simulated engines' caches as lag-free KV events; docs/kv-events.md)")
    p.add_argument("--unshared", action="store_true", help="instances keep per-process index and load (no Redis)")
    p.add_argument("--speed", type=float, default=1.0, help="k > 1 compresses arrivals k times, k < 1 stretches them")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--sla-ms", type=float, default=None, help="TTFT SLA (default: the config's routing.ttft_sla_ms)")
    p.add_argument("--queue-drain", action="store_true", help="what-if routing.queue_drain: true")
    p.add_argument("--recompute-weight", type=float, default=None,
                   help="what-if routing.policy.recompute_weight (0: the SLA alone decides; docs/routing.md)")
    p.add_argument("--fcfs", action="store_true", help="what-if routing.shortest_prefill_first: false (the engines "
                   "keep arrival order within a priority class; docs/routing.md)")
    p.add_argument("--schedule", choices=["priority", SHORTEST_PREFILL_FIRST], default="priority",
                   help="how the self-hosted engines order their queue, as deploy/sglang's SCHEDULE starts them: "
                   "priority (--enable-priority-scheduling, the default) or shortest-prefill-first (SGLang 0.5.21+'s "
                   "--schedule-policy; no priority classes; docs/routing.md)")
    p.add_argument("--jitter", type=float, default=0.0, help="lognormal sigma of each engine forward's duration "
                   "(run-to-run noise; default 0: the timing model exactly, every replay the same)")
    p.add_argument("--seeds", type=int, default=1, help="with --jitter: replay each run under seeds 1..N, a row "
                   "each, then their mean and range: whether a difference between runs is larger than the noise")
    p.add_argument("--branches", action="store_true", help="also print where the hits go, per decision branch")
    p.add_argument("--tail", action="store_true", help="also print what the requests over p95 waited for, per branch, "
                   "and how close the TTFT predictions were")
    p.add_argument("--pd", metavar="P:D", default=None,
                   help="prefill/decode disaggregation on P + D MI355X TP4 ranks: unified (P + D ranks, this router) "
                   "vs PD with every request disaggregated vs PD with the per-request decision (docs/pd.md)")
    p.add_argument("--itl-sla-ms", type=float, default=30.0, help="with --pd: the inter-token latency target of goodput")
    p.add_argument("--flow", action="store_true", help="also replay each run through flow control (gateway/flow/, "
                   "docs/flow-control.md): a single tenant's trace must come out the same")
    p.add_argument("--noisy", metavar="AGGRESSOR", help="the noisy-neighbour scenario: TRACE as tenant B at its "
                   "share, AGGRESSOR as tenant A at --aggressor-x times its share, without and with flow control")
    p.add_argument("--aggressor-x", type=float, default=5.0, help="with --noisy: A's demand over its weighted share")
    p.add_argument("--bands", action="store_true", help="the priority scenario: TRACE split into three tenants, "
                   "one per band (critical, standard, sheddable), at --speed, without and with flow control")
    p.add_argument("--window-s", type=float, default=1200.0, help="with --noisy/--bands: arrivals replayed (s)")
    p.add_argument("--capacity", action="store_true", help="with --bands: only find the fleet's capacity at SLA, the "
                   "highest speed at which the whole trace, split as --bands splits it, in one class and without flow "
                   "control, keeps >= 99%% of the requests that can meet the SLA within it (gateway_lab/replay/capacity.py)")
    p.add_argument("--overload", type=float, default=None, metavar="X", help="with --bands: find the capacity as "
                   "--capacity does, then run the bands at X times it (instead of --speed)")
    p.add_argument("--capacity-step", type=float, default=0.25, help="with --capacity/--overload: the sweep's step "
                   "up; then the interval is halved down to --capacity-resolution")
    p.add_argument("--capacity-resolution", type=float, default=0.05, help="with --capacity/--overload: how close "
                   "the capacity is found")
    p.add_argument("--flow-set", action="append", default=[], metavar="FIELD=VALUE", help="with --noisy/--bands: "
                   "what-if a flow: field (VALUE as JSON, else a string), e.g. under_share_priority=0; repeatable")
    p.add_argument("--json", dest="json_out", help="write the results as JSON here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--http", metavar="BASE_URL", help="replay open-loop against a live OpenAI-compatible endpoint")
    p.add_argument("--api-key", default="sk-demo", help="with --http")
    p.add_argument("--http-model", default="glm-5.2", help="with --http: the model name to request")
    p.add_argument("--concurrency", type=int, default=256, help="with --http: most requests in flight")


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"

    return "\n".join([line(cells[0]), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in cells[1:]])


def seed_table(results: list[ReplayResult]) -> str:
    """Each run's rows over its seeds (labels "<run> seed <k>"): mean and range of what the main table compares."""
    runs: dict[str, list[ReplayResult]] = {}
    for r in results:
        runs.setdefault(r.label.rsplit(" seed ", 1)[0], []).append(r)

    def spread(vals: list[float], fmt: str) -> str:
        return f"{fmt.format(sum(vals) / len(vals))} ({fmt.format(min(vals))}..{fmt.format(max(vals))})"

    rows = [[label, len(rs), spread([r.hit_rate * 100 for r in rs], "{:.1f}%"),
             spread([r.hit_rate / r.lru_hit_rate * 100 if r.lru_hit_rate else 0.0 for r in rs], "{:.1f}%"),
             spread([r.ttft_p50 for r in rs], "{:.2f}"), spread([r.ttft_p95 for r in rs], "{:.3f}"),
             spread([r.within_sla * 100 for r in rs], "{:.1f}%")] for label, rs in runs.items()]
    return _table(["run", "seeds", "hit", "of LRU bound", "TTFT p50", "p95", "within SLA"], rows)


def branch_table(r: ReplayResult) -> str:
    total = sum(b["prompt"] for b in r.branches.values()) or 1
    rows = []
    for name, b in sorted(r.branches.items(), key=lambda kv: -kv[1]["prompt"]):
        p = b["prompt"] or 1
        rows.append([name, int(b["requests"]), f"{b['prompt'] / total * 100:.1f}%", f"{b['cached'] / p * 100:.1f}%",
                     f"{b['predicted'] / p * 100:.1f}%", f"{b['best'] / p * 100:.1f}%"])
    return _table(["branch", "requests", "prompt tokens", "realized hit", "predicted hit", "best candidate held"], rows)


def tail_table(r: ReplayResult) -> str:
    t = r.tail
    rows = [[b, v["alone"] + v["waited"], v["alone"], v["waited"]]
            for b, v in sorted(t["branches"].items(), key=lambda kv: -(kv[1]["alone"] + kv[1]["waited"]))]
    rows.append(["all", t["over"], t["alone"], t["waited"]])
    return (_table(["branch", f"over p95 ({t['p95_s']:.2f} s)", "over even alone", "waited behind others"], rows)
            + f"\nTTFT observed / predicted, median: {t['observed_over_predicted_p50']:.2f} (mean abs error "
              f"{t['abs_error_s']:.2f} s); before the learned correction: {t['observed_over_raw_p50']:.2f} "
              f"({t['abs_error_raw_s']:.2f} s)")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (TraceError, ConfigError, ValueError) as e:
        print(f"gateway replay: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace, args.limit)
    if args.speed <= 0:
        raise ValueError("--speed must be > 0")
    if args.jitter < 0 or args.seeds < 1:
        raise ValueError("--jitter must be >= 0 and --seeds >= 1")
    if args.seeds > 1 and not args.jitter:
        raise ValueError("--seeds needs --jitter: without it every seed replays the same")
    if args.http:
        if args.schedule != "priority":
            raise ValueError("--schedule describes simulated engines; with --http the endpoint's own engines decide")
        from gateway_lab.replay.http import replay_http

        return replay_http(trace, args)
    if args.pd:
        return _run_pd(trace, args)
    if args.config:
        cfg = load_config(args.config)
        targets, routing = targets_from_config(cfg, args.model), cfg.routing
        fleet_label = f"{args.config} ({len(targets)} targets)"
    else:
        nodes = args.nodes if args.nodes is not None else 2
        targets, routing = nodes_targets(nodes, args.b200), Routing()
        fleet_label = f"{nodes} MI355X nodes ({2 * nodes} TP4 ranks)" + (f" + {args.b200} B200" if args.b200 else "")
    if not targets:
        raise ValueError("the fleet has no targets")
    if args.schedule != "priority":
        fleet_label += f", engines {args.schedule}"
    if args.sla_ms:
        routing = routing.model_copy(update={"ttft_sla_ms": args.sla_ms})
    if args.queue_drain:
        routing = routing.model_copy(update={"queue_drain": True})
    if args.recompute_weight is not None:
        if "recompute_weight" not in type(routing.policy).model_fields:
            raise ValueError(f"--recompute-weight: policy {routing.policy.type} has no recompute_weight")
        routing = Routing.model_validate({**routing.model_dump(), "policy": {**routing.policy.model_dump(),
                                                                            "recompute_weight": args.recompute_weight}})
    if args.fcfs:
        routing = routing.model_copy(update={"shortest_prefill_first": False})
    if (args.capacity or args.overload is not None) and not args.bands:
        raise ValueError("--capacity and --overload go with --bands")
    if args.overload is not None and args.overload <= 0:
        raise ValueError("--overload must be > 0")
    if args.noisy or args.bands:
        return _scenario(args, trace, targets, routing, fleet_label)
    if args.compare:
        mine = routing.policy.type  # then every other registered policy, then two instances with unshared state
        runs = [(mine, 1, True), *((n, 1, True) for n in registry.POLICIES if n != mine), (mine, 2, False)]
    else:
        runs = [(args.policy or routing.policy.type, args.instances, not args.unshared)]
    modes = [m.strip() for m in args.modes.split(",")] if args.modes else [routing.mode]
    for m in modes:
        if m not in ("approximate", "precise", "hybrid"):
            raise ValueError(f"--modes: unknown mode {m!r} (approximate, precise, hybrid)")
    with_modes = [(policy, n, shared, m, False) for policy, n, shared in runs for m in modes]
    if args.flow:
        with_modes += [(policy, n, shared, m, True) for policy, n, shared, m, _ in with_modes]
    seeds = list(range(1, args.seeds + 1)) if args.jitter else [0]
    kv = sum(c.max_total_num_tokens for i, c in targets if i.prefix_cache)
    bounds = ideal_hit_rate(trace), lru_hit_rate(trace, kv)
    results = []
    for (policy, instances, shared, mode, flow), seed in ((run, seed) for run in with_modes for seed in seeds):
        bar = None
        if not args.no_progress:
            from tqdm import tqdm  # light, and already used by the load tests

            bar = tqdm(total=len(trace), desc=f"{policy} x{instances}", unit="req", file=sys.stderr, leave=False)
        t0 = time.perf_counter()
        rc = routing.model_copy(update={"policy": registry.params_for(policy, routing.policy), "mode": mode})
        page = targets[0][1].page_size

        def hook(fleet: Fleet, rc: Routing = rc, page: int = page) -> None:
            install_mode(fleet, rc, page)

        r = replay(trace, targets, rc, instances=instances, shared=shared, speed=args.speed,
                   progress=bar.update if bar else None, bounds=bounds, fleet_hook=hook, seed=seed, jitter=args.jitter,
                   schedule=args.schedule, flow=FlowControl(enabled=True) if flow else None)
        if flow:
            r.label += " +flow control"
        if len(modes) > 1:
            r.label += f" [{mode}]"
        if args.jitter:
            r.label += f" seed {seed}"
        if bar:
            bar.close()
        print(f"  {r.label}: {time.perf_counter() - t0:.1f} s wall", file=sys.stderr)
        results.append(r)
    span = trace[-1].timestamp_ms / 1000 / args.speed
    print(f"\n{args.trace}: {len(trace)} requests over {span:.0f} s (speed {args.speed:g}) on {fleet_label}; "
          f"TTFT SLA {routing.ttft_sla_ms / 1000:.2f} s; ideal hit {bounds[0] * 100:.1f}%, LRU bound "
          f"{bounds[1] * 100:.1f}% at {kv / 1e6:.1f}M KV tokens")
    print(_table(HEADERS, [r.row() for r in results]))
    if args.jitter:
        print(f"\nOver {len(seeds)} seed(s) at jitter {args.jitter:g}: mean (min..max)")
        print(seed_table(results))
    if args.branches:
        for r in results:
            print(f"\n{r.label}: where the hits go")
            print(branch_table(r))
    if args.tail:
        for r in results:
            print(f"\n{r.label}: the TTFT tail")
            print(tail_table(r))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"trace": args.trace, "requests": len(trace), "speed": args.speed, "fleet": fleet_label,
                       "jitter": args.jitter, "seeds": seeds,
                       "results": [asdict(r) for r in results]}, f, indent=1)
    return 0


def _run_pd(trace: list[Any], args: argparse.Namespace) -> int:
    from gateway_lab.replay.pd import HEADERS as PD_HEADERS
    from gateway_lab.replay.pd import compare, trace_arrivals

    p, sep, d = args.pd.partition(":")
    if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
        raise ValueError(f"--pd expects P:D with P, D >= 1, got {args.pd!r}")
    routing = Routing()
    if args.sla_ms:
        routing = routing.model_copy(update={"ttft_sla_ms": args.sla_ms})
    bars: list[Any] = []

    def progress(label: str) -> Any:
        if args.no_progress:
            return None
        from tqdm import tqdm

        bars.append(tqdm(total=len(trace), desc=label, unit="req", file=sys.stderr, leave=False))
        return bars[-1].update

    t0 = time.perf_counter()
    span = trace[-1].timestamp_ms / 1000 / args.speed
    results = compare(trace_arrivals(trace, routing, args.speed), span, int(p), int(d), routing,
                      args.itl_sla_ms / 1000, progress)
    for b in bars:
        b.close()
    print(f"\n{args.trace}: {len(trace)} requests over {span:.0f} s (speed {args.speed:g}); {int(p) + int(d)} MI355X "
          f"TP4 ranks per run; TTFT SLA {routing.ttft_sla_ms / 1000:.2f} s, ITL target {args.itl_sla_ms:g} ms; "
          f"{time.perf_counter() - t0:.0f} s wall")
    print(_table(PD_HEADERS, [r.row() for r in results]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"trace": args.trace, "requests": len(trace), "speed": args.speed, "pd": args.pd,
                       "results": [asdict(r) for r in results]}, f, indent=1)
    return 0


def flow_what_if(pairs: list[str]) -> FlowControl:
    """--flow-set FIELD=VALUE...: flow control's settings with these fields changed (VALUE as JSON, else a string),
    validated as the gateway's config is; a bad one exits naming it."""

    def value(v: str) -> Any:
        try:
            return json.loads(v)
        except ValueError:
            return v

    try:
        return FlowControl.model_validate({k: value(v) for k, _, v in (s.partition("=") for s in pairs)})
    except ValidationError as e:
        raise SystemExit(f"--flow-set: {e}") from None


def _capacity(args: argparse.Namespace, trace: list[Any], targets: list[Any], routing: Routing,
              fleet_label: str) -> float:
    """--capacity / --overload: the sweep's table and the capacity speed (0: even the first step misses)."""
    from gateway_lab.replay import capacity

    def progress(p: capacity.Point) -> None:
        print(f"  speed {p.speed:g}: {p.within_sla_possible * 100:.1f}% of those possible within SLA", file=sys.stderr)

    cap, points = capacity.sweep(trace, targets, routing, args.capacity_step, args.capacity_resolution,
                                 progress=None if args.no_progress else progress)
    print(f"\ncapacity at SLA on {fleet_label}, the whole of {args.trace}: the three bands' requests in one class, "
          f"no flow control; target >= {capacity.TARGET * 100:.0f}% of those possible within "
          f"the TTFT SLA {routing.ttft_sla_ms / 1000:.2f} s")
    print(_table(capacity.HEADERS, [p.row(capacity.TARGET) for p in points]))
    print(f"capacity: speed {cap:g}" if cap > 0 else "capacity: none (the first step already misses the target)")
    return cap


def _scenario(args: argparse.Namespace, trace: list[Any], targets: list[Any], routing: Routing, fleet_label: str) -> int:
    """--noisy / --bands: multi-tenant runs through flow control (gateway_lab/replay/mix.py), one table."""
    from gateway_lab.replay import mix

    flow = flow_what_if(args.flow_set)

    def progress(label: str, n: int) -> Any:
        print(f"  {label}: {n} requests", file=sys.stderr)
        return None

    if args.noisy:
        aggressor = read_trace(args.noisy)
        results = mix.noisy_neighbour(trace, aggressor, targets, routing, flow, args.aggressor_x, args.window_s,
                                      progress=None if args.no_progress else progress, instances=args.instances)
        x = results[-1].extra
        print(f"\nnoisy neighbour on {fleet_label}, {args.instances} gateway instance(s), first {args.window_s:.0f} s: B = {args.trace} at its share "
              f"({x['b_demand'] / 1000:.1f}k units/s), A = {args.noisy} at {args.aggressor_x:g}x its share (speed "
              f"{x['aggressor_speed']:.2f}, {x['a_demand'] / 1000:.1f}k units/s); equal weights; TTFT SLA "
              f"{routing.ttft_sla_ms / 1000:.2f} s; units: prefill-weighted tokens (docs/flow-control.md); of "
              f"those possible: B {x['b_possible'] / 1000:.1f}k, A {x['a_possible'] / 1000:.1f}k units/s")
    else:
        speed = args.speed
        if args.capacity or args.overload is not None:
            cap = _capacity(args, trace, targets, routing, fleet_label)
            if args.capacity or cap <= 0:
                return 0 if args.capacity else 1  # --overload of no capacity: nothing to run
            speed = round(args.overload * cap, 6)
            print(f"\n{args.overload:g}x overload: speed {args.overload:g} x {cap:g} = {speed:g}")
        results = mix.priority_bands(trace, targets, routing, flow, speed, args.window_s,
                                     progress=None if args.no_progress else progress)
        window = min(args.window_s, trace[-1].timestamp_ms / 1000 / speed)
        print(f"\nthree bands on {fleet_label}, first {window:.0f} s of {args.trace} at speed {speed:g}: "
              f"tenant-1 critical, tenant-2 standard, tenant-3 sheddable; TTFT SLA {routing.ttft_sla_ms / 1000:.2f} s")
    if args.flow_set:
        print(f"what-if flow: {', '.join(args.flow_set)}")
    print(_table(mix.HEADERS, [row for r in results for row in r.rows()]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"trace": args.trace, "fleet": fleet_label, "results": [asdict(r) for r in results]}, f, indent=1)
    return 0
