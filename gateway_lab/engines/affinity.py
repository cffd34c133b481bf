"""`gateway engines affinity`: the routing figure against real engines, measured by the engines' own counters.

The same multi-turn workload (distinct prefix per session, turns in order) through: this gateway (approximate),
this gateway in precise mode (the engines' KV events, the model's tokenizer), two gateway instances each keeping its
own index (turns alternate between them), and round-robin straight to the servers; against SGLang (pool kind
`sglang`) or vLLM (`vllm`). In precise mode this instance's own (speculative) entry stands `SPECULATIVE_S` after
dispatch and each session then idles `IDLE_S` before its next turn, longer than that: a later turn is a
`prefix_hit` only through the engine's own events (the table counts them). Sessions run one after another
(every turn of the first, then the second...), as a user's conversation does, so round-robin moves a session at
every turn whatever the number of servers. Each run uses fresh sessions (new prefixes), so no run profits from
another's cache.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

from gateway.app import create_app
from gateway.config import hash_key, parse_config
from gateway.servers import free_ports, make_server
from gateway_lab.engines.envs import EngineEnv
from gateway_lab.engines.servers import running
from gateway_lab.engines.workload import Result, Session, direct_round_robin, run_sessions

KEY = "sk-engines-affinity"
SPECULATIVE_S = 1.0  # precise mode: routing.speculative_ttl_s and kv_events.speculative_s
IDLE_S = 2.0  # precise mode: a session's pause before each later turn, longer than SPECULATIVE_S


def gateway_config(urls: list[str], model_dir: Path, mode: str, kind: str = "sglang", page: int = 64
                   ) -> dict[str, Any]:
    """`page`: the servers' page size (the precise index hashes at the size the engines publish)."""
    routing: dict[str, Any] = {"mode": mode, "chunk_tokens": 256}
    if mode != "approximate":
        routing["speculative_ttl_s"] = SPECULATIVE_S
        routing["kv_events"] = {"discovery_interval_s": 0.5, "block_size": page, "speculative_s": SPECULATIVE_S,
                                "tokenizer": {"kind": "hf", "path": str(model_dir)}}
    return {"models": [{"name": "tiny", "pools": ["p"]}],
            "pools": [{"name": "p", "kind": kind, "model": "tiny",
                       "replicas": [{"name": f"p-{i}", "url": u} for i, u in enumerate(urls)]}],
            "tenants": [{"name": "t", "api_key_hashes": [hash_key(KEY)], "models": ["tiny"]}],
            "timeouts": {"connect": 2.0, "first_byte": 120.0, "idle": 60.0, "total": 300.0},
            "routing": routing}


class InProcessGateway:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.app = create_app(parse_config(cfg))
        self.port = free_ports("127.0.0.1", 1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(self.app, "127.0.0.1", self.port)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=lambda: self.loop.run_until_complete(self.server.serve()), daemon=True)

    def __enter__(self) -> InProcessGateway:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def _alternating(urls: list[str], sessions: list[Session], turns: int) -> Result:
    """Two instances with their own index: turn t of every session goes to instance t % 2."""
    for s in sessions:
        for t in range(turns):
            run_sessions(urls[t % len(urls)], [s], 1, headers={"Authorization": f"Bearer {KEY}"}, model="tiny")
    return Result("two instances, own index each", sessions)


def measure(urls: list[str], model_dir: Path, sessions: int, turns: int, kind: str = "sglang",
            dp_size: int = 1, page: int = 64) -> list[Result]:
    h = {"Authorization": f"Bearer {KEY}"}
    out = []
    with InProcessGateway(gateway_config(urls, model_dir, "approximate", kind)) as gw:
        out.append(run_sessions(gw.url, [Session(f"approx-{i}") for i in range(sessions)], turns, h,
                                label="gateway, approximate", by_session=True))
    with InProcessGateway(gateway_config(urls, model_dir, "precise", kind, page)) as gw:
        time.sleep(2)  # discovery (0.5 s) and the subscriptions' first connect: precise from the first request
        out.append(run_sessions(gw.url, [Session(f"precise-{i}") for i in range(sessions)], turns, h,
                                label=f"gateway, precise (KV events; idle {IDLE_S:g} s > speculative {SPECULATIVE_S:g} s)",
                                by_session=True, between=lambda: time.sleep(IDLE_S)))
    with InProcessGateway(gateway_config(urls, model_dir, "approximate", kind)) as a, \
            InProcessGateway(gateway_config(urls, model_dir, "approximate", kind)) as b:
        out.append(_alternating([a.url, b.url], [Session(f"two-{i}") for i in range(sessions)], turns))
    rr = direct_round_robin(urls, [Session(f"rr-{i}") for i in range(sessions)], turns, by_session=True)
    if dp_size > 1:  # the servers' own DP controllers spread each server's share over its ranks
        rr.label += f" (each server's {dp_size} ranks chosen by SGLang)"
    out.append(rr)
    return out


def _prefix_hits(r: Result) -> str:
    """Later turns the gateway routed as `prefix_hit`, of all later turns ("-" where no gateway routed)."""
    later = [route for s in r.sessions for route in s.routes[1:]]
    if not any(later):
        return "-"
    return f"{sum(x == 'prefix_hit' for x in later)} of {len(later)}"


def table(results: list[Result]) -> str:
    lines = ["| router | prompt tokens cached (all turns) | turns 2+ | sessions moved | turns 2+ routed prefix_hit |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.label} | {r.hit_rate:.1%} | {r.later_hit_rate:.1%} | {r.moves} | {_prefix_hits(r)} |")
    return "\n".join(lines) + "\n"


def run_affinity(env: EngineEnv, model_dir: Path, logs: Path, n: int, sessions: int, turns: int,
                 dp_size: int = 1) -> str:
    """`dp_size` > 1 (SGLang): each server runs that many DP ranks, one core each; the gateway makes each rank a
    target of its own, pinned by `routed_dp_rank` (pool `dp_pinning: auto`)."""
    t0 = time.monotonic()
    flags: dict[str, object] = {"dp_size": dp_size} if dp_size > 1 else {}
    with running(env, str(model_dir), n, logs, flags=flags or None) as fleet:
        results = measure(fleet.urls, model_dir, sessions, turns, kind=env.recipe.engine, dp_size=dp_size,
                          page=fleet.servers[0].flags.page_size)
    ranks = f" with {dp_size} DP ranks each" if dp_size > 1 else ""
    return (f"{n} real {env.recipe.engine} {env.recipe.version} servers{ranks} (engine kit, CPU), {sessions} sessions "
            f"x {turns} turns each, cached tokens as the engines reported them ({time.monotonic() - t0:.0f} s):\n\n"
            + table(results))
