"""The fleet over real HTTP: simulated MI355X nodes (+ a simulated B200 pool), gateways sharing one Redis, and peer
routers, side by side in one run, on the Wafer workload.

    .venv/bin/python -m loadtests.fleet_http --rates 0.5,0.7,0.95,1.2,1.5 --peer-rates 0.5,0.7,0.95

Rates are multiples of 2.4 req/s per node; each runs a pre-roll of the same arrivals before its measured window.
Targets (each with its own fresh simulators, so caches start equal): this router on 2 instances sharing Redis
(clients alternate), the same gateways with round_robin and least_loaded, the SGLang router cache_aware with 1 and 2
router processes (clients alternate), vllm-router cache_aware, and the LiteLLM proxy least-busy.
Peers get the MI355X replicas only (they have no notion of a per-token overflow pool); this router also has the
B200 pool for spill. A peer target named "... +B200" gets the B200 replicas as ordinary workers too. The simulators
run at `time-scale` (below 1 = slower than real time); all figures are simulated seconds. Prints a table, writes loadtests/out/fleet_http.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml
from tqdm import tqdm

from gateway.config import PerTokenPricing, hash_key
from gateway.prediction.pricing import request_cost
from gateway.routing import registry
from gateway_lab.sim.stats import window_throughput
from loadtests.peers import ensure
from loadtests.procs import Proc, cpu_seconds
from loadtests.prom import gateway_metrics_text, metrics_text, total
from loadtests.report import plot_fleet, save_json, sustained_rate, table
from loadtests.runner import run_rate, summarize, warm_up
from loadtests.workload import WaferWorkload

KEY = "sk-fleet"
B200_PRICE = {"type": "per_token", "input_per_mtok": 1.0, "cached_input_per_mtok": 0.2, "output_per_mtok": 3.2}
MI355X_PRICE = {"type": "gpu_hour", "gpus_per_replica": 4, "usd_per_gpu_hour": 2.10, "prefill_tokens_per_s": 16700,
                "decode_tokens_per_s": 3600}


def start_sims(a: argparse.Namespace, work: Path, tag: str) -> tuple[list[Proc], list[str], list[str]]:
    common = ["--time-scale", str(a.time_scale), "--stream-interval", str(a.stream_interval), "--jitter", "0"]
    kv = [] if a.kv_capacity is None else ["--kv-capacity", str(a.kv_capacity)]
    if getattr(a, "kv_events_port", None):  # SGLang's KV events, loopback only: replica i publishes on the port + 100 * i
        kv += ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{a.kv_events_port}",
                                                 "replay_endpoint": f"tcp://127.0.0.1:{a.kv_events_port + 50}"})]
    if getattr(a, "priority_scheduling", False):  # as deploy/sglang/ starts SGLang: the prefill levels take effect
        kv += ["--enable-priority-scheduling"]
    if getattr(a, "schedule_policy", None):  # SCHEDULE=shortest-prefill-first in deploy/sglang/ (0.5.21+)
        kv += ["--schedule-policy", a.schedule_policy]
    mi = Proc(f"sim-mi355x-{tag}", [sys.executable, "-m", "gateway.cli", "sim", "--enable-cache-report", "--replicas", str(2 * a.nodes),
                                   "--port", str(a.sim_port), *common, *kv], f"http://127.0.0.1:{a.sim_port}/ping",
              log=work / f"sim-mi355x-{tag}.log")
    procs = [mi]
    b_urls: list[str] = []
    if a.b200_replicas:
        b = Proc(f"sim-b200-{tag}", [sys.executable, "-m", "gateway.cli", "sim", "--enable-cache-report", "--profile", "b200-glm52", "--replicas",
                                     str(a.b200_replicas), "--port", str(a.sim_port + 100), *common],
                 f"http://127.0.0.1:{a.sim_port + 100}/ping", log=work / f"sim-b200-{tag}.log")
        procs.append(b)
        b_urls = [f"http://127.0.0.1:{a.sim_port + 100 + i}" for i in range(a.b200_replicas)]
    for p in procs:
        p.wait_ready()
    return procs, [f"http://127.0.0.1:{a.sim_port + i}" for i in range(2 * a.nodes)], b_urls


def wall_timing(timing: dict[str, float], ts: float) -> dict[str, float]:
    """A pool's TTFT-model parameters in wall-clock terms for simulators running at time scale `ts` (below 1 =
    slower): the gateway measures wall time, so its SLA and timing must be stated in it too, or every prediction
    would be off by 1/ts and the router would spill to keep an SLA that is effectively ts x 2.22 s."""
    return {"base_s": timing["base_s"] / ts, "prefill_tokens_per_s": timing["prefill_tokens_per_s"] * ts,
            "decode_step_s": timing["decode_step_s"] / ts}


MI355X_TIMING = {"base_s": 0.14, "prefill_tokens_per_s": 16700, "decode_step_s": 0.0467}  # PoolTiming defaults
B200_TIMING = {"base_s": 0.12, "prefill_tokens_per_s": 20000, "decode_step_s": 0.0365}


def routing_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """`--routing-set KEY=VALUE` (repeatable): what-if routing settings for this router (values parsed as YAML)."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--routing-set: expected KEY=VALUE, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def routing_section(policy: str, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` as a `routing:` section: those that are parameters of `policy` go into its `policy:` section
    (`--routing-set recompute_weight=0` works as before), settings no other policy takes are dropped for it."""
    own = registry.spec(policy).params.model_fields
    others = {f for s in registry.POLICIES.values() for f in s.params.model_fields} - set(own)
    return {"policy": {"type": policy, **{k: v for k, v in settings.items() if k in own and k != "type"}},
            **{k: v for k, v in settings.items() if k not in own and k not in others}}


def gateway_targets(a: argparse.Namespace, work: Path, policy: str, mi: list[str], b200: list[str], redis_url: str,
                    prefix: str, mode: str | None = None) -> tuple[list[Proc], list[str]]:
    ts = a.time_scale
    pools: list[dict[str, Any]] = [{"name": "mi355x", "kind": "sglang", "model": "zai-org/GLM-5.2", "pricing": MI355X_PRICE,
                                    "timing": wall_timing(MI355X_TIMING, ts),
                                    "replicas": [{"name": f"mi355x-{i}", "url": u} for i, u in enumerate(mi)]}]
    if b200:
        pools.append({"name": "b200", "kind": "sglang", "model": "zai-org/GLM-5.2", "pricing": B200_PRICE,
                      "timing": wall_timing(B200_TIMING, ts),
                      "replicas": [{"name": f"b200-{i}", "url": u} for i, u in enumerate(b200)]})
    cfg = {"models": [{"name": "glm-5.2", "pools": [p["name"] for p in pools]}], "pools": pools,
           "tenants": [{"name": "bench", "api_key_hashes": [hash_key(KEY)], "models": ["glm-5.2"]}],
           "routing": routing_section(policy, {
               **({} if getattr(a, "unshared", False) else {"redis_url": redis_url, "redis_prefix": prefix}),
               "ttft_sla_ms": a.sla * 1000 / ts, "stickiness_penalty_ms": 1000 / ts,
               **({} if a.ttft_quantile_z is None else {"ttft_quantile_z": a.ttft_quantile_z}),
               **routing_overrides(getattr(a, "routing_set", None)), **({"mode": mode} if mode else {})}),
           "observability": {"log_requests": False}, "timeouts": {"first_byte": 600, "total": 3000, "idle": 120}}
    path = work / f"gw-{policy}{'-' + mode if mode else ''}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    procs, urls = [], []
    for i in range(a.gateways):
        port = a.port + 2 * i  # its admin listener on port + 1
        procs.append(Proc(f"gateway-{policy}-{i}", [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path),
                                                    "--port", str(port)], f"http://127.0.0.1:{port}/healthz",
                          log=work / f"gw-{policy}-{i}.log"))
        urls.append(f"http://127.0.0.1:{port}/v1")
    return procs, urls


def sglang_router_targets(a: argparse.Namespace, work: Path, mi: list[str], n: int,
                          policy: str = "cache_aware") -> tuple[list[Proc], list[str]]:
    bin_ = ensure("sglang-router")
    if bin_ is None:
        return [], []
    procs, urls = [], []
    for i in range(n):
        port = a.port + 10 + 2 * i
        procs.append(Proc(f"sglang-router-{i}", [str(bin_ / "python"), "-m", "sglang_router.launch_router", "--worker-urls",
                                                 *mi, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
                                                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 1),
                                                 "--log-level", "warn"], f"http://127.0.0.1:{port}/v1/models",
                          log=work / f"sglang-router-{i}.log"))
        urls.append(f"http://127.0.0.1:{port}/v1")
    return procs, urls


def vllm_router_target(a: argparse.Namespace, work: Path, mi: list[str]) -> tuple[list[Proc], list[str]]:
    """vllm-router cache_aware: before each request it POSTs render/tokenize calls to every worker; the simulator
    answers those with a fast 404, which it tolerates (shared/reference/peers.md 2.2), routing on its text tree."""
    bin_ = ensure("vllm-router")
    if bin_ is None:
        return [], []
    port = a.port + 30
    p = Proc("vllm-router", [str(bin_ / "vllm-router"), "--worker-urls", *mi, "--policy", "cache_aware", "--host",
                             "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                             str(port + 1), "--log-level", "warning"], f"http://127.0.0.1:{port}/v1/models",
             log=work / "vllm-router.log")
    return [p], [f"http://127.0.0.1:{port}/v1"]


def litellm_target(a: argparse.Namespace, work: Path, mi: list[str]) -> tuple[list[Proc], list[str]]:
    bin_ = ensure("litellm")
    if bin_ is None:
        return [], []
    cfg = {"model_list": [{"model_name": "glm-5.2", "litellm_params": {"model": "hosted_vllm/zai-org/GLM-5.2", "api_base": u + "/v1",
                                                                       "api_key": "sk-none"}, "model_info": {"id": f"mi355x-{i}"}}
                          for i, u in enumerate(mi)],
           "router_settings": {"routing_strategy": "least-busy", "num_retries": 0},
           "litellm_settings": {"drop_params": False, "request_timeout": 3000}, "general_settings": {"master_key": KEY}}
    (work / "litellm.yaml").write_text(yaml.safe_dump(cfg))
    port = a.port + 20
    p = Proc("litellm", [str(bin_ / "litellm"), "--config", str(work / "litellm.yaml"), "--host", "127.0.0.1",
                         "--port", str(port)], f"http://127.0.0.1:{port}/health/liveliness",
             env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, log=work / "litellm.log")
    return [p], [f"http://127.0.0.1:{port}/v1"]


def fleet_cost(a: argparse.Namespace, res: list[Any], b200_engine: tuple[float, float, float] | None = None) -> dict[str, float]:
    """$ per million output tokens: the MI355X fleet is paid by the GPU-hour whether busy or not (nodes x 8 GPUs for
    the rate's simulated duration) plus per-token charges for what went to the B200 pool; next to the same
    requests bought entirely per token from a B200 endpoint (at the cache hits this run realized). What went to B200
    is known per request from this gateway's x-gateway-pool header, or for a peer given B200 workers from the B200
    engines' own (prompt, cached, generated) token counters over the window (`b200_engine`)."""
    b200 = PerTokenPricing.model_validate(B200_PRICE)
    ok = [r for r in res if r.ok]
    out = sum(r.completion_tokens for r in ok)
    if b200_engine is not None:
        spill = request_cost(b200, int(b200_engine[0]), int(b200_engine[1]), int(b200_engine[2]))
    else:
        spill = sum(request_cost(b200, r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in ok
                    if r.headers.get("x-gateway-pool") == "b200")
    fleet = a.nodes * 8 * MI355X_PRICE["usd_per_gpu_hour"] * a.duration / 3600
    all_b200 = sum(request_cost(b200, r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in ok)
    return {"usd_per_mtok": (fleet + spill) / out * 1e6 if out else float("nan"),
            "all_b200_usd_per_mtok": all_b200 / out * 1e6 if out else float("nan")}


COUNTERS = ("sglang:prompt_tokens_total", "sglang:cached_tokens_total", "sglang:generation_tokens_total")


async def engine_tokens(c: httpx.AsyncClient, urls: list[str]) -> tuple[float, float, float]:
    """(prompt, cached, generated) token counters summed over the replicas' /metrics: the engines' own count, for
    every target alike (LiteLLM's relayed usage lacks cached_tokens)."""
    texts = await metrics_text(c, urls)
    prompt, cached, generated = (total(texts, name) for name in COUNTERS)
    return prompt, cached, generated


def router_counters(before: list[str], after: list[str]) -> dict[str, Any]:
    """This router's own view of the window, summed over its instances: index corrections (the engine reported more
    than a chunk fewer cached tokens than predicted), predicted / reported cached tokens, and decisions by branch."""
    def delta(name: str, labels: str = "") -> float:
        return total(after, name, labels) - total(before, name, labels)

    branches = sorted({m for t in after for m in re.findall(r'gateway_routing_decisions_total\{[^}]*branch="([^"]+)"', t)})
    return {"index_corrections": delta("gateway_prefix_index_corrections"),
            "cached_predicted_over_reported": delta("gateway_cached_tokens_predicted")
            / max(delta("gateway_cached_tokens_reported"), 1.0),
            "branches": {b: delta("gateway_routing_decisions", f'branch="{b}"') for b in branches}}


def start_router(a: argparse.Namespace, work: Path, name: str, mi: list[str], b200: list[str],
                 redis_url: str) -> tuple[list[Proc], list[str]]:
    """The processes and base URLs of target `name` in front of replicas `mi` (+ `b200`); ([], []) when a peer cannot
    be installed here. Names: "this router[ / round_robin| / least_loaded]", "SGLang router <policy>[ x2]",
    "vllm-router cache_aware", "LiteLLM least-busy"; "<peer> +B200" also gives the peer the B200 replicas as ordinary
    workers (it has no notion of cost)."""
    if name.startswith("this router"):
        m = re.fullmatch(r"this router \[(approximate|precise|hybrid)\]", name)  # routing.mode (docs/kv-events.md)
        policy = "prefix_sla_cost" if m else {"this router": "prefix_sla_cost", "this router / round_robin": "round_robin",
                                              "this router / least_loaded": "least_loaded"}[name]
        return gateway_targets(a, work, policy, mi, b200 if policy == "prefix_sla_cost" else [], redis_url,
                               f"{policy}{m.group(1) if m else ''}{id(work)}:", m.group(1) if m else None)
    workers = mi + b200 if name.endswith("+B200") else mi
    if name.startswith("SGLang router"):
        policy = "round_robin" if "round_robin" in name else "cache_aware"
        return sglang_router_targets(a, work, workers, 2 if "x2" in name else 1, policy)
    if name.startswith("vllm-router"):
        return vllm_router_target(a, work, workers)
    return litellm_target(a, work, workers)


def redis_proc(port: int, work: Path) -> Proc:
    """A private redis-server for the run's gateways (never the machine's shared one)."""
    return Proc("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(work)], "http://127.0.0.1:1/", log=work / "redis.log")


def target_rates(a: argparse.Namespace, name: str) -> list[float]:
    """The rate multiples target `name` runs: this router's ramp, or the peers'."""
    ours = name == "this router" or name.startswith("this router [")
    return list(a.rates if ours else a.peer_rates or a.rates)


async def run_target(a: argparse.Namespace, work: Path, name: str, redis_url: str, bar: Any) -> list[dict[str, Any]]:
    """`bar`: the run's progress bar (tqdm), one step per rate, drawn between rates."""
    sims, mi, b200 = start_sims(a, work, re.sub(r"[^A-Za-z0-9]+", "_", name))
    procs: list[Proc] = []
    try:
        procs, urls = start_router(a, work, name, mi, b200, redis_url)
        if not procs:
            tqdm.write(f"  {name}: not available here", file=sys.stderr)
            return []
        for p in procs:
            p.wait_ready(300)
        await asyncio.sleep(2)
        wl = WaferWorkload(groups=a.groups_per_node * a.nodes, seed=a.seed)
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(timeout=3000, trust_env=False) as c:
            await warm_up(c, urls, wl, headers, per_group=1)
        rows = []
        engines = mi + b200
        ours = name.startswith("this router")
        cpu: list[float] = []
        for m in target_rates(a, name):
            rate = m * 2.4 * a.nodes
            bar.set_description(f"{name} @ {m:g}x")
            async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
                async def counters() -> tuple[tuple[float, float, float], tuple[float, float, float], list[str]]:
                    gw = await gateway_metrics_text(c, urls) if ours else []
                    cpu.append(sum(cpu_seconds(p.pid) for p in procs))  # the router's processes, at the window's ends
                    return await engine_tokens(c, engines), await engine_tokens(c, b200), gw

                async def at_window() -> tuple[tuple[float, float, float], tuple[float, float, float], list[str]]:
                    await asyncio.sleep(a.preroll / a.time_scale)
                    return await counters()

                before = asyncio.create_task(at_window())
                # the runner's own bar (simulated seconds sent) under this one
                res = await run_rate(urls, rate, a.preroll + a.duration, wl, api_key=KEY, time_scale=a.time_scale,
                                     seed=a.seed, progress=not a.no_progress)
                after = await counters()
            # steady state: requests sent during the pre-roll run (same arrivals, same fleet) but are not measured;
            # output tok/s still counts their tokens finishing inside the window (all output the fleet produced then)
            finishes = [(r.end - a.preroll, r.completion_tokens) for r in res if r.ok and r.end is not None]
            res = [r for r in res if r.sent >= a.preroll]
            for r in res:
                r.sent -= a.preroll
                r.end = None if r.end is None else r.end - a.preroll
            s = summarize(res, rate)
            s["tok_s"] = window_throughput((r.sent for r in res), finishes)
            (b_all, b_b200, b_gw), (a_all, a_b200, a_gw) = await before, after
            s["engine_hit"] = (a_all[1] - b_all[1]) / max(a_all[0] - b_all[0], 1.0)
            s["multiple"] = m
            s["router_cpu_ms_per_request"] = (cpu[-1] - cpu[-2]) * 1000 / max(len(res), 1)
            s["sla_met"] = sum(1 for r in res if r.ok and r.ttft is not None and r.ttft <= a.sla) / max(len(res), 1)
            if name.endswith("+B200"):
                d_b200 = (a_b200[0] - b_b200[0], a_b200[1] - b_b200[1], a_b200[2] - b_b200[2])
                s["spill"] = d_b200[0] / max(a_all[0] - b_all[0], 1.0)  # share of prompt tokens the B200 engines took
                s.update(fleet_cost(a, res, d_b200))
            else:
                s["spill"] = sum(r.headers.get("x-gateway-pool") == "b200" for r in res) / max(len(res), 1)
                s.update(fleet_cost(a, res))
            if ours:
                s.update(router_counters(b_gw, a_gw))
                # per request, for comparing two runs' decisions: sent (s), group, replica, prompt and cached tokens,
                # TTFT (s), the routing branch
                s["requests_log"] = [[round(r.sent, 3), r.group, r.headers.get("x-gateway-replica", ""), r.prompt_tokens,
                                      r.cached_tokens, r.ttft, r.headers.get("x-gateway-route", "")] for r in res]
            if "[precise]" in name or "[hybrid]" in name:  # the events really drove it: subscriptions at the end
                async with httpx.AsyncClient(trust_env=False) as c:
                    root = urls[0].removesuffix("/v1")  # the targets' URLs are OpenAI bases
                    kv = (await c.get(root + "/readyz", timeout=10)).json().get("kv_events", {})
                s["kv_events_healthy"] = f"{kv.get('healthy')}/{kv.get('total')}"
            rows.append(s)
            own = (f" index corrections {s['index_corrections']:.0f} predicted/reported cached "
                   f"{s['cached_predicted_over_reported']:.3f}" if ours else "")
            tqdm.write(f"  {name} @ {rate:.1f} req/s: hit {s['cache_hit']:.3f} p95 {s['ttft_p95']:.2f} s "
                       f"success {s['success']:.3f} router CPU {s['router_cpu_ms_per_request']:.2f} ms/request{own}",
                       file=sys.stderr)
            bar.update()
        return rows
    finally:
        for p in procs + sims:
            p.stop()


async def main_async(a: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="gw-fleet-"))
    redis = redis_proc(a.redis_port, work)
    await asyncio.sleep(0.5)
    redis_url = f"redis://127.0.0.1:{a.redis_port}/0"
    results: dict[str, list[dict[str, Any]]] = {}
    names = [name.strip() for name in a.targets.split(",")]
    # one step per (target, rate), drawn between rates; the runner's bar under it advances with the arrivals
    tqdm.monitor_interval = 0  # no tqdm monitor thread waking in the measuring client
    try:
        with tqdm(total=sum(len(target_rates(a, n)) for n in names), unit="rate", file=sys.stderr, leave=False,
                  disable=a.no_progress) as bar:
            for name in names:
                n0 = bar.n
                try:
                    results[name] = await run_target(a, work, name, redis_url, bar)
                except RuntimeError as e:  # a peer that does not start here is reported, not the end of the run
                    tqdm.write(f"  {name}: {e} (logs in {work})", file=sys.stderr)
                    results[name] = []
                bar.update(len(target_rates(a, name)) - (bar.n - n0))  # the rates of a target that did not run
                save_json(a.out, {"args": vars(a), "results": results})  # a later crash loses nothing
    finally:
        redis.stop()
    rows = [[name, f"{s['multiple']:.2f}", f"{s['rate']:.1f}", f"{s['cache_hit'] * 100:.1f}%",
             f"{s['engine_hit'] * 100:.1f}%", f"{s['ttft_p50']:.2f}",
             f"{s['ttft_p95']:.2f}", f"{s['success'] * 100:.1f}%", f"{s['sla_met'] * 100:.1f}%", f"{s['spill'] * 100:.1f}%",
             f"{s['tok_s']:.0f}", f"{s['usd_per_mtok']:.2f}", f"{s['all_b200_usd_per_mtok']:.2f}"]
            for name, rs in results.items() for s in rs]
    print(f"\nFleet over HTTP: {a.nodes} MI355X nodes ({2 * a.nodes} replicas) + {a.b200_replicas} B200 replicas, "
          f"{a.gateways} gateway instances {'each with its own state' if a.unshared else 'on one Redis'}, Wafer workload, {a.duration:.0f} simulated s measured per rate "
          f"after a {a.preroll:.0f} s pre-roll, time scale {a.time_scale}")
    print(table(["target", "x 2.4/node", "req/s", "hit (usage)", "hit (engines)", "TTFT p50", "TTFT p95", "success", f"TTFT<={a.sla}s",
                 "spill", "tok/s", "$/Mtok out", "all-B200 $/Mtok"], rows))
    sustained = {name: sustained_rate(rs, a.sla) for name, rs in results.items() if rs}
    peers = {k: v for k, v in sustained.items() if k != "this router"}
    print(f"\nSustained rate (highest measured with TTFT p95 <= {a.sla} s and 100% success), req/s:")
    for k, v in sustained.items():
        print(f"  {k}: {v:.1f}")
    if "this router" in sustained and peers:
        best = max(peers, key=lambda k: peers[k])
        print(f"  this router / best other ({best}): {sustained['this router'] / peers[best]:.2f}x"
              if peers[best] else f"  no other target sustained its lowest measured rate ({best} best)")
    save_json(a.out, {"args": vars(a), "results": results, "sustained": sustained})
    plot_fleet(a.out, {k: v for k, v in results.items() if v},
               f"{a.nodes} MI355X nodes + {a.b200_replicas} B200 replicas over HTTP, Wafer workload", a.sla)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--b200-replicas", type=int, default=12)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--unshared", action="store_true", help="this router's instances keep their state in memory, each "
                   "its own (no Redis): each index sees only its own dispatches")
    rates = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--rates", type=rates, default=[0.5, 0.7, 0.95, 1.2, 1.5], help="this router's ramp")
    p.add_argument("--peer-rates", type=rates, default=None, help="the other targets' ramp (default: --rates)")
    p.add_argument("--duration", type=float, default=60.0, help="measured simulated seconds per rate")
    p.add_argument("--preroll", type=float, default=60.0, help="simulated seconds per rate sent before measuring")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--stream-interval", type=int, default=16)
    p.add_argument("--kv-capacity", type=int, default=None, help="KV tokens per MI355X replica (default: the profile's)")
    p.add_argument("--groups-per-node", type=int, default=16)
    p.add_argument("--kv-events-port", type=int, default=None, help="the MI355X simulators publish KV events from this "
                   "port (replica i: + 100 * i); targets 'this router [precise]' / '[hybrid]' route on them")
    p.add_argument("--priority-scheduling", action="store_true", help="the MI355X simulators schedule by priority "
                   "(--enable-priority-scheduling, as deploy/sglang/ starts SGLang), so this router's prefill levels "
                   "apply (routing.shortest_prefill_first)")
    p.add_argument("--sla", type=float, default=2.22)
    p.add_argument("--routing-set", action="append", metavar="KEY=VALUE", help="a routing setting for this router "
                   "(repeatable), e.g. recompute_weight=0")
    p.add_argument("--ttft-quantile-z", type=float, default=None, help="routing.ttft_quantile_z for this router "
                   "(default: the gateway's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--targets", default="this router,this router / round_robin,this router / least_loaded,"
                                        "SGLang router cache_aware x1,SGLang router cache_aware x2,vllm-router cache_aware,"
                                        "LiteLLM least-busy")
    p.add_argument("--out", default="fleet_http", help="results: loadtests/out/<out>.{json,png}")
    p.add_argument("--port", type=int, default=19000)
    p.add_argument("--sim-port", type=int, default=19100)
    p.add_argument("--redis-port", type=int, default=19390)
    p.add_argument("--no-progress", action="store_true", help="no progress bars (stderr)")
    # SIGTERM ends the run like Ctrl-C: the `finally` blocks stop every process it started (by PID)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
