"""Request parsing and the checks the gateway itself makes at the edge.

Ranges follow the OpenAI API reference (chat/completions and completions request schemas) plus what an engine
behind us can bear: one request like `{"n": 1000000}` or `{"max_tokens": 1e308}` must be refused here with a 400
naming the field, not forwarded to freeze a replica (issue 10). Unknown fields pass through untouched; only fields
the gateway knows are checked, and only impossible values are refused.

Limits that depend on where the request may go (a pool's cap on `n`, the model's context length) arrive as
`RequestLimits`; without them the API-wide bounds apply.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig
from gateway.errors import InvalidRequest
from gateway.pipeline.json_body import MAX_JSON_DEPTH as MAX_JSON_DEPTH  # re-exported: the edge's parse
from gateway.pipeline.json_body import parse_json as parse_json
from gateway.tokenizer import count_tokens, prompt_text, render_chat
from gateway.upstreams import CAPABILITIES

MAX_N = 128                        # OpenAI's documented maximum for `n`
DEFAULT_MAX_N_SELF_HOSTED = 8      # a pool of our own engines: n parallel sequences each hold KV cache
MAX_SEQUENCES = 2048               # prompts x n of one completions request (OpenAI's bound on a prompt array)
DEFAULT_MAX_SEQUENCES_SELF_HOSTED = 64  # a batch is as many sequences as its prompts x n: cap it like n
MAX_OUTPUT_TOKENS = 2**31 - 1      # without a known context: the engines' int32 bound
MAX_TOKEN_ID = 2**31 - 1           # token ids are int32 in every engine we front
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP = 4
INT64 = (-(2**63), 2**63 - 1)
ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function"})
# OpenAI's chat content parts, plus SGLang's video_url/audio_url (the engines we front accept them)
PART_TYPES = frozenset({"text", "image_url", "input_audio", "file", "refusal", "video_url", "audio_url"})
TOOL_CHOICES = frozenset({"none", "auto", "required"})
# the fields _check_sampling looks at: most requests carry none of them, and then it costs one disjointness test
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "logprobs",
                             "top_logprobs", "best_of", "logit_bias", "stop"})


@dataclass(frozen=True)
class RequestLimits:
    """What the pools a request may be sent to can bear; `None` fields mean "no narrower than the API's bound"."""

    max_n: int = MAX_N
    context_tokens: int | None = None
    max_sequences: int = MAX_SEQUENCES
    vocab_size: int | None = None  # token ids in a prompt must lie below it (unset: only MAX_TOKEN_ID bounds them)


def limits_for(config: GatewayConfig, pools: Iterable[str], registry: Any = None) -> RequestLimits:
    """The narrowest limits of the pools a request may be dispatched to (any of them may end up serving it). The
    context is the pool's configured `context_tokens`, else (given the `UpstreamRegistry`) the smallest
    `context_length` its SGLang servers reported in /server_info. The vocabulary is the pools' configured
    `vocab_size` (no engine reports it: neither SGLang's /server_info or /model_info nor vLLM's /v1/models)."""
    cap, seq, contexts, vocabs = MAX_N, MAX_SEQUENCES, [], []
    for name in pools:
        n, s, ctx, vocab = _pool_bounds(config, name)
        cap, seq = min(cap, n), min(seq, s)
        if vocab is not None:
            vocabs.append(vocab)
        if ctx is not None:
            contexts.append(ctx)
        elif registry is not None:
            contexts += [t.context_tokens for t in registry.by_pool.get(name, []) if t.context_tokens]
    return RequestLimits(max_n=cap, context_tokens=min(contexts) if contexts else None, max_sequences=seq,
                         vocab_size=min(vocabs) if vocabs else None)


# (id(config), pool) -> (config, max_n, max_sequences, configured context, vocab size): a config is immutable once
# loaded, so its pools' bounds are worked out once per config object, not on every request
_BOUNDS: dict[tuple[int, str], tuple[GatewayConfig, int, int, int | None, int | None]] = {}


def _pool_bounds(config: GatewayConfig, name: str) -> tuple[int, int, int | None, int | None]:
    hit = _BOUNDS.get((id(config), name))
    if hit is not None and hit[0] is config:
        return hit[1], hit[2], hit[3], hit[4]
    p = config.pool(name)
    own = CAPABILITIES[p.kind].self_hosted
    n = p.max_n if p.max_n is not None else DEFAULT_MAX_N_SELF_HOSTED if own else MAX_N
    s = p.max_sequences if p.max_sequences is not None else DEFAULT_MAX_SEQUENCES_SELF_HOSTED if own else MAX_SEQUENCES
    if len(_BOUNDS) > 4096:  # configs reloaded many times over (tests): start again
        _BOUNDS.clear()
    _BOUNDS[(id(config), name)] = (config, n, s, p.context_tokens, p.vocab_size)
    return n, s, p.context_tokens, p.vocab_size


@dataclass(frozen=True)
class ParsedRequest:
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    prompt_tokens: int
    max_output_tokens: int | None


# -- field checks ---------------------------------------------------------------------------------------------------
def _int(body: dict[str, Any], name: str, lo: int, hi: int, why: str = "") -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequest(f"'{name}' must be an integer between {lo} and {hi}{why}.", param=name)
    if not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be an integer between {lo} and {hi}{why}; got {v}.", param=name)
    return v


def _num(body: dict[str, Any], name: str, lo: float, hi: float) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise InvalidRequest(f"'{name}' must be a number between {lo:g} and {hi:g}.", param=name)


def _is_token_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKEN_ID


def _check_size(body: dict[str, Any], endpoint: str, limits: RequestLimits) -> int | None:
    """`n` and the output cap, the fields whose bound depends on the route; returns the output cap, if any."""
    cap_n = min(limits.max_n, MAX_N)
    n = _int(body, "n", 1, cap_n, "" if cap_n == MAX_N else " for this model (the serving pool's cap)")
    prompt = body.get("prompt") if endpoint == "completions" else None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        seqs = len(prompt) * (n or 1)  # a prompt list is a batch: each prompt is n sequences of its own
        if seqs > limits.max_sequences:
            raise InvalidRequest(f"This request asks for {seqs} sequences (prompts x n); at most "
                                 f"{limits.max_sequences} are allowed for this model.", param="prompt")
    if limits.vocab_size is not None and isinstance(prompt, list) and prompt:
        _check_vocab(prompt, limits.vocab_size)
    out_cap = limits.context_tokens or MAX_OUTPUT_TOKENS
    why = " (the model's context length)" if limits.context_tokens else ""
    legacy = _int(body, "max_tokens", 1, out_cap, why)  # checked even when the newer field is also set
    newer = _int(body, "max_completion_tokens", 1, out_cap, why) if endpoint == "chat/completions" else None
    return newer if newer is not None else legacy


def _check_vocab(prompt: list[Any], vocab: int) -> None:
    """Token ids past the model's vocabulary are refused here: real SGLang 0.5.23 does not check them, and one such
    id killed its scheduler, the whole server with it (docs/results/2026-11-27-differential.md)."""
    seqs = prompt if isinstance(prompt[0], list) else [prompt]
    for i, seq in enumerate(seqs):
        if not isinstance(seq, list) or not seq or not all(type(t) is int for t in seq):
            continue  # strings, or ids the type check refuses with its own message
        top = max(seq)
        if top >= vocab:
            where = "prompt" if seqs is not prompt else f"prompt[{i}]"
            raise InvalidRequest(f"{where} holds token id {top}, past this model's vocabulary of {vocab} tokens "
                                 f"(ids 0 to {vocab - 1}).", param="prompt", code="token_id_out_of_vocabulary")


def _check_sampling(body: dict[str, Any], endpoint: str) -> None:
    if body.keys().isdisjoint(SAMPLING_FIELDS):
        return
    _num(body, "temperature", 0, 2)
    _num(body, "top_p", 0, 1)
    _num(body, "presence_penalty", -2, 2)
    _num(body, "frequency_penalty", -2, 2)
    _int(body, "seed", *INT64)
    if endpoint == "chat/completions":
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise InvalidRequest("'logprobs' must be a boolean on chat completions.", param="logprobs")
        _int(body, "top_logprobs", 0, 20)
    else:
        _int(body, "logprobs", 0, 5)
        _int(body, "best_of", 0, 20)
    _check_logit_bias(body.get("logit_bias"))
    _check_stop(body.get("stop"))


def _check_logit_bias(lb: Any) -> None:
    if lb is None:
        return
    if not isinstance(lb, dict):
        raise InvalidRequest("'logit_bias' must be an object mapping token ids to a bias.", param="logit_bias")
    if len(lb) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries.", param="logit_bias")
    for k, v in lb.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 10 and int(k) <= MAX_TOKEN_ID):
            raise InvalidRequest(f"'logit_bias' keys must be token ids (0 to {MAX_TOKEN_ID}); got {k[:32]!r}.",
                                 param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not -100 <= v <= 100:
            raise InvalidRequest(f"'logit_bias' values must be numbers between -100 and 100 (token {k}).",
                                 param="logit_bias")


def _check_stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest(f"'stop' must be a string or an array of at most {MAX_STOP} strings.", param="stop")


def _check_messages(msgs: Any) -> list[dict[str, Any]]:
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("'messages' must be a non-empty array.", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a string 'role'.", param=f"messages[{i}].role")
        if m["role"] not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}; got {m['role'][:32]!r}.",
                                 param=f"messages[{i}].role")
        c = m.get("content")
        if c is None or isinstance(c, str):
            continue
        if not isinstance(c, list):
            raise InvalidRequest(f"messages[{i}].content must be a string or an array of parts.",
                                 param=f"messages[{i}].content")
        for j, part in enumerate(c):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
                raise InvalidRequest(f"{where} must be an object whose 'type' is one of {', '.join(sorted(PART_TYPES))}.",
                                     param=f"{where}.type")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.text must be a string.", param=f"{where}.text")
    return msgs


def _check_tools(body: dict[str, Any]) -> list[Any] | None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("'tools' must be an array.", param="tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("type"), str):
                raise InvalidRequest(f"tools[{i}] must be an object with a string 'type'.", param=f"tools[{i}]")
            if t["type"] == "function":
                fn = t.get("function")
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise InvalidRequest(f"tools[{i}].function must be an object with a non-empty 'name'.",
                                         param=f"tools[{i}].function")
                if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                    raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON Schema object.",
                                         param=f"tools[{i}].function.parameters")
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, dict) and not (isinstance(choice, str) and choice in TOOL_CHOICES):
        raise InvalidRequest("'tool_choice' must be 'none', 'auto', 'required' or an object naming a tool.",
                             param="tool_choice")
    return tools


def _prompt_tokens(prompt: Any) -> int:
    """Token count of a completions prompt: a string, strings, token ids, or arrays of token ids (none empty)."""
    if prompt is None or prompt == "" or prompt == []:
        raise InvalidRequest("'prompt' is required and must not be empty.", param="prompt")
    if isinstance(prompt, list):
        for i, p in enumerate(prompt):
            if p == "" or p == []:
                raise InvalidRequest(f"prompt[{i}] must not be empty.", param="prompt")
    text = prompt_text(prompt)
    if text is not None:
        return count_tokens(text)
    if isinstance(prompt, list) and all(_is_token_id(t) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
        return sum(len(p) for p in prompt)
    raise InvalidRequest(f"'prompt' must be a string, an array of strings, or token ids (integers 0 to {MAX_TOKEN_ID}, "
                         "or non-empty arrays of them).", param="prompt")


def check_limits(parsed: ParsedRequest, endpoint: str, limits: RequestLimits) -> None:
    """The route-dependent checks alone, for a caller that learns the pools after `validate` (the pipeline resolves
    the tenant's route from the model name `validate` returned)."""
    _check_size(parsed.body, endpoint, limits)


def validate(body: dict[str, Any], endpoint: str, limits: RequestLimits | None = None) -> ParsedRequest:
    limits = limits or RequestLimits()
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string.", param="model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    if so is not None and not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    include_usage = bool(so and so.get("include_usage"))
    max_out = _check_size(body, endpoint, limits)
    _check_sampling(body, endpoint)
    if endpoint == "chat/completions":
        msgs = _check_messages(body.get("messages"))
        prompt_tokens = count_tokens(render_chat(msgs, _check_tools(body)))
    else:
        prompt_tokens = _prompt_tokens(body.get("prompt"))
    return ParsedRequest(body, model, stream, include_usage, prompt_tokens, max_out)


IMAGE_PARTS = frozenset({"image_url", "input_image"})


def first_image(body: dict[str, Any]) -> str | None:
    """Where a chat body's first image part is (`messages[i].content[j]`), or None."""
    for i, m in enumerate(body.get("messages") or ()):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                return f"messages[{i}].content[{j}]"
    return None


def refuse_images(body: dict[str, Any], model: str, where: str | None = "") -> None:
    """400 naming the first image part of a chat body sent to a model configured `vision: false`: OpenAI and the
    engines (SGLang, vLLM) refuse image input to a text-only model too, and here no replica spends a prefill on it.
    `where`: that part as `first_image` found it ahead (the front half of a large body); "": look now."""
    where = first_image(body) if where == "" else where
    if where is not None:
        raise InvalidRequest(f"The model '{model}' does not take image input; send text only.",
                             param=where, code="image_input_not_supported")
