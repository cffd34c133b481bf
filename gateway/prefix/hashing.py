"""Prefix hashing (pure): the same request yields the same chain of chunk hashes in every process and every
gateway instance, with no tokenizer to drift from the engine's.

Canonical form: the request rendered by the shared template (`gateway.tokenizer.render_chat`: tools first,
then messages, so it extends turn by turn like the engine's own prompt) or the completions prompt text. It is cut
into chunks of `chunk_tokens` tokens (4 characters per token, the shared token rule) and hashed as a chain:
    H_0 = blake2b(seed_material), H_i = blake2b(H_{i-1} || chunk_i), 8-byte digests
where the seed material is the model name and the cache namespace (the tenant's cache salt), so identical text
from two isolated tenants never shares a key. Only full chunks are hashed: the engine caches whole pages, and a
trailing partial chunk cannot be reused by a longer prompt anyway. Token-id prompts are chunked by ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from gateway.tokenizer import CHARS_PER_TOKEN, prompt_text, render_chat

DEFAULT_CHUNK_TOKENS = 256
# Cold placement keys on the chunk hash this deep (~2k tokens at 256-token chunks): past a prompt-wide shared
# system preamble, inside the session's own prefix.
GROUP_DEPTH = 8
MAX_CHUNKS = 1024  # bounds work and index size for huge prompts (256k tokens at the default chunk)


def canonical_text(endpoint: str, body: dict[str, Any]) -> str | None:
    """The text the engine will see (None for token-id prompts)."""
    if endpoint == "chat/completions":
        return render_chat(body.get("messages") or [], body.get("tools"))
    return prompt_text(body.get("prompt"))


def _seed(model: str, namespace: str) -> bytes:
    return hashlib.blake2b(f"{model}\x00{namespace}".encode(), digest_size=8).digest()


def chain(seed: bytes, chunks: Sequence[bytes]) -> list[int]:
    out = []
    h = seed
    for c in chunks:
        h = hashlib.blake2b(h + c, digest_size=8).digest()
        out.append(int.from_bytes(h, "big", signed=True))
    return out


def prefix_hashes(endpoint: str, body: dict[str, Any], model: str, namespace: str = "",
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS, max_chunks: int = MAX_CHUNKS) -> list[int]:
    seed = _seed(model, namespace)
    text = canonical_text(endpoint, body)
    if text is not None:
        size = chunk_tokens * CHARS_PER_TOKEN
        n = min(len(text) // size, max_chunks)
        raw = text.encode("utf-8", "surrogatepass")
        if len(raw) == len(text):  # ASCII: byte offsets are character offsets, slice the bytes
            return chain(seed, [raw[i * size : (i + 1) * size] for i in range(n)])
        return chain(seed, [text[i * size : (i + 1) * size].encode("utf-8", "surrogatepass") for i in range(n)])
    ids = _flat_ids(body.get("prompt"))
    n = min(len(ids) // chunk_tokens, max_chunks)
    return chain(seed, [",".join(map(str, ids[i * chunk_tokens : (i + 1) * chunk_tokens])).encode() for i in range(n)])


def _flat_ids(prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return [t for p in prompt for t in p]
    return list(prompt) if isinstance(prompt, list) else []


def group_key(hashes: Sequence[int], fallback: int) -> int:
    """The key that places a cold prefix; prompts shorter than a chunk have no prefix to keep together."""
    return hashes[min(len(hashes) - 1, GROUP_DEPTH)] if hashes else fallback
