"""`gateway sim`: N independent simulated SGLang replicas in one process, one per port."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from gateway.servers import free_ports, make_server, serve_all, taken_port_error
from gateway_lab.sim.kv_events import KvEventsConfig, port_of
from gateway_lab.sim.profiles import (
    PROFILES,
    SCHEDULE_POLICIES,
    SGLANG_VERSIONS,
    ReplicaConfig,
    for_version,
    profile,
)
from gateway_lab.sim.replica import Replica
from gateway_lab.sim.server import create_sim_app


def register(sub: Any) -> None:
    p = sub.add_parser("sim", help="run simulated SGLang replicas")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=2, help="number of servers (ports PORT..PORT+N-1)")
    p.add_argument("--port", type=int, default=30000, help="first port (SGLang's default); 0: free ports the OS picks")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--profile", default="mi355x-glm52-tp4", choices=sorted(PROFILES))
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--kv-capacity", type=int, default=None, help="max_total_num_tokens per DP rank")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--dp-size", type=int, default=None, help="DP ranks per server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-scale", type=float, default=1.0, help="k > 1 runs k times faster than real time")
    p.add_argument("--jitter", type=float, default=None, help="lognormal sigma per forward")
    p.add_argument("--stream-interval", type=int, default=None)
    p.add_argument("--sse-style", choices=["0.5.9", "0.5.13"], default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--sglang-version", choices=sorted(SGLANG_VERSIONS), default="0.5.23",
                   help="the release whose HTTP surface is served (/v1/loads, /get_load, /server_info, rank pinning)")
    p.add_argument("--enable-cache-report", action="store_true",
                   help="usage carries prompt_tokens_details.cached_tokens (off by default, as in SGLang)")
    p.add_argument("--enable-dp-attention", action="store_true",
                   help="with --dp-size N: on 0.5.23 /server_info reads dp_size 1, attn_dp_size N")
    p.add_argument("--schedule-policy", choices=sorted(SCHEDULE_POLICIES), default=None,
                   help="fcfs (SGLang's default) or shortest-prefill-first (0.5.21+; not with priority scheduling)")
    p.add_argument("--enable-priority-scheduling", action="store_true")
    p.add_argument("--schedule-low-priority-values-first", action="store_true")
    p.add_argument("--default-priority-value", type=int, default=None, help="priority of requests without one (0.5.13+)")
    p.add_argument("--priority-scheduling-preemption-threshold", type=int, default=None)
    p.add_argument("--disable-priority-preemption", action="store_true")
    p.add_argument("--abort-on-priority-when-disabled", action="store_true")
    p.add_argument("--report-incarnation", action="store_true",
                   help="add a (non-SGLang) incarnation id to /server_info that changes on restart")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV-cache events as SGLang does, e.g. \'{"publisher":"zmq","endpoint":"tcp://*:5557",'
                        '"replay_endpoint":"tcp://*:5558"}\' (ports + DP rank; with --replicas N, replica i adds 100*i)')
    p.add_argument("--kv-events-port-collision", action="store_true",
                   help="0.5.9/0.5.13 under plain DP: every rank binds port + 0, so only rank 0 publishes (the pre-fix bug)")
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null",
                   help="SGLang's PD role of every server (the KV transfer is simulated within this process)")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998,
                   help="a prefill server's bootstrap port (with --replicas N, replica i uses PORT + i)")
    p.add_argument("--disaggregation-transfer-backend", choices=["mooncake", "mori", "nixl", "fake"], default=None)
    p.add_argument("--disaggregation-decode-local-prefill", action="store_true",
                   help="(not SGLang) a decode server also serves requests without bootstrap fields, prefilling them")
    p.add_argument("--pd", default=None, metavar="P:D",
                   help="a PD deployment in one process: P prefill servers (ports PORT..), then D decode servers")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any server argument or timing parameter, e.g. --set alpha=64 --set t_api=0")


def config_from_args(a: argparse.Namespace) -> ReplicaConfig:
    over = {
        "served_model_name": a.served_model_name,
        "max_total_num_tokens": a.kv_capacity,
        "page_size": a.page_size,
        "max_running_requests": a.max_running_requests,
        "max_queued_requests": a.max_queued_requests,
        "chunked_prefill_size": a.chunked_prefill_size,
        "dp_size": a.dp_size,
        "time_scale": a.time_scale,
        "jitter_sigma": a.jitter,
        "stream_interval": a.stream_interval,
        "sse_style": a.sse_style,
        "api_key": a.api_key,
        "seed": a.seed,
        "schedule_policy": a.schedule_policy,
    }
    over["disaggregation_transfer_backend"] = a.disaggregation_transfer_backend
    flags = ("disaggregation_decode_local_prefill", "enable_cache_report", "enable_dp_attention", "enable_priority_scheduling",
             "schedule_low_priority_values_first", "disable_priority_preemption", "abort_on_priority_when_disabled",
             "report_incarnation")
    over.update({f: True for f in flags if getattr(a, f)})
    over["priority_scheduling_preemption_threshold"] = a.priority_scheduling_preemption_threshold
    if a.default_priority_value is not None:
        if a.sglang_version == "0.5.9":
            raise SystemExit("--default-priority-value: not in SGLang 0.5.9 (added in 0.5.13)")
        over["default_priority_value"] = a.default_priority_value
    if a.kv_events_config is not None:
        try:
            KvEventsConfig.parse(a.kv_events_config)
        except (ValueError, TypeError) as e:
            raise SystemExit(str(e)) from None
        over["kv_events_config"] = a.kv_events_config
    if a.kv_events_port_collision:
        if a.sglang_version == "0.5.23":
            raise SystemExit("--kv-events-port-collision: fixed in 0.5.23 (sglang PR #29211); use 0.5.9 or 0.5.13")
        over["kv_events_port_collision"] = True
    cfg = for_version(profile(a.profile), a.sglang_version)
    cfg = cfg.with_overrides(**{k: v for k, v in over.items() if v is not None})
    extra = {}
    for item in a.set:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        if key not in cfg.__dataclass_fields__ and key not in cfg.timing.__dataclass_fields__:
            raise SystemExit(f"--set: unknown setting {key!r}")
        extra[key] = _parse_value(raw)
    cfg = cfg.with_overrides(**extra) if extra else cfg
    try:
        cfg.check_schedule()
    except ValueError as e:
        raise SystemExit(f"gateway sim: {e}") from None
    return cfg


def _parse_value(raw: str) -> object:
    import json

    try:
        return json.loads(raw)
    except ValueError:
        return raw


def roles(a: argparse.Namespace) -> list[str]:
    """The disaggregation mode of each server: `--pd P:D`, else `--disaggregation-mode` for all `--replicas`."""
    if a.pd is None:
        return [a.disaggregation_mode] * a.replicas
    p, sep, d = a.pd.partition(":")
    if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
        raise SystemExit(f"--pd expects P:D with P, D >= 1 (prefill and decode servers), got {a.pd!r}")
    return ["prefill"] * int(p) + ["decode"] * int(d)


def run(a: argparse.Namespace) -> int:
    from gateway_lab.sim.pd_bootstrap import create_bootstrap_app

    cfg = config_from_args(a)
    modes = roles(a)
    n = len(modes)
    ports = free_ports(a.host, n) if a.port == 0 else [a.port + i for i in range(n)]
    boot = [a.disaggregation_bootstrap_port + i for i, m in enumerate(modes) if m == "prefill"]
    taken = taken_port_error("gateway sim", a.host, ports + boot,
                             "--port (replicas use PORT..PORT+N-1; 0 picks free ports) or --disaggregation-bootstrap-port")
    if taken:
        print(taken, file=sys.stderr)
        return 2
    servers = []
    for i, mode in enumerate(modes):
        over: dict[str, Any] = {"seed": cfg.seed + i, "kv_events_config": kv_events_for(cfg.kv_events_config, i),
                                "disaggregation_mode": mode}
        if mode == "prefill":
            over["disaggregation_bootstrap_port"] = a.disaggregation_bootstrap_port + i
        rep = Replica(cfg.with_overrides(**over), name=f"{cfg.profile}-{mode + '-' if mode != 'null' else ''}{i}")
        servers.append(make_server(create_sim_app(rep), a.host, ports[i], timeout_keep_alive=5,
                                   timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
        if mode == "prefill":
            servers.append(make_server(create_bootstrap_app(rep), a.host, over["disaggregation_bootstrap_port"],
                                       timeout_keep_alive=5))

    def started() -> None:
        urls = " ".join(f"http://{a.host}:{p}" + (f" ({m})" if m != "null" else "") for p, m in zip(ports, modes))
        print(f"simulated SGLang replicas ({cfg.profile}, time scale {cfg.time_scale}): {urls}", file=sys.stderr, flush=True)

    stop_on_signal(servers, SHUTDOWN_GRACE_S)
    asyncio.run(serve_all(servers, on_started=started))
    return 0


def kv_events_for(raw: str | None, replica: int) -> str | None:
    """Replica i of one `gateway sim` process publishes on the configured ports + 100*i (its ranks add 0..dp-1)."""
    if raw is None or replica == 0:
        return raw
    data = json.loads(raw)
    for k in ("endpoint", "replay_endpoint"):
        if isinstance(data.get(k), str) and port_of(data[k]) is not None:
            host, port = data[k].rsplit(":", 1)
            data[k] = f"{host}:{int(port) + 100 * replica}"
    return json.dumps(data)


SHUTDOWN_GRACE_S = 2.0  # in-flight requests get this long after SIGTERM; then they are cut


def stop_on_signal(servers: list[Any], grace: float) -> None:
    """SIGINT/SIGTERM stop the simulator whatever it is doing.

    The signals are taken by a thread (`sigwait`), not by the event loop: a loop handler cannot run while a
    request holds the loop, and a draining server waits for every in-flight request (a hang fault never ends).
    The thread asks the servers to exit (uvicorn cancels what is still running after `grace`); if the process is
    still alive after a second signal or `grace` + 2 s, it exits at once."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    # the requests cancelled at the end of the grace period are expected: no traceback per request in the log
    logging.getLogger("uvicorn.error").addFilter(
        lambda r: not (r.exc_info and isinstance(r.exc_info[1], asyncio.CancelledError)))
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # threads started later (the loop's executor) inherit the mask

    def watch() -> None:
        sig = signal.sigwait(sigs)
        for s in servers:
            s.should_exit = True
        if signal.sigtimedwait(sigs, grace + 2.0) is None:
            print(f"gateway sim: still busy {grace + 2.0:.0f} s after {signal.Signals(sig).name}; exiting now",
                  file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="sim-signals", daemon=True).start()
