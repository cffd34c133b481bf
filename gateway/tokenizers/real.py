"""The model's own tokenizer: `tokenizer.json` (HF `tokenizers`, Rust) and the chat template from
`tokenizer_config.json`, rendered with jinja2 the way SGLang (via transformers' apply_chat_template) renders it:
a sandboxed environment with trim_blocks/lstrip_blocks, `messages`, `tools`, `add_generation_prompt=True`, the
special tokens as variables, `raise_exception` and a `tojson` filter; the text is encoded without adding special
tokens (the template writes them).

Turns of a conversation repeat: each request's rendering starts with the previous turn's. The ids of a rendered
prefix are cached (LRU) and reused when the new rendering extends it at a special-token boundary (where the
tokenizer splits before anything else, so ids(prefix + rest) == ids(prefix) + ids(rest)); only the rest is
encoded. A 20k-token conversation's next turn then costs the new turn's tokens, not 20k (docs/kv-events.md).
Entries are kept per namespace (the tenant's cache namespace, as the engine's own cache is): a tenant holds at most
NAMESPACE_ENTRIES of the CACHE_ENTRIES, and never reuses ids another tenant's request left.

What a next turn costs, then (loadtests/tokenize_cost.py --turns, docs/results/2026-11-27-incremental-tokenization.md):
encoding its new text, which no cache can avoid (done with `encode_batch_fast`: the same ids without the offsets
`encode` also computes, a fifth of its time), one render of the template, and one pass of the cache key's hash over
the text: the cached prefixes of the namespace are looked up by their lengths (no render of the previous turn), and the
key of the prefix this turn leaves is taken on from the same pass.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.tokenizer import content_text
from gateway.tokenizers import TemplateRefused
from gateway.tokenizers.sim import token_ids_of

CACHE_ENTRIES = 256
CHECKED_RENDERS = 8  # requests whose generation prompt is checked to be a plain suffix before it is trusted to be
NAMESPACE_ENTRIES = 64  # one tenant's conversations cannot take more of the cache than this, so none evicts the rest


# How an engine hands a request's tools to the chat template (each its request model's dump). The gateway cannot
# know it from the model files: it learns it from the engine's /v1/tokenize of TOOLS_PROBE (learn_tool_layout).
# - client_order: the client's keys in its order, then the fields it left out at their defaults (`function.description`
#   and `.parameters` None, the tool's `defer_loading` None), so the template writes them as `null` (SGLang 0.5.23,
#   whose `Function` keeps the client's key order and drops an unset `strict`);
# - declared_order: the model's fields in declaration order, `strict` false when unset, the client's other keys
#   dropped (SGLang 0.5.13: `{type, function: {description, name, parameters, strict}, defer_loading}`);
# - as_sent: the tools exactly as the client sent them.
TOOL_LAYOUTS = ("client_order", "declared_order", "as_sent")
TOOLS_PROBE: dict[str, Any] = {
    "messages": [{"role": "user", "content": "weather in Paris?"}],
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}


def engine_tools(tools: Any, layout: str = "client_order") -> list[Any] | None:
    """The tools as an engine hands them to the chat template, in one of TOOL_LAYOUTS. Rendered as sent against an
    engine that renders its dump, a request with tools gets other ids than the engine's, and precise routing never
    matches its pages (seen against real servers' /v1/tokenize: tests/engines/test_tier.py)."""
    if not isinstance(tools, list) or not tools:
        return None
    if layout == "as_sent":
        return tools
    out: list[Any] = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            out.append(t)
            continue
        fn = t["function"]
        if layout == "declared_order":
            f2 = {"description": fn.get("description"), "name": fn.get("name"), "parameters": fn.get("parameters"),
                  "strict": fn.get("strict", False)}
            defer = fn.get("defer_loading") if fn.get("defer_loading") is not None else t.get("defer_loading")
            if defer is not None:  # the tool's flag is copied onto its function; None is left out of the dump
                f2["defer_loading"] = defer
            out.append({"type": t.get("type", "function"), "function": f2, "defer_loading": t.get("defer_loading")})
            continue
        f2 = dict(fn)
        for k in ("description", "parameters"):
            f2.setdefault(k, None)
        tool = {**t, "function": f2}
        tool.setdefault("defer_loading", None)
        out.append(tool)
    return out


class TokenizerFilesError(ValueError):
    """The tokenizer directory is missing a file or holds one that cannot be read."""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class HfTokenizer:
    name = "hf"

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: dict[str, str]) -> None:
        self.tok = tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda v, indent=None, **_: json.dumps(v, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(chat_template) if chat_template else None
        self.special = special
        # the same ids as `encode` without offsets and alignments (tokenizers >= 0.21); a batch of one runs inline
        self._encode_ids = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
        self.added = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values()}, key=len, reverse=True)
        # does an added token start at a position: one match, however many added tokens the model has
        self._added_re = re.compile("|".join(re.escape(t) for t in self.added if t)) if any(self.added) else None
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._owned: dict[str, OrderedDict[bytes, int]] = {}  # namespace -> its keys (and their prefixes' lengths)
        self._suffix: str | None = None  # the generation prompt as the template appends it, once checked
        self._suffix_checks = 0  # namespace -> its keys, least recently used first
        # large bodies are tokenized on the offload pool's threads (gateway/offload.py): the LRU's reads and
        # reorders must not interleave
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.tool_layout = "client_order"  # how the engine dumps tools for its template (learn_tool_layout)

    @classmethod
    def from_dir(cls, path: str) -> HfTokenizer:
        d = Path(path)
        try:
            tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 (the Rust side raises a plain Exception for a bad file)
            raise TokenizerFilesError(f"{d / 'tokenizer.json'}: {e}") from None
        cfg: dict[str, Any] = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.exists():
            try:
                cfg = json.loads(cfg_path.read_text())
            except ValueError as e:
                raise TokenizerFilesError(f"{cfg_path}: {e}") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_path = d / "chat_template.jinja"
        if template is None and jinja_path.exists():
            template = jinja_path.read_text()
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(tok, template, {k: v for k, v in special.items() if v is not None})

    # -- rendering ---------------------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None, add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise TokenizerFilesError("the tokenizer has no chat_template")
        msgs = [{**m, "content": content_text(m.get("content"))} if isinstance(m.get("content"), list) else m
                for m in messages]
        try:
            return self.template.render(messages=msgs, tools=tools or None,
                                        add_generation_prompt=add_generation_prompt, **self.special)
        except jinja2.TemplateError as e:  # the template's own raise_exception too: a refusal the caller can name
            raise TemplateRefused(str(e)) from e

    def learn_tool_layout(self, engine_ids: list[int], body: dict[str, Any] = TOOLS_PROBE) -> str | None:
        """The layout in which `body`'s tools render to the engine's own ids for `body` (its /v1/tokenize), adopted
        for every later request; None (and the layout kept) when none does. The ids, not the engine's release, decide:
        a release that changes its request model is learned the same way."""
        messages = body.get("messages") or []
        for layout in (self.tool_layout, *(x for x in TOOL_LAYOUTS if x != self.tool_layout)):
            try:
                ids = self.encode_text(self.render(messages, engine_tools(body.get("tools"), layout)))
            except TemplateRefused:
                continue
            if ids.tolist() == list(engine_ids):
                self.tool_layout = layout
                return layout
        return None

    def encode_text(self, text: str) -> np.ndarray:
        return np.asarray(self._encode_ids([text], add_special_tokens=False)[0].ids, dtype=np.uint32)

    def encode_request(self, endpoint: str, body: dict[str, Any], namespace: str = "") -> np.ndarray:
        if endpoint != "chat/completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return np.asarray(self.tok.encode(prompt, add_special_tokens=True).ids, dtype=np.uint32)
            return token_ids_of(prompt)
        messages = body.get("messages") or []
        tools = engine_tools(body.get("tools"), self.tool_layout)
        text = self.render(messages, tools)
        ids, found = self._from_cache(text, namespace)
        # what the next turn will extend: this conversation without the generation prompt
        if len(messages) >= 1:
            self._remember(self._without_generation_prompt(text, messages, tools), text, ids, namespace, found)
        return ids

    def _without_generation_prompt(self, text: str, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
        """The rendering without the generation prompt. Most templates only append the prompt, so it is `text` less
        the suffix seen on the first CHECKED_RENDERS requests, which saves one render of the whole conversation a
        turn; checked against a real render for those requests, and rendered every time after any disagreement. A
        wrong guess could only cost cache misses: the ids kept are always those of the text they are keyed by."""
        if self._suffix_checks >= CHECKED_RENDERS and self._suffix and text.endswith(self._suffix):
            return text[: len(text) - len(self._suffix)]
        prefix = self.render(messages, tools, add_generation_prompt=False)
        if self._suffix_checks < CHECKED_RENDERS:
            suffix = text[len(prefix):] if text.startswith(prefix) else None
            if suffix and (self._suffix is None or self._suffix == suffix):
                self._suffix, self._suffix_checks = suffix, self._suffix_checks + 1
            else:
                self._suffix, self._suffix_checks = None, CHECKED_RENDERS  # disagreement: always render
        return prefix

    # -- the per-conversation prefix cache ---------------------------------------------------------------------
    def _from_cache(self, text: str, namespace: str) -> tuple[np.ndarray, _Found | None]:
        """The ids of `text` built on the longest prefix of it that this namespace has cached (None: encoded whole).
        The candidates are the lengths of the namespace's cached prefixes at which `text` has a special-token
        boundary; their keys come from one pass of the hash over `text`, so no render of the previous turn is needed
        to look it up (and a conversation that branched from another finds their common part)."""
        with self._lock:
            owned = self._owned.get(namespace)
            lengths = sorted({n for n in owned.values() if n <= len(text)}) if owned else []
        h = _keyer(namespace, "")
        at = 0
        best: tuple[int, bytes, np.ndarray, Any] | None = None
        for n in lengths:
            if not self._boundary(text, n):
                continue
            h.update(text[at:n].encode("utf-8", "surrogatepass"))
            at = n
            key = h.digest()  # (hashlib's digest leaves the state to go on from)
            with self._lock:
                cached = self._cache.get(key)
            if cached is not None:
                best = (n, key, cached, h.copy())
        if best is None:
            self.misses += 1
            return self.encode_text(text), None
        n, key, cached, keyer = best
        with self._lock:
            mine = self._owned.get(namespace)
            if key in self._cache and mine is not None and key in mine:
                self._cache.move_to_end(key)
                mine.move_to_end(key)
        self.hits += 1
        return np.concatenate([cached, self.encode_text(text[n:])]), _Found(n, keyer)

    def _boundary(self, text: str, at: int) -> bool:
        return at == len(text) or (self._added_re is not None and self._added_re.match(text, at) is not None)

    def _remember(self, prefix: str, text: str, ids: np.ndarray, namespace: str, found: _Found | None) -> None:
        if not text.startswith(prefix) or not self._boundary(text, len(prefix)):
            return
        n = len(ids) - len(self.encode_text(text[len(prefix):]))  # the rest is the generation prompt: short
        if found is not None and found.chars <= len(prefix):  # both prefixes of `text`: hash only the difference
            h = found.keyer.copy()
            h.update(prefix[found.chars:].encode("utf-8", "surrogatepass"))
            key = h.digest()
        else:
            key = _key(namespace, prefix)
        with self._lock:
            self._cache[key] = ids[:n]
            self._cache.move_to_end(key)
            owned = self._owned.setdefault(namespace, OrderedDict())
            owned[key] = len(prefix)
            owned.move_to_end(key)
            if len(owned) > NAMESPACE_ENTRIES:  # this tenant's own least recently used
                old, _ = owned.popitem(last=False)
                self._cache.pop(old, None)
            while len(self._cache) > CACHE_ENTRIES:
                old, _ = self._cache.popitem(last=False)
                for keys in self._owned.values():
                    keys.pop(old, None)
            if not owned:
                self._owned.pop(namespace, None)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self._owned.clear()

    @property
    def entries(self) -> dict[str, int]:
        """Cached prefixes per namespace."""
        with self._lock:
            return {ns: len(keys) for ns, keys in self._owned.items() if keys}


def _key(namespace: str, text: str) -> bytes:
    return _keyer(namespace, text).digest()


def _keyer(namespace: str, text: str) -> hashlib.blake2b:
    """The cache key's hash state after `text`: more text can be fed to it (UTF-8 encodes piece by piece, so the key
    of a longer text is the same whether hashed at once or continued)."""
    return hashlib.blake2b(namespace.encode("utf-8", "surrogatepass") + b"\0" + text.encode("utf-8", "surrogatepass"),
                           digest_size=16)


@dataclass(frozen=True)
class _Found:
    """The cached prefix a request's ids were built on: its length in characters and its key's hash state."""

    chars: int
    keyer: hashlib.blake2b


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    content = v.get("content") if isinstance(v, dict) else None
    return content if isinstance(content, str) else None
