"""The deterministic, tokenizer-free token rule shared by the simulator and the gateway.

Rule (documented in docs/simulator.md):
- A chat request is rendered with a fixed GLM-style template (`render_chat`): ``[gMASK]<sop>``, then the tools
  (canonical JSON) as a system block, then each message as ``<|role|>\\n`` + its text, then ``<|assistant|>\\n``.
  A longer conversation's rendering extends the shorter one's, so multi-turn prompts share a prefix.
- The rendered text is cut into 4-character chunks from its start; each chunk is one token, whose id is
  ``crc32(chunk) % 150_000``. So ``count_tokens(text) == ceil(len(text) / 4)`` and the ids of a prefix
  never depend on what follows it (prefix-stable).
- Completions take a string (same rule, no template), a list of strings (concatenated), or token ids as-is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

CHARS_PER_TOKEN = 4
VOCAB_SIZE = 150_000


def count_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


_MIX = np.array([31**3, 31**2, 31, 1], dtype=np.uint64)


def token_array(text: str) -> np.ndarray:
    """Token ids as a uint32 array (vectorised: a 20k-token prompt takes well under a millisecond)."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    pad = (-len(cps)) % CHARS_PER_TOKEN
    if pad:
        cps = np.concatenate([cps, np.zeros(pad, dtype=np.uint32)])
    mixed = cps.astype(np.uint64).reshape(-1, CHARS_PER_TOKEN) @ _MIX
    return (mixed % VOCAB_SIZE).astype(np.uint32)


def token_ids(text: str) -> list[int]:
    ids: list[int] = token_array(text).tolist()
    return ids


def content_text(content: Any) -> str:
    """Text of a message `content`: a string, or a list of parts of which only text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                if part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str):
                    out.append(part["text"])
                elif part.get("type") in ("image_url", "input_image", "input_audio"):
                    out.append("<|image|>")  # media occupy a placeholder, not their base64 bytes
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    return str(content)


def _canonical(obj: Any) -> str:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS).decode()


GENERATION_PROMPT = "<|assistant|>\n"


def render_head(tools: list[Any] | None) -> str:
    """What precedes the messages in `render_chat`."""
    return "[gMASK]<sop>" + ("<|system|>\n# Tools\n" + _canonical(tools) if tools else "")


def _message_parts(msg: dict[str, Any]) -> tuple[str, str, str]:
    """A message's rendering in its three parts: the role line, the content's text, the tool calls (or "")."""
    role = msg.get("role", "user")
    calls = _canonical(msg["tool_calls"]) if msg.get("tool_calls") else ""
    return f"<|{'observation' if role == 'tool' else role}|>\n", content_text(msg.get("content")), calls


def render_message(msg: dict[str, Any]) -> str:
    """One message's part of `render_chat`: the rendering is the head, each message's part, the generation prompt,
    concatenated, so a message's contribution does not depend on the others (what `truncation: auto` relies on)."""
    return "".join(_message_parts(msg))


def render_chat(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
    """The head, each message's `render_message`, the generation prompt: joined once from the messages' parts, so
    each message's text is copied once (an 8 MB history: half the time of joining per-message concatenations)."""
    out = [render_head(tools)]
    for msg in messages:
        out += _message_parts(msg)
    out.append(GENERATION_PROMPT)
    return "".join(out)


def prompt_text(prompt: Any) -> str | None:
    """The text of a completions `prompt` (None when it is token ids)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "".join(prompt)
    return None
