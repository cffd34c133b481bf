"""Request tokenizers for precise prefix routing: the token ids the engine will see for a request.

Two implementations of `RequestTokenizer`:
- `SimRuleTokenizer` (sim.py, the default): the simulator's token rule (gateway/tokenizer.py), no files;
- `HfTokenizer` (real.py): the model's `tokenizer.json` with its chat template rendered by jinja2 as SGLang renders
  it, loaded from a local directory (`routing.kv_events.tokenizer.path`), checked against `/v1/tokenize`.
The same tokenizer counts prompts for `/v1/messages/count_tokens` and `/v1/responses/input_tokens` (`prompt_tokens`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from gateway.config import TokenizerSettings
from gateway.errors import InvalidRequest
from gateway.tokenizer import count_tokens, render_chat


class RequestTokenizer(Protocol):
    name: str

    def encode_request(self, endpoint: str, body: dict[str, Any], namespace: str = "") -> np.ndarray:
        """uint32 token ids of the prompt the engine will build (chat: templated; completions: the first prompt).
        `namespace`: the tenant's cache namespace, which keeps any ids a tokenizer caches apart per tenant."""


class TemplateRefused(ValueError):
    """The model's chat template would not render the messages (its `raise_exception`, or a render error): the
    engine would refuse the request too."""


def prompt_tokens(tokenizer: RequestTokenizer | None, chat: dict[str, Any]) -> int:
    """Prompt tokens of a chat body, for the token-count endpoints: with the tokenizer the gateway loaded for
    precise routing (the real one renders the model's chat template, as the engine does) where there is one, else
    the simulator's 4-characters rule (gateway/tokenizer.py), which the sim tokenizer agrees with. A template
    that refuses the messages is a 400, as the engine's would be."""
    if tokenizer is None:
        return count_tokens(render_chat(chat["messages"], chat.get("tools")))
    try:
        return len(tokenizer.encode_request("chat/completions", chat))
    except TemplateRefused as e:
        raise InvalidRequest(f"The model's chat template refused these messages: {e}", param="messages") from e


def build_tokenizer(settings: TokenizerSettings) -> RequestTokenizer:
    if settings.kind == "hf":
        # optional dependencies (the `tokenize` extra)
        from gateway.tokenizers.real import HfTokenizer

        assert settings.path is not None
        return HfTokenizer.from_dir(settings.path)
    from gateway.tokenizers.sim import SimRuleTokenizer

    return SimRuleTokenizer()
