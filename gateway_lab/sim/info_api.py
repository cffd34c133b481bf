"""The read-only endpoints of one simulated SGLang server: what it serves, whether it is healthy, how loaded it is."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.tokenizer import render_chat, token_array
from gateway_lab.sim.generate import request_priority
from gateway_lab.sim.kv_events import KvEventsConfig
from gateway_lab.sim.kv_events import descriptor as kv_descriptor
from gateway_lab.sim.protocol import new_id
from gateway_lab.sim.replica import Replica
from gateway_lab.sim.wire import (
    authorized,
    error_response,
    json_response,
)


class InfoApi:
    """Model cards, health and readiness, server info, loads, metrics and tokenize."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    # -- info endpoints --------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        if not authorized(self.replica, request):
            return json_response({"error": "Unauthorized"}, 401)
        return json_response({"object": "list", "data": [self._card()]})

    def _card(self) -> dict[str, Any]:
        name = self.replica.cfg.served_model_name
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
                "parent": None, "max_model_len": self.replica.cfg.context_length}

    async def model(self, request: Request) -> Response:
        if not authorized(self.replica, request):
            return json_response({"error": "Unauthorized"}, 401)
        mid = request.path_params["model_id"]
        if mid != self.replica.cfg.served_model_name:
            return json_response({"error": {"message": f"The model '{mid}' does not exist", "type": "invalid_request_error",
                                    "param": "model", "code": "model_not_found"}}, 404)
        return json_response(self._card())

    async def health(self, request: Request) -> Response:
        """200 (empty) once any scheduler output arrives after the probe starts; polled each (simulated) second."""
        rep = self.replica
        if rep.status != "ready":
            return Response(status_code=503)
        # Real SGLang submits a 1-token generation and waits for any scheduler output (a decode step or a finished
        # prefill, not an intermediate chunk), up to 20 s: behind a long chunked prefill it is slow. /ping and /ready
        # are the cheap checks.
        if request.url.path == "/health" and getattr(rep, "plain_health", False):
            return Response(status_code=200)
        clock = rep.clock
        assert clock is not None
        start = clock.now()
        rank = rep.ranks[0]
        probe = rep.submit(rank, np.arange(8, dtype=np.uint32), "\x00health", [(1, "length")], new_id(), internal=True,
                           priority=request_priority(self.replica.cfg, {}))
        try:
            waited = 0.0
            while waited < 20.0:
                await clock.sleep(1.0)
                waited += 1.0
                if any(r.last_output_time > start for r in rep.ranks):
                    return Response(status_code=200)
                if rep.status != "ready":
                    break
            return Response(status_code=503)
        finally:
            rep.cancel(probe)

    async def server_info(self, request: Request) -> Response:
        rep, cfg = self.replica, self.replica.cfg
        args = {k: v for k, v in cfg.__dict__.items() if k not in ("timing", "api_key", "report_incarnation")}
        if not cfg.at_least("0.5.13"):
            args.pop("default_priority_value", None)  # the flag arrived in 0.5.13
        if cfg.at_least("0.5.23"):
            # 0.5.23 resolves `--dp-size N --enable-dp-attention` to attn_dp_size=N, dp_size=1 (parallel.py)
            args["attn_dp_size"] = cfg.dp_size if cfg.enable_dp_attention else 1
            if cfg.enable_dp_attention:
                args["dp_size"] = 1
        info = {
            **args,
            "load_balance_method": "round_robin",
            "disaggregation_mode": cfg.disaggregation_mode,
            "kv_events_config": cfg.kv_events_config,
            "status": rep.status,
            "max_req_input_len": min(cfg.context_length, cfg.max_total_num_tokens) - 6,
            "internal_states": [
                {"last_gen_throughput": r.rank.counters.last_gen_throughput,
                 "effective_max_running_requests_per_dp": cfg.max_running_requests,
                 "avg_spec_accept_length": cfg.timing.alpha,
                 "memory_usage": {"weight": 105.2, "kvcache": 131.9, "token_capacity": cfg.max_total_num_tokens, "graph": 3.1}}
                for r in rep.ranks
            ],
            "sim_timing": cfg.timing.__dict__,
        }
        if cfg.at_least("0.5.13"):
            kv = KvEventsConfig.parse(cfg.kv_events_config)  # the KV-event descriptor; None with events off
            info["kv_events"] = kv_descriptor(kv, cfg.page_size, cfg.dp_size, replay=cfg.at_least("0.5.23")) if kv else None
        if cfg.report_incarnation:
            info["incarnation"] = rep.incarnation  # not SGLang's: only when asked (--report-incarnation)
        return json_response(info)

    async def model_info(self, request: Request) -> Response:
        cfg = self.replica.cfg
        return json_response({"model_path": cfg.model_path, "tokenizer_path": cfg.model_path, "is_generation": True,
                      "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
                      "has_audio_understanding": False, "model_type": "glm_moe_dsa",
                      "architectures": ["GlmMoeDsaForCausalLM"], "served_model_name": cfg.served_model_name})

    async def v1_loads(self, request: Request) -> Response:
        cfg = self.replica.cfg
        include = request.query_params.get("include") or "all"  # SGLang: no include = every section
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        parts = {p.strip() for p in include.split(",") if p.strip()}
        if not parts <= valid:
            return error_response(400, f"Invalid include value(s): {sorted(parts - valid)}. Valid: {sorted(valid)}", "BadRequestError")
        loads = self.replica.loads()
        dp = request.query_params.get("dp_rank")
        if dp is not None:
            try:
                loads = [x for x in loads if x["dp_rank"] == int(dp)]
            except ValueError:
                return error_response(400, f"Invalid dp_rank: {dp!r}", "BadRequestError")
        now = time.time()
        for x in loads:
            x["timestamp"] = now
            if parts & {"queues", "all"}:
                x["queues"] = {"waiting": x["num_waiting_reqs"], "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0}
            if parts & {"spec", "all"}:
                x["speculative"] = {"accept_length": self.replica.cfg.timing.alpha, "accept_rate": 0.5}
            if parts & {"memory", "all"}:
                x["memory"] = {"weight_gb": 105.2, "kv_cache_gb": 131.9, "graph_gb": 3.1, "token_capacity": x["max_total_num_tokens"]}
        out: dict[str, Any] = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now)), "version": cfg.version}
        if not cfg.at_least("0.5.13"):
            # 0.5.9: no num_waiting_uncached_tokens; num_total_reqs per rank, a rank count and an aggregate
            for x in loads:
                x.pop("num_waiting_uncached_tokens", None)
                x["num_total_reqs"] = x["num_running_reqs"] + x["num_waiting_reqs"]
            n = max(len(loads), 1)
            out.update(dp_rank_count=len(loads), loads=loads, aggregate={
                "total_running_reqs": sum(x["num_running_reqs"] for x in loads),
                "total_waiting_reqs": sum(x["num_waiting_reqs"] for x in loads),
                "total_reqs": sum(x["num_total_reqs"] for x in loads),
                "avg_token_usage": round(sum(x["token_usage"] for x in loads) / n, 4),
                "avg_throughput": round(sum(x["gen_throughput"] for x in loads) / n, 2),
                "avg_utilization": round(sum(x["utilization"] for x in loads) / n, 4)})
            return json_response(out)
        if cfg.at_least("0.5.23"):
            out.update(accelerator="AMD Instinct MI355X" if "mi355x" in cfg.profile else "NVIDIA B200",
                       num_accelerators=cfg.tp_size)
        out["loads"] = loads
        return json_response(out)

    async def get_load(self, request: Request) -> Response:
        cfg = self.replica.cfg
        if cfg.at_least("0.5.23"):
            return json_response({"detail": "Not Found"}, 404)  # removed in 0.5.23
        out = []
        for x in self.replica.loads():
            row = {"dp_rank": x["dp_rank"], "num_reqs": x["num_running_reqs"] + x["num_waiting_reqs"],
                   "num_waiting_reqs": x["num_waiting_reqs"], "num_tokens": x["num_used_tokens"] + x["num_waiting_uncached_tokens"],
                   "ts_tic": time.monotonic()}
            if cfg.at_least("0.5.13"):
                row["num_pending_tokens"] = x["num_waiting_uncached_tokens"]  # 0.5.9 has no such field
            out.append(row)
        return json_response(out)

    async def ready(self, request: Request) -> Response:
        if not self.replica.cfg.at_least("0.5.23"):
            return json_response({"detail": "Not Found"}, 404)  # /ready arrived in 0.5.23
        return Response(status_code=200 if self.replica.status == "ready" else 503)

    async def ping(self, request: Request) -> Response:
        """A flag check (SageMaker's): never waits for the scheduler. 0.5.23 answers 503 while unhealthy."""
        ok = self.replica.status == "ready" or not self.replica.cfg.at_least("0.5.23")
        return Response(status_code=200 if ok else 503)

    async def flush_cache(self, request: Request) -> Response:
        if all(r.rank.flush_cache() for r in self.replica.ranks):
            return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n")
        return PlainTextResponse("Cache not flushed. Please check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n", status_code=400)

    async def metrics(self, request: Request) -> Response:
        if not self.replica.cfg.enable_metrics:
            return PlainTextResponse("Not Found", status_code=404)
        return Response(self.replica.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, request: Request) -> Response:
        """/v1/tokenize (0.5.13+): `prompt` (a string or strings) or `messages` (+ `tools`, templated as a chat)."""
        if not self.replica.cfg.at_least("0.5.13"):
            return error_response(404, "Not Found", "NotFoundError")
        try:
            body = orjson.loads(await request.body() or b"{}")
            if not isinstance(body, dict):
                raise ValueError("expected a JSON object")  # noqa: TRY004 (one except answers every bad body)
            if isinstance(body.get("messages"), list):
                tokens: Any = token_array(render_chat(body["messages"], body.get("tools"))).tolist()
            elif isinstance(body.get("prompt"), str):
                tokens = token_array(body["prompt"]).tolist()
            elif isinstance(body.get("prompt"), list) and all(isinstance(p, str) for p in body["prompt"]):
                tokens = [token_array(p).tolist() for p in body["prompt"]]
            else:
                raise ValueError("Invalid prompt type. Expected str or List[str].")
        except (ValueError, TypeError, AttributeError, orjson.JSONDecodeError) as e:
            return error_response(400, str(e), "BadRequestError")
        count = [len(t) for t in tokens] if tokens and isinstance(tokens[0], list) else len(tokens)
        return json_response({"tokens": tokens, "count": count, "max_model_len": self.replica.cfg.context_length})
