"""SGLang-typed request validation (spec section 2): the pydantic request models and the range checks SGLang enforces."""

from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from gateway.tokenizer import count_tokens, token_array
from gateway_lab.sim.protocol import SimHTTPError
from gateway_lab.sim.structured import Budget, SchemaError, check_schema

_M = TypeVar("_M", bound=BaseModel)


# -- validation ----------------------------------------------------------------------------------------------
# Request bodies are parsed with pydantic models typed as SGLang's own (`entrypoints/openai/protocol.py`, lax mode:
# "2" and 2.0 pass as an int, 2.5 and 1e308 do not), then checked against the ranges SGLang enforces
# (`SamplingParams.verify`, the tokenizer manager's context checks). Unknown fields are ignored, as in SGLang.
# On top, the simulator bounds the work one request can ask for (n, choices, body size, logprobs): SGLang would
# run such a request for a long time; a simulator that runs in one process must never stall on it.
MAX_BODY_BYTES = 16 << 20  # a 1M-token context is ~4 MB of text or ~8 MB of ids; anything larger is refused unread [inf]
MAX_N = 128  # OpenAI's documented range for n (SGLang has no cap) [inf]
MAX_CHOICES = 1024  # prompts x n in one completions call [inf]
MAX_TOP_LOGPROBS = 20  # OpenAI's range for top_logprobs; the completions API documents 5 [inf]
MAX_MESSAGES = 100_000  # [inf]
MAX_TOOLS = 1024  # [inf]
ROLES = ("system", "user", "assistant", "tool", "function", "developer", "latest_reminder", "root")  # SGLang's Literals


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Function(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False


class Tool(_Model):
    type: Literal["function"] = "function"
    function: _Function


class _ToolChoiceFunction(_Model):
    name: str


class _ToolChoice(_Model):
    type: Literal["function"] = "function"
    function: _ToolChoiceFunction


class _JsonSchemaFormat(_Model):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(alias="schema", default=None)
    strict: StrictBool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: _JsonSchemaFormat | None = None


class _StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Common(_Model):
    model: str = "default"
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    rid: list[str] | str | None = None
    extra_key: list[str] | str | None = None
    cache_salt: list[str] | str | None = None
    data_parallel_rank: int | None = None
    response_format: ResponseFormat | None = None


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: _ToolChoice | Literal["auto", "required", "none"] | None = None
    parallel_tool_calls: bool = True
    # 0.5.23's type (0.5.9 / 0.5.13: low / medium / high only); accepted, not simulated (no reasoning is generated)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max"] | float | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Common):
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int = 16
    logprobs: int | None = None
    echo: bool = False
    json_schema: str | None = None  # SGLang's extension: a schema as a JSON string


def _pydantic_message(e: ValidationError) -> str:
    """pydantic's text without its documentation links (SGLang returns str(exc); the text is not stable anyway)."""
    return "\n".join(line for line in str(e).splitlines() if "errors.pydantic.dev" not in line)


def _parse(cls: type[_M], body: dict[str, Any]) -> _M:
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise SimHTTPError(400, _pydantic_message(e)) from None


def _bad(message: str) -> SimHTTPError:
    return SimHTTPError(400, message, "BadRequestError")


def _check_common(req: _Common, vocab: int, budget: Budget) -> None:
    """SGLang's `SamplingParams.verify` ranges, the LoRA name rule, and the simulator's work bounds."""
    if ":" in req.model:
        adapter = req.model.split(":", 1)[1]
        raise _bad(
            f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please launch the server with "
            "--enable-lora flag and preload adapters by --lora-paths or /load_lora_adapter endpoint.")
    if not 1 <= req.n <= MAX_N:
        # SGLang 0.5.23 refuses n while building the request (a ValueError, typed "BadRequest"), not in the pydantic
        # checks that type the others "BadRequestError" (gateway engines diff, docs/results/2026-11-27-differential.md)
        raise SimHTTPError(400, f"n must be in [1, {MAX_N}], got {req.n}.", "BadRequest")
    t = req.temperature
    if t is not None and (not math.isfinite(t) or t < 0.0):
        raise _bad(f"temperature must be a non-negative finite number, got {t}.")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise _bad(f"top_p must be in (0, 1], got {req.top_p}.")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise _bad(f"min_p must be in [0, 1], got {req.min_p}.")
    if req.top_k is not None and req.top_k != -1 and req.top_k < 1:
        raise _bad(f"top_k must be -1 (disable) or at least 1, got {req.top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        v = getattr(req, name)
        if not -2.0 <= v <= 2.0:
            raise _bad(f"{name} must be in [-2, 2], got {v}.")
    rp = req.repetition_penalty
    if rp is not None and not 0.0 < rp <= 2.0:
        raise _bad(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rp}.")
    if req.min_tokens < 0:
        raise _bad(f"min_new_tokens must be in [0, max_new_tokens], got {req.min_tokens}.")
    if req.logit_bias:
        for key in req.logit_bias:
            try:
                tid = int(key)
            except ValueError:
                raise _bad(f"invalid literal for int() with base 10: {key[:40]!r}") from None
            if not 0 <= tid < vocab:
                raise _bad(f"logit_bias must has keys in [0, {vocab - 1}], got {tid}.")
    if req.seed is not None and not -(2**63) <= req.seed <= 2**63 - 1:
        raise _bad(f"sampling_seed must be in [-2**63, 2**63 - 1], got {req.seed}.")
    rf = req.response_format
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise _bad("response_format.json_schema is required when type is 'json_schema'.")
        try:
            check_schema(rf.json_schema.schema_, budget)
        except SchemaError as e:
            raise _bad(f"Invalid response_format json_schema: {e}") from None


def parse_chat(body: dict[str, Any], vocab: int) -> ChatCompletionRequest:
    if body.get("messages") is None:
        raise SimHTTPError(400, "1 validation error for ChatCompletionRequest\nmessages\n  Field required")
    msgs = body["messages"]
    if isinstance(msgs, list) and len(msgs) > MAX_MESSAGES:  # before the per-message work
        raise _bad(f"{len(msgs)} messages exceed the simulator's bound of {MAX_MESSAGES}.")
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise _bad(f"{len(tools)} tools exceed the simulator's bound of {MAX_TOOLS}.")
    req = _parse(ChatCompletionRequest, body)
    budget = Budget()
    _check_common(req, vocab, budget)
    msgs = req.messages
    if not msgs:
        raise _bad("Messages cannot be empty.")
    for i, m in enumerate(msgs):
        role = m.get("role")
        if not isinstance(role, str):
            raise SimHTTPError(400, f"1 validation error for ChatCompletionRequest\nmessages.{i}.role\n  Field required")
        if role not in ROLES:
            raise SimHTTPError(400, f"1 validation error for ChatCompletionRequest\nmessages.{i}.role\n  Input should be "
                               f"{', '.join(repr(r) for r in ROLES)}")
        c = m.get("content")
        if c is None and role == "user":
            raise SimHTTPError(400, f"1 validation error for ChatCompletionRequest\nmessages.{i}.content\n  Field required")
        if c is not None and not isinstance(c, (str, list)):
            raise SimHTTPError(400, f"1 validation error for ChatCompletionRequest\nmessages.{i}.content\n  Input should be a valid string")
        for j, part in enumerate(c if isinstance(c, list) else []):
            # SGLang's content parts are typed models (text, image_url, input_audio, ...): a bare value is refused
            if not isinstance(part, dict) or not isinstance(part.get("type"), str) or (
                    part["type"] == "text" and not isinstance(part.get("text"), str)):
                raise SimHTTPError(400, f"1 validation error for ChatCompletionRequest\nmessages.{i}.content.{j}\n  "
                                   "Input should be a valid content part")
    if isinstance(req.reasoning_effort, float) and not 0.0 <= req.reasoning_effort <= 0.99:
        raise SimHTTPError(400, "1 validation error for ChatCompletionRequest\nreasoning_effort\n  Input should be "
                           "less than or equal to 0.99")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise _bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}.")
    for name in ("max_tokens", "max_completion_tokens"):
        v = getattr(req, name)
        if v is not None and v <= 0:
            raise _bad(f"{name} must be positive.")
    tools = req.tools or []
    choice = req.tool_choice
    if choice == "required" and not tools:
        raise _bad("Tool usage requires tools to be provided (tool_choice='required').")
    if isinstance(choice, _ToolChoice):
        if not tools:
            raise _bad("Tools cannot be empty if tool choice is set to a specific tool.")
        if choice.function.name not in {t.function.name for t in tools}:
            raise _bad(f"Tool '{choice.function.name}' not found in tools list.")
    for i, t in enumerate(tools):
        if t.function.parameters is not None:
            try:
                check_schema(t.function.parameters, budget)
            except SchemaError as e:
                raise _bad(f"Tool {i} function has invalid 'parameters' schema: {e}") from None
    return req


def check_prompt_len(n_tokens: int, context_length: int) -> None:
    """SGLang's first context check; run on the token count before tokenizing, so an oversized prompt costs nothing."""
    if n_tokens >= context_length:
        raise _bad(f"The input ({n_tokens} tokens) is longer than the model's context length ({context_length} tokens).")


def parse_completion(body: dict[str, Any], vocab: int, context_length: int) -> tuple[CompletionRequest, list[np.ndarray]]:
    """The request and its prompts as token arrays: one per prompt of a batch (`["a", "b"]`, `[[1, 2], [3]]`)."""
    if body.get("prompt") is None:
        raise SimHTTPError(400, "1 validation error for CompletionRequest\nprompt\n  Field required")
    raw = body["prompt"]
    if isinstance(raw, list) and raw and not isinstance(raw[0], int):  # a batch: bound it before the per-member work
        n = body.get("n", 1)
        n = n if isinstance(n, int) and n > 0 else 1
        if len(raw) * n > MAX_CHOICES:
            raise _bad(f"{len(raw)} prompts x n={n} exceeds the simulator's bound of {MAX_CHOICES} choices per request.")
    elif isinstance(raw, list):
        check_prompt_len(len(raw), context_length)
    req = _parse(CompletionRequest, body)
    budget = Budget()
    _check_common(req, vocab, budget)
    if req.max_tokens <= 0:
        raise _bad("max_tokens must be positive")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise _bad(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}.")
    if req.json_schema is not None:
        try:
            check_schema(orjson.loads(req.json_schema), budget)
        except (orjson.JSONDecodeError, SchemaError) as e:
            raise _bad(f"Invalid json_schema: {e}") from None
    prompt = req.prompt
    # SGLang: `not prompt or all(not p for p in prompt)`; the simulator also refuses an empty member of a batch, which
    # would be a zero-token sequence (a real tokenizer adds BOS; this one does not)
    if not prompt or (isinstance(prompt, list) and any(isinstance(p, (str, list)) and not p for p in prompt)):
        raise _bad("Prompt cannot be empty")
    for p in [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt:
        check_prompt_len(count_tokens(p) if isinstance(p, str) else len(p), context_length)
    if isinstance(prompt, str):
        seqs = [token_array(prompt)]
    elif isinstance(prompt[0], str):
        seqs = [token_array(p) for p in prompt]
    elif isinstance(prompt[0], int):
        seqs = [_ids(prompt, vocab)]
    else:
        seqs = [_ids(p, vocab) for p in prompt]
    if len(seqs) * req.n > MAX_CHOICES:
        raise _bad(f"{len(seqs)} prompts x n={req.n} exceeds the simulator's bound of {MAX_CHOICES} choices per request.")
    return req, seqs


def _ids(ids: list[int], vocab: int) -> np.ndarray:
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise _bad(f"Token id {bad} is out of vocabulary (vocab size: {vocab}).")
    return np.asarray(ids, dtype=np.uint32)


def chat_tools_offered(req: ChatCompletionRequest) -> list[Tool]:
    """The tools a chat request may call: none under tool_choice 'none', only the named one under a named choice."""
    tools = req.tools or []
    choice = req.tool_choice
    if not tools or choice == "none":
        return []
    if isinstance(choice, _ToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return tools


def calls_tools(req: ChatCompletionRequest) -> bool:
    """Whether this turn answers with tool calls. 'required' and a named choice always do; 'auto' (the default
    with tools) does when the conversation does not end with a tool result, so an agent loop calls, gets the
    results, then answers in text."""
    if not chat_tools_offered(req):
        return False
    if req.tool_choice == "required" or isinstance(req.tool_choice, _ToolChoice):
        return True
    return req.messages[-1].get("role") not in ("tool", "function")
