"""The Wafer agentic workload: 20k-token prompts (12k shared per session group + 8k new) and 1k-token outputs.

Each request is a chat with a system message holding its group's shared prefix and a user message of fresh
text. With the simulator's tokenizer rule (4 characters per token) the rendered prompt is 20,000 tokens of which
the first ~12,000 are identical within a group, so at most 60% of prompt tokens can come from cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ,.", dtype=np.uint8)
TEMPLATE_HEAD = len("[gMASK]<sop>") + len("<|system|>\n")
TEMPLATE_MID = len("<|user|>\n")
TEMPLATE_TAIL = len("<|assistant|>\n")


def random_text(rng: np.random.Generator, n_chars: int) -> str:
    return ALPHABET[rng.integers(0, len(ALPHABET), n_chars)].tobytes().decode()


@dataclass
class WaferWorkload:
    groups: int = 16
    prefix_tokens: int = 12_000
    prompt_tokens: int = 20_000
    output_tokens: int = 1_000
    seed: int = 0
    model: str = "glm-5.2"
    _prefixes: list[str] = field(default_factory=list)
    _rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        prefix_chars = self.prefix_tokens * 4 - TEMPLATE_HEAD
        self._prefixes = [f"[group {g:04d}] " + random_text(self._rng, prefix_chars - 13) for g in range(self.groups)]
        self._unique_chars = self.prompt_tokens * 4 - TEMPLATE_HEAD - prefix_chars - TEMPLATE_MID - TEMPLATE_TAIL

    def group_of(self, i: int) -> int:
        return int(self._rng.integers(0, self.groups))

    def messages(self, group: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": self._prefixes[group]},
                {"role": "user", "content": random_text(self._rng, self._unique_chars)}]

    def body(self, group: int, max_tokens: int | None = None) -> dict[str, Any]:
        return {"model": self.model, "messages": self.messages(group), "max_tokens": max_tokens or self.output_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
