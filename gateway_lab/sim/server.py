"""HTTP surface of one simulated SGLang server (spec section 2), over a `Replica`."""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gateway.asgi import AbortConnection, EventStreamResponse, run_until_disconnect
from gateway.tokenizer import VOCAB_SIZE, count_tokens, render_chat, token_array
from gateway_lab.sim.engine import Event, EventKind
from gateway_lab.sim.kv_events import KvEventsConfig
from gateway_lab.sim.kv_events import descriptor as kv_descriptor
from gateway_lab.sim.pd import FABRIC, Bootstrap, bootstrap_fields, pd_room_hook, rank_for_room
from gateway_lab.sim.protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    ChoicePlan,
    ChunkWriter,
    CompletionRequest,
    SimHTTPError,
    StopAt,
    chat_tools_offered,
    check_prompt_len,
    error_body,
    new_id,
    output_text,
    parse_chat,
    parse_completion,
    plan_chat,
    plan_json,
    stop_at,
    stop_strings,
    text_base,
    tool_call,
    usage,
)
from gateway_lab.sim.replica import Fault, Replica
from gateway_lab.sim.structured import MAX_VALUES, Budget, SchemaError

EOS_TOKEN_ID = 154827


def _err(status: int, message: str, type_: str | None = None) -> Response:
    e = SimHTTPError(status, message, type_)
    return Response(error_body(status, e.message, e.type), status_code=status, media_type="application/json")


OFFLOAD_BYTES = 1 << 20  # bodies above this are parsed off the event loop


MAX_JSON_CONTAINERS = 300_000  # JSON parsing holds the GIL: millions of tiny arrays would stall every replica [inf]


def _decode(raw: bytes) -> dict[str, Any]:
    # counted on the raw bytes (brackets inside strings count too: a loose, cheap upper bound)
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_CONTAINERS:
        raise SimHTTPError(400, f"Request body has more than {MAX_JSON_CONTAINERS} JSON arrays and objects.", "BadRequestError")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise SimHTTPError(400, f"JSON decode error: {e}") from None
    if not isinstance(body, dict):
        raise SimHTTPError(400, "1 validation error for request\n  Input should be a valid dictionary")
    return body


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


class SimServer:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    # -- plumbing --------------------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        key = self.replica.cfg.api_key
        return key is None or request.headers.get("authorization") == f"Bearer {key}"

    async def _body(self, request: Request) -> dict[str, Any]:
        return _decode(await self._raw_body(request))

    async def _raw_body(self, request: Request) -> bytes:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise SimHTTPError(400, f"Unsupported Content-Type: {ctype or 'missing'}. Expected application/json.")
        raw = bytearray()
        async for part in request.stream():  # bounded: a huge body is refused before it is all in memory
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise SimHTTPError(400, f"Request body exceeds the simulator's limit of {MAX_BODY_BYTES} bytes.", "BadRequestError")
        return bytes(raw)

    def _prepare(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], ChatCompletionRequest | CompletionRequest, list[np.ndarray]]:
        body = _decode(raw)
        return (body, *self._prompt(body, chat))

    def _pinned_rank(self, request: Request, body: dict[str, Any]) -> int | None:
        """The DP rank a client pinned: body `data_parallel_rank` (every version; a deprecated alias of
        `routed_dp_rank` from 0.5.13), `routed_dp_rank` (0.5.13+), header `X-Data-Parallel-Rank` (0.5.13+, wins)."""
        cfg = self.replica.cfg
        dp = body.get("data_parallel_rank")
        if cfg.at_least("0.5.13"):
            if body.get("routed_dp_rank") is not None:
                dp = body.get("routed_dp_rank")
            hdr = request.headers.get("x-data-parallel-rank")
            if hdr is not None:
                try:
                    dp = int(hdr)
                except ValueError:
                    raise SimHTTPError(400, f"Invalid X-Data-Parallel-Rank header: must be an integer, got '{hdr}'",
                                       "BadRequestError") from None
        ranks = self.replica.num_ranks
        if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or not 0 <= dp < ranks):
            raise SimHTTPError(400, f"data_parallel_rank must be in [0, {ranks}), got {dp}.", "BadRequestError")
        return dp

    def _bootstrap(self, body: dict[str, Any], n: int, prompts: int) -> Bootstrap | None:
        """A PD server's bootstrap fields (sim/pd.py), or None on a unified server."""
        cfg = self.replica.cfg
        if cfg.disaggregation_mode == "null":
            return None
        try:
            pd = bootstrap_fields(body, cfg)
        except ValueError as e:
            raise SimHTTPError(400, str(e), "BadRequestError") from None
        if pd is not None and (n != 1 or prompts != 1):
            raise SimHTTPError(400, "The simulator's PD mode serves one sequence per request (n = 1, one prompt).",
                               "BadRequestError")
        return pd

    def _priority(self, body: dict[str, Any]) -> int:
        """SGLang's rules: with priority scheduling, a request without `priority` gets --default-priority-value
        (0.5.13+) or else the lowest value; without it, a priority is ignored or (abort flag) refused with 503."""
        cfg = self.replica.cfg
        prio = body.get("priority")
        if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int) or not -(1 << 63) <= prio < (1 << 63)):
            raise SimHTTPError(400, "priority must be a signed 64-bit integer between -9223372036854775808 and "
                               "9223372036854775807", "BadRequestError")
        if not cfg.enable_priority_scheduling:
            if prio is not None and cfg.abort_on_priority_when_disabled:
                raise SimHTTPError(503, "Using priority is disabled for this server. Please send a new request without "
                                   "a priority.", "503")
            return 0
        if prio is None and cfg.default_priority_value is not None and cfg.at_least("0.5.13"):
            prio = cfg.default_priority_value
        if prio is None:
            prio = sys.maxsize if cfg.schedule_low_priority_values_first else -sys.maxsize - 1
        return int(prio)

    # -- generation ------------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def _handle(self, request: Request, chat: bool) -> Response:
        if not self._authorized(request):
            return _json({"error": "Unauthorized"}, 401)
        try:
            raw = await self._raw_body(request)
            if len(raw) > OFFLOAD_BYTES:
                # parsed, validated and tokenized on a worker thread: one large body (a 1M-token prompt, or 16 MB of
                # tiny messages) slows the other requests of this process a little instead of stalling them all
                body, req, seqs = await asyncio.to_thread(self._prepare, raw, chat)
            else:
                body, req, seqs = self._prepare(raw, chat)
            return await self._generate(request, body, req, seqs, chat)
        except SimHTTPError as e:
            return _err(e.status, e.message, e.type)

    def _prompt(self, body: dict[str, Any], chat: bool) -> tuple[ChatCompletionRequest | CompletionRequest, list[np.ndarray]]:
        """The validated request and its prompts as token arrays (one, or one per prompt of a completions batch)."""
        ctx = self.replica.cfg.context_length
        if not chat:
            return parse_completion(body, VOCAB_SIZE, ctx)
        req = parse_chat(body, VOCAB_SIZE)
        try:
            text = render_chat(body["messages"], body.get("tools"))
        except orjson.JSONEncodeError:  # nested past orjson's depth limit (SGLang: RecursionError -> 400)
            raise SimHTTPError(400, "Tool or message content is too deeply nested.", "BadRequestError") from None
        check_prompt_len(count_tokens(text), ctx)
        return req, [token_array(text)]

    async def _generate(self, request: Request, body: dict[str, Any], req: ChatCompletionRequest | CompletionRequest,
                        seqs: list[np.ndarray], chat: bool) -> Response:
        rep, cfg = self.replica, self.replica.cfg
        n, stream = req.n, req.stream
        prompt_len = max(len(t) for t in seqs)  # the context checks hold for every prompt of a batch
        max_tokens = req.max_completion_tokens if isinstance(req, ChatCompletionRequest) else None
        if max_tokens is None:
            max_tokens = req.max_tokens
        ctx = cfg.context_length
        if chat and max_tokens is not None and max_tokens > ctx:
            raise SimHTTPError(400, f"max_completion_tokens is too large: {max_tokens}.This model supports at most {ctx} completion tokens.", "BadRequestError")
        if prompt_len >= ctx:
            raise SimHTTPError(400, f"The input ({prompt_len} tokens) is longer than the model's context length ({ctx} tokens).", "BadRequestError")
        if max_tokens is not None and prompt_len + max_tokens > ctx:
            if chat and body.get("max_completion_tokens") is not None:
                raise SimHTTPError(400, f"max_completion_tokens is too large: {max_tokens}.This model supports at most {ctx - prompt_len} completion tokens.", "BadRequestError")
            raise SimHTTPError(
                400,
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested a total of "
                f"{prompt_len + max_tokens} tokens: {prompt_len} tokens from the input messages and {max_tokens} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
                "BadRequestError",
            )
        max_input = min(ctx, cfg.max_total_num_tokens) - 6
        if prompt_len > max_input:
            raise SimHTTPError(400, f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({max_input} tokens). Use a shorter input or enable --allow-auto-truncate.", "BadRequestError")
        if rep.status != "ready":
            return _err(503, "The server is not ready.", "503")
        try:
            # a queued one-shot fault is for client traffic: a gateway's startup probe (which may arrive after a test
            # queued it) never consumes it; an explicit X-Sim-Fault header still applies
            probe = "x-gateway-probe" in request.headers
            fault = rep.take_fault(request.headers.get("x-sim-fault"), queued=not probe)
        except ValueError as e:
            raise SimHTTPError(400, str(e), "BadRequestError") from None
        if fault and fault.kind == "status":
            return _err(fault.status, f"Injected fault: status {fault.status}.", str(fault.status))
        pd = self._bootstrap(body, n, len(seqs))
        pinned = self._pinned_rank(request, body)
        if pd is not None and pinned is None:
            pinned = rank_for_room(pd.room, rep.num_ranks)  # SGLang's follow_bootstrap_room: both sides agree
        rank = rep.pick_rank(pinned)
        priority = self._priority(body)
        if rep.queue_full(rank):
            if stream and cfg.sse_style != "0.5.9":
                return _queue_full_stream()
            return _err(503, "The request queue is full.", "503")

        rid = req.rid if isinstance(req.rid, str) else new_id()
        base = text_base(cfg.seed, sum(len(t) for t in seqs), rid if body.get("seed") is None else body.get("seed"))
        plans, lengths, tokens, stops = self._plan(req, seqs, max_tokens, base)
        hook = None
        if pd is not None:
            if cfg.disaggregation_mode == "prefill":  # the prefill server's answer is the first token
                plans, lengths, stops = [None], [(1, "length")], [None]
            hook = pd_room_hook(rep, rank, pd)
        namespace = f"{body.get('cache_salt') or ''}\x00{body.get('extra_key') or ''}"
        sub = rep.submit(rank, tokens, namespace, lengths, rid, priority=priority, before_submit=hook)
        ctx_ = _Ctx(self, sub, body, chat, sum(len(t) for t in seqs), lengths, plans, rid, fault, n, base, stops)
        if fault and fault.kind == "hang":
            return EventStreamResponse(ctx_.hang, ctx_.never, on_close=ctx_.close) if stream else await ctx_.hang_plain(request)
        if stream:
            return EventStreamResponse(ctx_.first_chunk, ctx_.stream_rest, on_close=ctx_.close)
        return await ctx_.collect(request)

    def _plan(self, req: ChatCompletionRequest | CompletionRequest, seqs: list[np.ndarray], max_tokens: int | None,
              base: int) -> tuple[list[ChoicePlan | None], list[tuple[int, str]], list[np.ndarray], list[StopAt | None]]:
        """Per choice (prompt-major, as SGLang indexes them: choice = prompt * n + j): what it says, how many tokens
        and why it ends (EOS where the workload's length draw puts it, the cap, or a `stop` string), and its prompt.
        Bounded: all choices together may not generate more than one rank's KV pool holds, so no single request can
        keep the simulator busy for long."""
        rep, cfg = self.replica, self.replica.cfg
        plans: list[ChoicePlan | None] = []
        budget = Budget(4 * MAX_VALUES)  # all choices' JSON together: n=128 structured choices stay cheap
        lengths: list[tuple[int, str]] = []
        tokens: list[np.ndarray] = []
        stops: list[StopAt | None] = []
        stop_list = stop_strings(req.stop)
        agent = isinstance(req, ChatCompletionRequest) and bool(chat_tools_offered(req))
        for seq in seqs:
            key = zlib.crc32(seq.tobytes())
            for j in range(req.n):
                rng = random.Random(f"{cfg.seed}|{key}|{req.seed!r}|{j}")
                try:
                    plan = (plan_chat(req, rng, budget) if isinstance(req, ChatCompletionRequest)
                            else plan_json(req, rng, budget))
                except SchemaError as e:
                    raise SimHTTPError(400, f"Invalid schema: {e}", "BadRequestError") from None
                stop = None
                if plan is not None:
                    cap = max_tokens if max_tokens is not None else cfg.context_length - len(seq)
                    if plan.tokens > cap:
                        plan = plan.truncated(cap)
                        lengths.append((cap, "length"))
                    else:
                        lengths.append((plan.tokens, "stop"))
                else:
                    n_out, why = rep.output_len(int(seq[:64].sum()), j, max_tokens, req.ignore_eos, req.seed, agent)
                    stop = stop_at(base + len(lengths), n_out, stop_list, natural_end=why == "stop")
                    lengths.append((stop.tokens, "stop") if stop is not None else (n_out, why))
                stops.append(stop)
                plans.append(plan)
                tokens.append(seq)
        for seq, (out_len, _) in zip(tokens, lengths):
            if not rep.ranks[0].rank.can_hold(len(seq), out_len):
                raise SimHTTPError(400, f"Input length ({len(seq)} tokens) plus output exceeds the KV pool ({cfg.max_total_num_tokens} tokens).", "BadRequestError")
        total = sum(out for out, _ in lengths)
        if len(lengths) > 1 and total > cfg.max_total_num_tokens:
            raise SimHTTPError(400, f"The {len(lengths)} choices would generate {total} tokens, more than the KV pool "
                               f"({cfg.max_total_num_tokens} tokens) holds.", "BadRequestError")
        return plans, lengths, tokens, stops

    # -- info endpoints --------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        if not self._authorized(request):
            return _json({"error": "Unauthorized"}, 401)
        return _json({"object": "list", "data": [self._card()]})

    def _card(self) -> dict[str, Any]:
        name = self.replica.cfg.served_model_name
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
                "parent": None, "max_model_len": self.replica.cfg.context_length}

    async def model(self, request: Request) -> Response:
        if not self._authorized(request):
            return _json({"error": "Unauthorized"}, 401)
        mid = request.path_params["model_id"]
        if mid != self.replica.cfg.served_model_name:
            return _json({"error": {"message": f"The model '{mid}' does not exist", "type": "invalid_request_error",
                                    "param": "model", "code": "model_not_found"}}, 404)
        return _json(self._card())

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
                           priority=self._priority({}))
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
            info["kv_events"] = kv_descriptor(kv, cfg.page_size, cfg.dp_size) if kv else None
        if cfg.report_incarnation:
            info["incarnation"] = rep.incarnation  # not SGLang's: only when asked (--report-incarnation)
        return _json(info)

    async def model_info(self, request: Request) -> Response:
        cfg = self.replica.cfg
        return _json({"model_path": cfg.model_path, "tokenizer_path": cfg.model_path, "is_generation": True,
                      "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
                      "has_audio_understanding": False, "model_type": "glm_moe_dsa",
                      "architectures": ["GlmMoeDsaForCausalLM"], "served_model_name": cfg.served_model_name})

    async def v1_loads(self, request: Request) -> Response:
        cfg = self.replica.cfg
        include = request.query_params.get("include") or "all"  # SGLang: no include = every section
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        parts = {p.strip() for p in include.split(",") if p.strip()}
        if not parts <= valid:
            return _err(400, f"Invalid include value(s): {sorted(parts - valid)}. Valid: {sorted(valid)}", "BadRequestError")
        loads = self.replica.loads()
        dp = request.query_params.get("dp_rank")
        if dp is not None:
            try:
                loads = [x for x in loads if x["dp_rank"] == int(dp)]
            except ValueError:
                return _err(400, f"Invalid dp_rank: {dp!r}", "BadRequestError")
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
            return _json(out)
        if cfg.at_least("0.5.23"):
            out.update(accelerator="AMD Instinct MI355X" if "mi355x" in cfg.profile else "NVIDIA B200",
                       num_accelerators=cfg.tp_size)
        out["loads"] = loads
        return _json(out)

    async def get_load(self, request: Request) -> Response:
        cfg = self.replica.cfg
        if cfg.at_least("0.5.23"):
            return _json({"detail": "Not Found"}, 404)  # removed in 0.5.23
        out = []
        for x in self.replica.loads():
            row = {"dp_rank": x["dp_rank"], "num_reqs": x["num_running_reqs"] + x["num_waiting_reqs"],
                   "num_waiting_reqs": x["num_waiting_reqs"], "num_tokens": x["num_used_tokens"] + x["num_waiting_uncached_tokens"],
                   "ts_tic": time.monotonic()}
            if cfg.at_least("0.5.13"):
                row["num_pending_tokens"] = x["num_waiting_uncached_tokens"]  # 0.5.9 has no such field
            out.append(row)
        return _json(out)

    async def ready(self, request: Request) -> Response:
        if not self.replica.cfg.at_least("0.5.23"):
            return _json({"detail": "Not Found"}, 404)  # /ready arrived in 0.5.23
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

    # -- SGLang control hooks --------------------------------------------------------------------------------
    async def abort_request(self, request: Request) -> Response:
        try:
            body = await self._body(request)
        except SimHTTPError as e:
            return _err(e.status, e.message, e.type)
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
        return _json({"success": True})

    async def pause(self, request: Request) -> Response:
        for r in self.replica.ranks:
            r.rank.paused = True
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: Request) -> Response:
        for r in self.replica.ranks:
            r.rank.paused = False
            r.kick()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def noop(self, request: Request) -> Response:
        return _json({"success": True, "message": "ok (simulated)"})

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
                return _err(400, str(e), "BadRequestError")
        return _json({**{k: v for k, v in rep.cfg.__dict__.items() if k != "timing"}, "timing": rep.cfg.timing.__dict__,
                      "slow_factor": rep.ranks[0].rank.slow_factor if rep.ranks else 1.0})

    async def sim_fault(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body() or b"{}")
            kind = body.get("kind")
            if kind == "clear":
                self.replica.faults.clear()
                self._slow(1.0, 1.0)
                return _json({"faults": []})
            if kind == "slow":  # lasting, until cleared: {"phase": "prefill"|"decode"|"both", "factor": k}
                phase, factor = body.get("phase", "both"), body.get("factor")
                if phase not in ("prefill", "decode", "both"):
                    raise ValueError("phase must be prefill, decode or both")
                if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1000:
                    raise ValueError("factor must be a number in (0, 1000]")
                rank = self.replica.ranks[0].rank
                self._slow(float(factor) if phase != "decode" else rank.prefill_slow,
                           float(factor) if phase != "prefill" else rank.decode_slow)
                return _json({"slow": {"prefill": float(rank.prefill_slow), "decode": float(rank.decode_slow)}})
            if kind == "restart":
                asyncio.get_running_loop().create_task(self.replica.restart(float(body.get("startup_seconds", 0.0))))
                return _json({"restarting": True})
            if kind == "transfer_stall":  # the next `count` KV transfers of this process never complete
                FABRIC.stall_next += int(body.get("count", 1))
                return _json({"transfer_stall": FABRIC.stall_next})
            if kind not in ("reset_after_chunks", "reset_before_headers", "hang", "hang_after_first", "status"):
                raise ValueError(f"unknown fault kind {kind!r}")
            f = Fault(kind, n=int(body.get("n", 0)), status=int(body.get("status", 503)), count=int(body.get("count", 1)))
        except (ValueError, TypeError, AttributeError, orjson.JSONDecodeError) as e:
            return _err(400, str(e), "BadRequestError")
        self.replica.faults.append(f)
        return _json({"faults": [f.__dict__ for f in self.replica.faults]})

    def _slow(self, prefill: float, decode: float) -> None:
        for r in self.replica.ranks:
            r.rank.prefill_slow, r.rank.decode_slow = prefill, decode

    async def tokenize(self, request: Request) -> Response:
        """/v1/tokenize (0.5.13+): `prompt` (a string or strings) or `messages` (+ `tools`, templated as a chat)."""
        if not self.replica.cfg.at_least("0.5.13"):
            return _err(404, "Not Found", "NotFoundError")
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
            return _err(400, str(e), "BadRequestError")
        count = [len(t) for t in tokens] if tokens and isinstance(tokens[0], list) else len(tokens)
        return _json({"tokens": tokens, "count": count, "max_model_len": self.replica.cfg.context_length})

    async def sim_kv_events(self, request: Request) -> Response:
        """/_sim/kv_events. GET: each rank's publisher (seq, buffered batches). POST {"drop_batches": n}: send
        nothing for the next n batches of every rank (they keep their sequence numbers and stay replayable)."""
        pub = self.replica.kv_events
        if pub is None:
            return _err(400, "KV events are off (start with --kv-events-config)", "BadRequestError")
        if request.method == "POST":
            try:
                body = orjson.loads(await request.body() or b"{}")
                n = body.get("drop_batches", 0) if isinstance(body, dict) else None
                if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                    raise ValueError("drop_batches must be a non-negative integer")
            except (ValueError, orjson.JSONDecodeError) as e:
                return _err(400, str(e), "BadRequestError")
            pub.drop_next(n)
        return _json({"ranks": pub.state()})

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
        return _json({"name": rep.name, "incarnation": rep.incarnation, "status": rep.status, "sim_time": rep.now(),
                      "time_scale": rep.cfg.time_scale, "inflight": len(rep._inflight), "ranks": ranks,
                      "spans": list(rep.spans) if request.query_params.get("spans") else None})


class _Ctx:
    """One generation call: turns rank events into SGLang responses (non-streaming or SSE)."""

    def __init__(self, srv: SimServer, sub: Any, body: dict[str, Any], chat: bool, prompt_len: int,
                 lengths: list[tuple[int, str]], plans: list[ChoicePlan | None], rid: str, fault: Fault | None,
                 n_per_prompt: int = 1, base: int = 0, stops: list[StopAt | None] | None = None) -> None:
        self.srv = srv
        self.rep = srv.replica
        self.sub = sub
        self.body = body
        self.chat = chat
        self.prompt_len = prompt_len
        self.n = len(lengths)
        self.n_per_prompt = n_per_prompt
        self.plans = plans
        self.calls_begun: list[set[int]] = [set() for _ in range(self.n)]
        self.fault = fault
        self.model = body.get("model", "default") if isinstance(body.get("model"), str) else "default"
        self.writer = ChunkWriter(rid, self.model, self.rep.cfg.sse_style, chat)
        self.base = base  # text_base(): str-seeded, stable across processes
        self.stops = stops or [None] * self.n
        self.shown = [0] * self.n  # characters of text sent per choice (a stop string is trimmed from it)
        self.generated = [0] * self.n
        self.finish: list[str | None] = [None] * self.n
        self.finish_shown = [False] * self.n
        self.first_time: float | None = None
        self.last_time: dict[int, float] = {}
        self.chunks_sent = 0
        so = body.get("stream_options") or {}
        self.include_usage = bool(so.get("include_usage"))
        self.continuous = bool(so.get("continuous_usage_stats"))

    async def _next(self) -> tuple[int, Event]:
        idx, ev = await self.sub.queue.get()
        assert self.rep.clock is not None  # set once the replica has started, before any request
        await self.rep.clock.sleep_until(ev.time + self.rep.cfg.timing.t_api)
        return idx, ev

    def _observe(self, idx: int, ev: Event) -> None:
        m = self.rep.metrics
        t_api = self.rep.cfg.timing.t_api
        arrival = self.sub.requests[idx].arrival
        if ev.kind is EventKind.FIRST:
            if self.first_time is None:
                self.first_time = ev.time
            m.ttft.observe(ev.time + t_api - arrival)
            m.queue.observe(max(0.0, ev.time - arrival))
        elif ev.kind is EventKind.TOKENS and ev.tokens:
            gap = (ev.time - self.last_time.get(idx, ev.time)) / ev.tokens
            for _ in range(ev.tokens):
                m.itl.observe(gap)
        elif ev.kind is EventKind.FINISH:
            m.e2e.observe(ev.time + t_api - arrival)
        self.last_time[idx] = ev.time

    def _usage(self) -> dict[str, Any]:
        # SGLang counts a prompt once per prompt, not per choice: its first choice (index % n == 0) carries it
        cached = sum(r.cached for r in self.sub.requests[:: self.n_per_prompt])
        return usage(self.prompt_len, sum(self.generated), cached, self.rep.cfg.enable_cache_report)

    def _calls(self, idx: int) -> bool:
        plan = self.plans[idx]
        return plan is not None and bool(plan.calls)

    def _take(self, idx: int, n_tokens: int) -> list[tuple[int, str]]:
        plan = self.plans[idx]
        assert plan is not None
        start = self.generated[idx]
        self.generated[idx] += n_tokens
        return plan.pieces[start : start + n_tokens]

    def _text(self, idx: int, n_tokens: int) -> str:
        if self.plans[idx] is not None:
            return "".join(text for _, text in self._take(idx, n_tokens))
        start = self.generated[idx]
        self.generated[idx] += n_tokens
        text = output_text(self.base + idx, start, n_tokens)
        stop = self.stops[idx]
        if stop is not None and stop.keep is not None:  # SGLang trims the matched stop string from the text
            text = text[: max(0, stop.keep - self.shown[idx])]
        self.shown[idx] += len(text)
        return text

    def _matched(self, idx: int, reason: str | None) -> int | str | None:
        """SGLang's matched_stop: the stop string that ended the choice, else the EOS token id, None for length."""
        if reason != "stop":
            return None
        stop = self.stops[idx]
        return stop.matched if stop is not None else EOS_TOKEN_ID

    def _call_deltas(self, idx: int, n_tokens: int) -> list[bytes]:
        """Tool-call deltas as SGLang streams them: a call's first delta carries its id, name and empty arguments;
        later deltas carry argument fragments with null id and name."""
        plan = self.plans[idx]
        assert plan is not None
        groups: list[tuple[int, str]] = []
        for call, text in self._take(idx, n_tokens):
            if groups and groups[-1][0] == call:
                groups[-1] = (call, groups[-1][1] + text)
            else:
                groups.append((call, text))
        out = []
        for call, text in groups:
            if call not in self.calls_begun[idx]:
                self.calls_begun[idx].add(call)
                call_id, name, _ = plan.calls[call]
                out.append(self.writer.chat_delta(idx, {"tool_calls": [tool_call(call_id, call, name, "")]}))
            if text:
                out.append(self.writer.chat_delta(idx, {"tool_calls": [tool_call(None, call, None, text)]}))
        return [self._with_usage(c) for c in out]

    # -- non-streaming ---------------------------------------------------------------------------------------
    async def collect(self, request: Request) -> Response:
        disconnected, res = await run_until_disconnect(request.receive, self._collect())
        self.rep.cancel(self.sub)
        if disconnected:
            return Response(status_code=499)
        return res  # type: ignore[no-any-return]

    async def _collect(self) -> Response:
        texts: list[list[str]] = [[] for _ in range(self.n)]
        done = 0
        if self.fault and self.fault.kind in ("reset_after_chunks", "reset_before_headers", "hang_after_first"):
            return _Reset()
        while done < self.n:
            idx, ev = await self._next()
            self._observe(idx, ev)
            if ev.kind in (EventKind.FIRST, EventKind.TOKENS):
                texts[idx].append(self._text(idx, ev.tokens))
            elif ev.kind is EventKind.FINISH:
                self.finish[idx] = ev.reason
                done += 1
            elif ev.kind is EventKind.ABORT:
                if ev.code == -1:
                    return _Reset()
                return _err(ev.code or 500, ev.reason, "InternalServerError" if ev.code == 500 else str(ev.code))
        created = int(time.time())
        choices = []
        for i in range(self.n):
            reason = self.finish[i]
            matched = self._matched(i, reason)
            text = "".join(texts[i])
            if self.chat:
                msg: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
                plan = self.plans[i]
                if plan is not None and plan.calls:
                    msg["content"] = None
                    msg["tool_calls"] = [tool_call(cid, k, name, args) for k, (cid, name, args) in enumerate(plan.calls)]
                    reason, matched = "tool_calls", None
                choices.append({"index": i, "message": msg, "logprobs": None, "finish_reason": reason, "matched_stop": matched})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched})
        return _json({"id": self.writer.rid, "object": "chat.completion" if self.chat else "text_completion",
                      "created": created, "model": self.model, "choices": choices, "usage": self._usage(),
                      "metadata": {"weight_version": "default"}})

    # -- streaming -------------------------------------------------------------------------------------------
    async def first_chunk(self) -> bytes | Response:
        if self.fault and self.fault.kind == "reset_before_headers":
            return _Reset()
        parts = []
        async for chunk in self._events(until_first=True):
            parts.append(chunk)
        return b"".join(parts)

    async def stream_rest(self) -> AsyncIterator[bytes]:
        async for chunk in self._events(until_first=False):
            yield chunk

    async def _events(self, until_first: bool) -> AsyncIterator[bytes]:
        w = self.writer
        while not all(f is not None for f in self.finish):
            idx, ev = await self._next()
            self._observe(idx, ev)
            if ev.kind is EventKind.ABORT:
                if ev.code == -1:
                    raise AbortConnection("replica restarted")
                if self.rep.cfg.sse_style == "0.5.9":
                    yield w.chat_delta(idx, {}, "abort") if self.chat else w.text(idx, "", "abort")
                else:
                    yield w.error(ev.reason, "InternalServerError" if ev.code == 500 else "SERVICE_UNAVAILABLE", ev.code or 500)
                yield w.DONE
                self.finish = ["abort"] * self.n
                return
            if ev.kind is EventKind.FIRST:
                if self.chat:
                    yield w.chat_delta(idx, {"role": "assistant", "content": ""})
                    if self.fault and self.fault.kind == "hang_after_first":
                        await asyncio.Event().wait()
                    if self._calls(idx):
                        for chunk in self._call_deltas(idx, ev.tokens):
                            yield chunk
                    else:
                        yield self._content(idx, ev.tokens)
                else:
                    yield self._content(idx, ev.tokens)
                if until_first:
                    return
            elif ev.kind is EventKind.TOKENS:
                if self._calls(idx):
                    for chunk in self._call_deltas(idx, ev.tokens):
                        yield chunk
                    continue
                yield self._content(idx, ev.tokens, ev_finish=None if self.chat else (ev.reason or None))
            elif ev.kind is EventKind.FINISH:
                self.finish[idx] = "tool_calls" if self._calls(idx) else ev.reason
                matched = self._matched(idx, self.finish[idx])
                if self.chat:
                    yield w.chat_delta(idx, {}, self.finish[idx], matched)
                elif not self.finish_shown[idx]:  # a 1-token completion: no text chunk carried the reason
                    yield w.text(idx, "", ev.reason, matched)
        if self.include_usage:
            yield w.usage_chunk(self._usage())
        yield w.DONE

    def _content(self, idx: int, n_tokens: int, ev_finish: str | None = None) -> bytes:
        self.chunks_sent += 1
        if self.fault and self.fault.kind == "reset_after_chunks" and self.chunks_sent > self.fault.n:
            raise AbortConnection("injected reset")
        text = self._text(idx, n_tokens)
        if self.chat:
            chunk = self.writer.chat_delta(idx, {"content": text})
        else:
            matched = self._matched(idx, ev_finish)
            self.finish_shown[idx] = ev_finish is not None
            chunk = self.writer.text(idx, text, ev_finish, matched)
        return self._with_usage(chunk)

    def _with_usage(self, chunk: bytes) -> bytes:
        """With `continuous_usage_stats`, content and tool-call chunks carry the running usage (no cache details)."""
        if not self.continuous:
            return chunk
        obj = orjson.loads(chunk[6:])
        obj["usage"] = {"prompt_tokens": self.prompt_len, "completion_tokens": sum(self.generated),
                        "total_tokens": self.prompt_len + sum(self.generated)}
        return ChunkWriter.sse(obj)

    async def hang(self) -> bytes:
        await asyncio.Event().wait()
        return b""

    async def never(self) -> AsyncIterator[bytes]:
        if False:  # pragma: no cover
            yield b""

    async def hang_plain(self, request: Request) -> Response:
        await run_until_disconnect(request.receive, asyncio.Event().wait())
        self.rep.cancel(self.sub)
        return Response(status_code=499)

    async def close(self, disconnected: bool) -> None:
        self.rep.cancel(self.sub)


class _Reset(Response):
    """A crash as close as ASGI allows: the status line goes out, then the connection is cut with no body."""

    def __init__(self) -> None:
        super().__init__(status_code=200)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]})
        raise AbortConnection("simulated crash")


def _queue_full_stream() -> Response:
    body = ChunkWriter.error("The request queue is full.", "SERVICE_UNAVAILABLE", 503) + ChunkWriter.DONE
    return Response(body, media_type="text/event-stream")


def create_sim_app(replica: Replica) -> Starlette:
    s = SimServer(replica)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await replica.start()
        yield
        await replica.stop()

    routes = [
        Route("/v1/chat/completions", s.chat, methods=["POST"]),
        Route("/v1/completions", s.completions, methods=["POST"]),
        Route("/v1/models", s.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", s.model, methods=["GET"]),
        Route("/health", s.health, methods=["GET"]),
        Route("/health_generate", s.health, methods=["GET"]),
        Route("/ready", s.ready, methods=["GET"]),
        Route("/ping", s.ping, methods=["GET"]),
        Route("/server_info", s.server_info, methods=["GET"]),
        Route("/get_server_info", s.server_info, methods=["GET"]),
        Route("/model_info", s.model_info, methods=["GET"]),
        Route("/get_model_info", s.model_info, methods=["GET"]),
        Route("/v1/loads", s.v1_loads, methods=["GET"]),
        Route("/get_load", s.get_load, methods=["GET"]),
        Route("/flush_cache", s.flush_cache, methods=["GET", "POST"]),
        Route("/metrics", s.metrics, methods=["GET"]),
        Route("/abort_request", s.abort_request, methods=["POST"]),
        Route("/slow_down", s.slow_down, methods=["GET", "POST"]),
        Route("/pause_generation", s.pause, methods=["POST"]),
        Route("/continue_generation", s.resume, methods=["POST"]),
        *[Route(p, s.noop, methods=["GET", "POST"]) for p in ("/start_profile", "/stop_profile", "/freeze_gc",
                                                               "/update_weights_from_disk", "/load_lora_adapter")],
        Route("/_sim/config", s.sim_config, methods=["GET", "POST"]),
        Route("/_sim/fault", s.sim_fault, methods=["POST"]),
        Route("/_sim/state", s.sim_state, methods=["GET"]),
        Route("/_sim/kv_events", s.sim_kv_events, methods=["GET", "POST"]),
        Route("/v1/tokenize", s.tokenize, methods=["POST"]),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return _json({"detail": "Not Found"}, 404)

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        return _json({"detail": "Method Not Allowed"}, 405)

    async def internal_error(request: Request, exc: Exception) -> Response:
        # SGLang answers unexpected exceptions with its envelope, never a traceback.
        return _err(500, f"Internal server error: {type(exc).__name__}", "InternalServerError")

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: method_not_allowed, Exception: internal_error})
    app.state.replica = replica
    return app
