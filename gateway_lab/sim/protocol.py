"""SGLang's wire shapes: error envelopes, the simulated output text and stop strings, response bodies and SSE chunks
(spec section 2). Request validation is sim/validation.py; what a structured choice says, sim/choice_plan.py."""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

# Output text: token j of a completion is WORDS[(base + j * 7919) % len(WORDS)], so text is a pure function
# of (seed, prompt, choice index) and exactly `completion_tokens` words long.
WORDS = [
    " the", " model", " cache", " token", " route", " fast", " node", " prefix", " replica", " and", " of",
    " to", " is", " a", " in", " that", " with", " for", " it", " on", " as", " this", " be", " by", " GPU",
    " batch", " queue", " load", " first", " time", " at", " we",
]




class SimHTTPError(Exception):
    """An error SGLang would answer with its flat envelope."""

    def __init__(self, status: int, message: str, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or ("Bad Request" if status == 400 else "BadRequestError")


def error_body(status: int, message: str, type_: str) -> bytes:
    return orjson.dumps({"object": "error", "message": message, "type": type_, "param": None, "code": status})


def new_id() -> str:
    return uuid.uuid4().hex


def output_text(base: int, start: int, n: int) -> str:
    w = WORDS
    return "".join(w[(base + j * 7919) % len(w)] for j in range(start, start + n))


def text_base(server_seed: int, prompt_len: int, seed: object) -> int:
    """The output text's offset into WORDS for one request (str-seeded: the same in every process)."""
    return random.Random(f"{server_seed}|{prompt_len}|{seed!r}").getrandbits(16)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


@dataclass(frozen=True)
class StopAt:
    """Where a choice's text ends on a stop string (SGLang: finish_reason "stop", matched_stop = the string, the
    string itself trimmed from the text)."""

    tokens: int  # tokens generated, the stop string's included
    keep: int | None  # characters of text the client sees (None: all of it; the string came after the last token)
    matched: str


def stop_at(base: int, n: int, stops: list[str], natural_end: bool) -> StopAt | None:
    """The first stop string the choice's text would contain within its `n` tokens; else, when the choice ends
    where the model would end (EOS, not the cap), the first stop string, as a model told to end with it writes it
    there. None: the choice ends as drawn (EOS or the cap)."""
    if not stops:
        return None
    text = output_text(base, 0, n)
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if hits:
        start, matched = min(hits)
        end, tokens, chars = start + len(matched), 0, 0
        while chars < end:
            chars += len(WORDS[(base + tokens * 7919) % len(WORDS)])
            tokens += 1
        return StopAt(tokens, start, matched)
    return StopAt(n, None, stops[0]) if natural_end else None



# -- bodies --------------------------------------------------------------------------------------------------
def usage(prompt: int, completion: int, cached: int, cache_report: bool, zero_cached_details: bool = True
          ) -> dict[str, Any]:
    """`zero_cached_details`: with the cache report, nothing cached still gives `{"cached_tokens": 0}` (0.5.23);
    0.5.13 leaves `prompt_tokens_details` None then (its UsageProcessor._details_if_cached)."""
    # counts are sums over choices; a negative one would break every consumer (Prometheus counters raise on it)
    prompt, completion, cached = max(0, prompt), max(0, completion), min(max(0, cached), max(0, prompt))
    details = {"cached_tokens": cached} if cache_report and (cached or zero_cached_details) else None
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
        "reasoning_tokens": 0,
    }


def tool_call(call_id: str | None, idx: int, name: str | None, arguments: str) -> dict[str, Any]:
    """A tool call as SGLang sends it; in a stream, the first delta of a call carries id and name, later ones null."""
    return {"id": call_id, "index": idx, "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"  # SGLang's form for every parser but Kimi's


class ChunkWriter:
    """SSE chunks in one SGLang release's style ("0.5.9": pydantic, all nulls; "0.5.13": fast path)."""

    def __init__(self, rid: str, model: str, style: str, chat: bool) -> None:
        self.rid = rid
        self.model = model
        self.style = style
        self.chat = chat
        self.created = int(time.time())

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }

    @staticmethod
    def sse(obj: Any) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def chat_delta(self, index: int, delta: dict[str, Any], finish: str | None = None, matched: Any = None) -> bytes:
        if self.style == "0.5.9":
            full = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}
            full.update(delta)
            delta = full
        else:
            delta = {"reasoning_content": None, **delta}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        obj = {**self._head(), "choices": [choice]}
        if self.style == "0.5.9":
            obj["usage"] = None
        return self.sse(obj)

    def text(self, index: int, text: str, finish: str | None = None, matched: Any = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        return self.sse({**self._head(), "choices": [choice]})

    def usage_chunk(self, u: dict[str, Any]) -> bytes:
        if not self.chat:  # completions drop nulls from the usage chunk
            u = {k: v for k, v in u.items() if v is not None}
        return self.sse({**self._head(), "choices": [], "usage": u})

    @staticmethod
    def error(message: str, type_: str, code: int) -> bytes:
        return ChunkWriter.sse({"error": {"object": "error", "message": message, "type": type_, "param": None, "code": code}})

    DONE = b"data: [DONE]\n\n"
