"""What a structured choice says: tool calls or schema-driven JSON, cut into tokens (sim/structured.py makes the values)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.tokenizer import CHARS_PER_TOKEN
from gateway_lab.sim.protocol import new_call_id
from gateway_lab.sim.structured import Budget, SchemaError, generate
from gateway_lab.sim.validation import ChatCompletionRequest, CompletionRequest, calls_tools, chat_tools_offered


# -- what a choice says --------------------------------------------------------------------------------------
@dataclass
class ChoicePlan:
    """The exact output of a choice when it is not filler words: JSON for `response_format`, or tool calls.

    Tokens follow the simulator's token rule (4 characters each, `count_tokens`): each call's arguments, or the JSON
    text, is cut into 4-character pieces, so `completion_tokens` is the number of pieces and a stream carries them
    a decode step at a time."""

    calls: list[tuple[str, str, str]]  # (id, name, arguments JSON) when the choice answers with tool calls
    pieces: list[tuple[int, str]]  # (call index, or -1 for content; text) per output token

    @property
    def tokens(self) -> int:
        return len(self.pieces)

    def truncated(self, cap: int) -> ChoicePlan:
        """What a length-capped choice says: the first `cap` tokens as plain content (no call parses)."""
        return ChoicePlan([], [(-1, text) for _, text in self.pieces[:cap]])


def _pieces(text: str, call: int) -> list[tuple[int, str]]:
    return [(call, text[i : i + CHARS_PER_TOKEN]) for i in range(0, len(text), CHARS_PER_TOKEN)] or [(call, "")]


_JSON_OBJECT = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number",
                "minimum": 0, "maximum": 1}}, "required": ["answer"]}


def plan_chat(req: ChatCompletionRequest, rng: random.Random, budget: Budget | None = None) -> ChoicePlan | None:
    """Tool calls or JSON for one chat choice, deterministic on `rng`; None for ordinary text."""
    if calls_tools(req):
        offered = chat_tools_offered(req)
        if len(offered) == 1 or not req.parallel_tool_calls or req.tool_choice not in (None, "auto", "required"):
            chosen = [offered[rng.randrange(len(offered))]]
        else:
            chosen = rng.sample(offered, rng.randint(1, min(3, len(offered))))
        calls, pieces = [], []
        for i, t in enumerate(chosen):
            schema = t.function.parameters if t.function.parameters is not None else {"type": "object", "properties": {}}
            args = _dumps(generate(schema, rng, budget))
            calls.append((new_call_id(), t.function.name, args))
            pieces += _pieces(args, i)
        return ChoicePlan(calls, pieces)
    return plan_json(req, rng, budget)


def plan_json(req: ChatCompletionRequest | CompletionRequest, rng: random.Random, budget: Budget | None = None
              ) -> ChoicePlan | None:
    """JSON content for `response_format` (chat and completions) or completions' `json_schema`; None otherwise."""
    schema: Any = None
    if isinstance(req, CompletionRequest) and req.json_schema is not None:
        schema = orjson.loads(req.json_schema)
    rf = req.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        schema = rf.json_schema.schema_
    elif rf is not None and rf.type == "json_object":
        schema = _JSON_OBJECT
    if schema is None:
        return None
    return ChoicePlan([], _pieces(_dumps(generate(schema, rng, budget)), -1))


def _dumps(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError as e:  # e.g. a const or enum nested past orjson's depth limit
        raise SchemaError(f"the generated value cannot be written as JSON: {e}") from None
