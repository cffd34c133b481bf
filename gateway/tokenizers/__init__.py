"""Request tokenizers for precise prefix routing: the token ids the engine will see for a request.

Two implementations of `RequestTokenizer`:
- `SimRuleTokenizer` (sim.py, the default): the simulator's token rule (gateway/tokenizer.py), no files;
- `HfTokenizer` (real.py): the model's `tokenizer.json` with its chat template rendered by jinja2 as SGLang renders
  it, loaded from a local directory (`routing.kv_events.tokenizer.path`), checked against `/v1/tokenize`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from gateway.config import TokenizerSettings


class RequestTokenizer(Protocol):
    name: str

    def encode_request(self, endpoint: str, body: dict[str, Any]) -> np.ndarray:
        """uint32 token ids of the prompt the engine will build (chat: templated; completions: the first prompt)."""


def build_tokenizer(settings: TokenizerSettings) -> RequestTokenizer:
    if settings.kind == "hf":
        # optional dependencies (the `tokenize` extra)
        from gateway.tokenizers.real import HfTokenizer

        assert settings.path is not None
        return HfTokenizer.from_dir(settings.path)
    from gateway.tokenizers.sim import SimRuleTokenizer

    return SimRuleTokenizer()
