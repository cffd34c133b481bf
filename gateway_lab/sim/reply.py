"""One generation call's answer: turns rank events into SGLang responses, non-streaming JSON or SSE chunks, with
faults (resets, hangs) injected where asked."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.asgi import AbortConnection, run_until_disconnect
from gateway_lab.sim.choice_plan import ChoicePlan
from gateway_lab.sim.protocol import ChunkWriter, StopAt, output_text, tool_call, usage
from gateway_lab.sim.replica import Fault, Replica
from gateway_lab.sim.sim_request import Event, EventKind
from gateway_lab.sim.wire import (
    Reset,
    error_response,
    json_response,
)

EOS_TOKEN_ID = 154827


class Reply:
    """One generation call: turns rank events into SGLang responses (non-streaming or SSE)."""

    def __init__(self, replica: Replica, sub: Any, body: dict[str, Any], chat: bool, prompt_len: int,
                 lengths: list[tuple[int, str]], plans: list[ChoicePlan | None], rid: str, fault: Fault | None,
                 n_per_prompt: int = 1, base: int = 0, stops: list[StopAt | None] | None = None) -> None:
        self.rep = replica
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
        cfg = self.rep.cfg
        return usage(self.prompt_len, sum(self.generated), cached, cfg.enable_cache_report,
                     zero_cached_details=cfg.at_least("0.5.23") or not cfg.at_least("0.5.13"))

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
            return Reset()
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
                    return Reset()
                return error_response(ev.code or 500, ev.reason, "InternalServerError" if ev.code == 500 else str(ev.code))
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
        return json_response({"id": self.writer.rid, "object": "chat.completion" if self.chat else "text_completion",
                      "created": created, "model": self.model, "choices": choices, "usage": self._usage(),
                      "metadata": {"weight_version": "default"}})

    # -- streaming -------------------------------------------------------------------------------------------
    async def first_chunk(self) -> bytes | Response:
        if self.fault and self.fault.kind == "reset_before_headers":
            return Reset()
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
