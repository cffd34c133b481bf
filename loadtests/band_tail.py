"""What the top band's late requests waited on, in the three-band scenario on the virtual clock.

    python -m loadtests.band_tail TRACE --nodes 2 --speed S [--window-s W] [--flow-set FIELD=VALUE ...] [--no-flow]

Runs the `--bands` scenario's flow-control arm (gateway_lab/replay/mix.py: the trace split into three tenants,
critical, standard, sheddable, their engine classes high, normal, low) and, for every request of the critical
tenant that could meet its SLA (alone on an idle replica holding its cached prefix) and did not, splits its TTFT:

- gateway: held in flow control's queue before dispatch;
- own: its prefill alone on an idle replica with what it found cached there (the `possible` measure's TTFT);
- engine: the rest, the time it waited on the engine, and what was ahead of it there when it was dispatched: the
  prefill left of requests already started (SGLang's chunked request goes on first, whatever its priority) and of
  waiting requests at or above its priority, by band;
- cold: it was placed where less of its prompt was cached than on the warmest replica (by more than a chunk).

Each late request is put under the largest part of its excess over the SLA (gateway, engine behind a started
lower-band prefill, engine behind the critical band's own work, cold placement). A diagnosis, not a figure of the
results pages; the results name the command.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.config import Routing
from gateway.flow.settings import FlowPolicy
from gateway.recording.trace import read_trace
from gateway.upstreams import DEFAULT_PRIORITY_VALUES
from gateway_lab.replay.cli import flow_what_if
from gateway_lab.replay.mix import BANDS, split_bands, tenant_name
from gateway_lab.replay.run import nodes_targets, to_job
from gateway_lab.sim.fleet import Fleet


@dataclass
class Ahead:
    started: dict[str, int] = field(default_factory=dict)  # band -> prefill tokens left of requests already started
    waiting: dict[str, int] = field(default_factory=dict)  # band -> uncached tokens of waiting requests >= priority
    decoding: int = 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    trace = read_trace(args.trace)
    mixed = [r for r in split_bands(trace, args.speed) if r.timestamp_ms <= args.window_s * 1000]
    band_of = {tenant_name(k + 1): b for k, b in enumerate(BANDS)}
    pol = {t: FlowPolicy(band=b) for t, b in band_of.items()}
    prio = {t: DEFAULT_PRIORITY_VALUES[c] for t, c in zip(pol, ("high", "normal", "low"))}
    routing = Routing()
    sla = routing.ttft_sla_ms / 1000
    flow = flow_what_if(args.flow_set).model_copy(update={"enabled": not args.no_flow})
    fleet = Fleet(nodes_targets(args.nodes), routing, 1, True, flow=flow, flow_tenants=pol, tenant_priority=prio)
    tenant_of_rid = {f"t{i}": tenant_name(r.tenant) for i, r in enumerate(mixed)}
    ahead: dict[int, Ahead] = {}

    mine = prio[tenant_name(1)]

    def snapshot(name: str, floor: int | None) -> Ahead:
        """What is ahead on rank `name`: started prefills, and waiting requests at or above `floor` (None: all)."""
        rank = fleet.ranks[name].rank
        a = Ahead(decoding=sum(1 for r in rank.running if r.done_prefill and not r.finished))
        for r in rank.waiting:
            band = band_of.get(tenant_of_rid.get(r.rid, ""), "?")
            left = max(0, r.prompt_len - r.cached - r.prefilled) if r.started else r.prompt_len
            if r.started:
                a.started[band] = a.started.get(band, 0) + left
            elif floor is None or r.priority >= floor:
                a.waiting[band] = a.waiting.get(band, 0) + left
        return a

    at_arrival: dict[str, dict[str, Ahead]] = {}  # critical request -> every rank's queue when it arrived
    rid_of: dict[int, tuple[str, str]] = {}  # record index -> (request id, rank)
    arrive = fleet._arrive

    def on_arrive(k: int, job: Any) -> None:
        if tenant_of_rid.get(job.req.request_id) == tenant_name(1):
            at_arrival[job.req.request_id] = {n: snapshot(n, None) for n in fleet.ranks}
        arrive(k, job)

    def on_decision(inst: Any, req: Any, decision: Any) -> None:
        if decision.chosen is None or tenant_of_rid.get(req.request_id) != tenant_name(1):
            return
        ahead[len(fleet.records)] = snapshot(decision.chosen.name, mine)
        rid_of[len(fleet.records)] = (req.request_id, decision.chosen.name)

    fleet._arrive = on_arrive  # type: ignore[method-assign]
    fleet.on_decision = on_decision
    page = nodes_targets(1)[0][1].page_size

    def arrivals() -> Iterator[tuple[float, Any]]:
        for i, r in enumerate(mixed):
            yield r.timestamp_ms / 1000, functools.partial(to_job, r, i, routing.chunk_tokens, page, sla)

    fleet.feed(arrivals())
    recs = fleet.run()
    top = [(i, r) for i, r in enumerate(recs) if r.tenant == tenant_name(1)]
    possible = [(i, r) for i, r in top if r.idle_ttft is None or r.idle_ttft <= sla]
    late = [(i, r) for i, r in possible if r.ttft is None or r.ttft > sla]
    causes: dict[str, int] = {}
    rows = []
    for i, r in late:
        a = ahead.get(i, Ahead())
        if r.ttft is None:
            causes["refused"] = causes.get("refused", 0) + 1
            continue
        own = r.idle_ttft or 0.0
        engine = max(0.0, r.ttft - r.queued_s - own)
        lower_started = sum(v for b, v in a.started.items() if b != "critical")
        cold = r.best_cached - r.cached > routing.chunk_tokens
        parts = {"gateway queue": r.queued_s,
                 "engine: behind a started lower-band prefill" if lower_started else "engine: behind critical work":
                     engine}
        cause = max(parts, key=lambda k: parts[k])
        if cold and parts[cause] < (r.ttft - sla):
            cause = "cold placement"
        causes[cause] = causes.get(cause, 0) + 1
        rid, rank = rid_of.get(i, ("", ""))
        then = at_arrival.get(rid, {}).get(rank, Ahead())
        rows.append((r.arrival, r.ttft, r.queued_s, own, engine, r.cached, r.best_cached, dict(a.started),
                     dict(a.waiting), a.decoding, cause, rank, dict(then.started), dict(then.waiting)))
    return {"top": len(top), "possible": len(possible), "late": len(late), "causes": causes, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--speed", type=float, required=True)
    p.add_argument("--window-s", type=float, default=1e9)
    p.add_argument("--flow-set", action="append", default=[], metavar="FIELD=VALUE")
    p.add_argument("--no-flow", action="store_true", help="the arm without flow control (engine classes alone)")
    p.add_argument("--rows", action="store_true", help="print every late request")
    args = p.parse_args()
    out = run(args)
    print(f"critical: {out['top']} requests, {out['possible']} could meet the SLA, {out['late']} of those late")
    for k, v in sorted(out["causes"].items(), key=lambda kv: -kv[1]):
        print(f"  {k}: {v}")
    if args.rows:
        print("arrival ttft queued own engine cached best_cached | at dispatch on its rank: started, waiting >= its "
              "priority, decoding | cause | rank | on that rank when it arrived: started, every waiting")
        for row in out["rows"]:
            print(" ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in row))


if __name__ == "__main__":
    main()
