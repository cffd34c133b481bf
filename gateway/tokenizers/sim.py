"""The simulator's token rule as a request tokenizer: the same ids the simulator's radix cache is keyed by."""

from __future__ import annotations

from typing import Any

import numpy as np

from gateway.tokenizer import prompt_text, render_chat, token_array


class SimRuleTokenizer:
    name = "sim"

    def encode_request(self, endpoint: str, body: dict[str, Any], namespace: str = "") -> np.ndarray:
        if endpoint == "chat/completions":
            return token_array(render_chat(body.get("messages") or [], body.get("tools")))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch: each prompt is its own sequence in the engine; route on the first
        text = prompt_text(prompt)
        if text is not None:
            return token_array(text)
        return token_ids_of(prompt)


def token_ids_of(prompt: Any) -> np.ndarray:
    """A token-id prompt (or the first of a batch of them) as-is."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < 2**32 for t in prompt):
        return np.asarray(prompt, dtype=np.uint32)
    return np.zeros(0, dtype=np.uint32)
