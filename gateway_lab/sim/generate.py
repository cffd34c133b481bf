"""The generation endpoints of one simulated SGLang server: request checks, pinned rank, PD bootstrap, priority, and
the per-choice plan handed to the replica (the answer itself is written by sim/reply.py)."""

from __future__ import annotations

import asyncio
import random
import sys
import zlib
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.asgi import EventStreamResponse
from gateway.tokenizer import VOCAB_SIZE, count_tokens, render_chat, token_array
from gateway_lab.sim.choice_plan import ChoicePlan, plan_chat, plan_json
from gateway_lab.sim.pd import Bootstrap, bootstrap_fields, pd_room_hook, rank_for_room
from gateway_lab.sim.profiles import ReplicaConfig
from gateway_lab.sim.protocol import SimHTTPError, StopAt, new_id, stop_at, stop_strings, text_base
from gateway_lab.sim.replica import Replica
from gateway_lab.sim.reply import Reply
from gateway_lab.sim.structured import MAX_VALUES, Budget, SchemaError
from gateway_lab.sim.validation import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_tools_offered,
    check_prompt_len,
    parse_chat,
    parse_completion,
)
from gateway_lab.sim.wire import (
    OFFLOAD_BYTES,
    authorized,
    decode_body,
    error_response,
    json_response,
    queue_full_stream,
    raw_body,
)


def request_priority(cfg: ReplicaConfig, body: dict[str, Any]) -> int:
    """SGLang's rules: with priority scheduling, a request without `priority` gets --default-priority-value
    (0.5.13+) or else the lowest value; without it, a priority is ignored or (abort flag) refused with 503."""
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


class GenerateApi:
    """/v1/chat/completions and /v1/completions: validate, plan each choice, submit to a rank, answer."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    # -- request fields --------------------------------------------------------------------------------------
    def _prepare(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], ChatCompletionRequest | CompletionRequest, list[np.ndarray]]:
        body = decode_body(raw)
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

    # -- generation ------------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def _handle(self, request: Request, chat: bool) -> Response:
        if not authorized(self.replica, request):
            return json_response({"error": "Unauthorized"}, 401)
        try:
            raw = await raw_body(request)
            if len(raw) > OFFLOAD_BYTES:
                # parsed, validated and tokenized on a worker thread: one large body (a 1M-token prompt, or 16 MB of
                # tiny messages) slows the other requests of this process a little instead of stalling them all
                body, req, seqs = await asyncio.to_thread(self._prepare, raw, chat)
            else:
                body, req, seqs = self._prepare(raw, chat)
            return await self._generate(request, body, req, seqs, chat)
        except SimHTTPError as e:
            return error_response(e.status, e.message, e.type)

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
            return error_response(503, "The server is not ready.", "503")
        try:
            # a queued one-shot fault is for client traffic: a gateway's startup probe (which may arrive after a test
            # queued it) never consumes it; an explicit X-Sim-Fault header still applies
            probe = "x-gateway-probe" in request.headers
            fault = rep.take_fault(request.headers.get("x-sim-fault"), queued=not probe)
        except ValueError as e:
            raise SimHTTPError(400, str(e), "BadRequestError") from None
        if fault and fault.kind == "status":
            return error_response(fault.status, f"Injected fault: status {fault.status}.", str(fault.status))
        pd = self._bootstrap(body, n, len(seqs))
        pinned = self._pinned_rank(request, body)
        if pd is not None and pinned is None:
            pinned = rank_for_room(pd.room, rep.num_ranks)  # SGLang's follow_bootstrap_room: both sides agree
        rank = rep.pick_rank(pinned)
        priority = request_priority(self.replica.cfg, body)
        if not probe:
            rep.priorities.append(body.get("priority"))
        if rep.queue_full(rank):
            if stream and cfg.sse_style != "0.5.9":
                return queue_full_stream()
            return error_response(503, "The request queue is full.", "503")

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
        ctx_ = Reply(self.replica, sub, body, chat, sum(len(t) for t in seqs), lengths, plans, rid, fault, n, base, stops)
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
