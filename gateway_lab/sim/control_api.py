"""The endpoints that change one simulated SGLang server: SGLang's control hooks and the /_sim test controls
(config, injected faults, KV-event drops, state)."""

from __future__ import annotations

import asyncio

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway_lab.sim.pd import FABRIC
from gateway_lab.sim.protocol import SimHTTPError
from gateway_lab.sim.replica import Fault, Replica
from gateway_lab.sim.sim_request import Event, EventKind
from gateway_lab.sim.wire import (
    error_response,
    json_response,
    read_json,
)


class ControlApi:
    """SGLang's control hooks (abort, pause, slow_down...) and the simulator's own /_sim API (config, faults, state)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    # -- SGLang control hooks --------------------------------------------------------------------------------
    async def abort_request(self, request: Request) -> Response:
        try:
            body = await read_json(request)
        except SimHTTPError as e:
            return error_response(e.status, e.message, e.type)
        if body.get("abort_all"):
            self.replica.abort_all()
        else:
            rid = body.get("rid")
            for sub in list(self.replica._inflight):
                if any(r.rid.rsplit("-", 1)[0] == rid for r in sub.requests):
                    for i, _ in enumerate(sub.requests):
                        sub.queue.put_nowait((i, Event(EventKind.ABORT, self.replica.now(), reason="Aborted by /abort_request.", code=500)))
                    self.replica.cancel(sub)
        return Response(status_code=200)

    async def slow_down(self, request: Request) -> Response:
        body = orjson.loads(await request.body() or b"{}")
        t = body.get("forward_sleep_time")
        for r in self.replica.ranks:
            r.rank.forward_sleep = float(t or 0.0)
        return json_response({"success": True})

    async def pause(self, request: Request) -> Response:
        for r in self.replica.ranks:
            r.rank.paused = True
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: Request) -> Response:
        for r in self.replica.ranks:
            r.rank.paused = False
            r.kick()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def noop(self, request: Request) -> Response:
        return json_response({"success": True, "message": "ok (simulated)"})

    # -- /_sim control API -----------------------------------------------------------------------------------
    async def sim_config(self, request: Request) -> Response:
        rep = self.replica
        if request.method == "POST":
            try:
                changes = orjson.loads(await request.body() or b"{}")
                if not isinstance(changes, dict):
                    raise ValueError("expected a JSON object")  # noqa: TRY004 - caught below as a 400, like a bad value
                unknown = set(changes) - set(rep.cfg.__dataclass_fields__) - set(rep.cfg.timing.__dataclass_fields__) - {"slow_factor"}
                if unknown:
                    raise ValueError(f"unknown settings: {sorted(unknown)}")
                slow = changes.pop("slow_factor", None)
                if slow is not None and (not isinstance(slow, (int, float)) or slow <= 0):
                    raise ValueError("slow_factor must be a positive number")
                rep.reconfigure(**changes)
                if slow is not None:
                    for r in rep.ranks:
                        r.rank.slow_factor = float(slow)
            except (ValueError, TypeError, orjson.JSONDecodeError) as e:
                return error_response(400, str(e), "BadRequestError")
        return json_response({**{k: v for k, v in rep.cfg.__dict__.items() if k != "timing"}, "timing": rep.cfg.timing.__dict__,
                      "slow_factor": rep.ranks[0].rank.slow_factor if rep.ranks else 1.0})

    async def sim_fault(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body() or b"{}")
            kind = body.get("kind")
            if kind == "clear":
                self.replica.faults.clear()
                self._slow(1.0, 1.0)
                return json_response({"faults": []})
            if kind == "slow":  # lasting, until cleared: {"phase": "prefill"|"decode"|"both", "factor": k}
                phase, factor = body.get("phase", "both"), body.get("factor")
                if phase not in ("prefill", "decode", "both"):
                    raise ValueError("phase must be prefill, decode or both")
                if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1000:
                    raise ValueError("factor must be a number in (0, 1000]")
                rank = self.replica.ranks[0].rank
                self._slow(float(factor) if phase != "decode" else rank.prefill_slow,
                           float(factor) if phase != "prefill" else rank.decode_slow)
                return json_response({"slow": {"prefill": float(rank.prefill_slow), "decode": float(rank.decode_slow)}})
            if kind == "restart":
                asyncio.get_running_loop().create_task(self.replica.restart(float(body.get("startup_seconds", 0.0))))
                return json_response({"restarting": True})
            if kind == "transfer_stall":  # the next `count` KV transfers of this process never complete
                FABRIC.stall_next += int(body.get("count", 1))
                return json_response({"transfer_stall": FABRIC.stall_next})
            if kind not in ("reset_after_chunks", "reset_before_headers", "hang", "hang_after_first", "status"):
                raise ValueError(f"unknown fault kind {kind!r}")
            f = Fault(kind, n=int(body.get("n", 0)), status=int(body.get("status", 503)), count=int(body.get("count", 1)))
        except (ValueError, TypeError, AttributeError, orjson.JSONDecodeError) as e:
            return error_response(400, str(e), "BadRequestError")
        self.replica.faults.append(f)
        return json_response({"faults": [f.__dict__ for f in self.replica.faults]})

    def _slow(self, prefill: float, decode: float) -> None:
        for r in self.replica.ranks:
            r.rank.prefill_slow, r.rank.decode_slow = prefill, decode

    async def sim_kv_events(self, request: Request) -> Response:
        """/_sim/kv_events. GET: each rank's publisher (seq, buffered batches). POST {"drop_batches": n}: send
        nothing for the next n batches of every rank (they keep their sequence numbers and stay replayable)."""
        pub = self.replica.kv_events
        if pub is None:
            return error_response(400, "KV events are off (start with --kv-events-config)", "BadRequestError")
        if request.method == "POST":
            try:
                body = orjson.loads(await request.body() or b"{}")
                n = body.get("drop_batches", 0) if isinstance(body, dict) else None
                if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                    raise ValueError("drop_batches must be a non-negative integer")
            except (ValueError, orjson.JSONDecodeError) as e:
                return error_response(400, str(e), "BadRequestError")
            pub.drop_next(n)
        return json_response({"ranks": pub.state()})

    async def sim_state(self, request: Request) -> Response:
        rep = self.replica
        ranks = []
        for r in rep.ranks:
            rk = r.rank
            ranks.append({
                "dp_rank": rk.dp_rank,
                "waiting": [q.rid for q in rk.waiting],
                "running": [q.rid for q in rk.running],
                "cache_pages": len(rk.cache.nodes),
                "cache_tokens": rk.cache.total_tokens,
                "evictable_tokens": rk.cache.evictable_tokens,
                "reserved_tokens": rk.reserved,
                "evicted_pages": rk.cache.stats.evicted_pages,
                "counters": rk.counters.__dict__,
                "lag": r.lag.as_dict(),
                "paused": rk.paused,
            })
        return json_response({"name": rep.name, "incarnation": rep.incarnation, "status": rep.status, "sim_time": rep.now(),
                      "time_scale": rep.cfg.time_scale, "inflight": len(rep._inflight), "ranks": ranks,
                      "spans": list(rep.spans) if request.query_params.get("spans") else None})
