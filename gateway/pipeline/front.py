"""The front half of a request: the CPU steps between its parsed body and what the router needs — validation, the
prompt rendered and counted, where its first image is, its prefix hashes — as one pure function of the body and
plain data (`prepare`), so the same function runs inline for a small body and, for a large one, in a worker
process with the parse and the API's translation before it (gateway/offload.py `CpuPool.front`). What it returns,
`Front`, is the validate stage's result (or its error, raised by the pipeline at that stage, as inline) and the
decide stage's hashes; the event loop then does O(1) work per body where it did O(body) (pipeline.py).

What needs live state is passed in as plain data: the tenant's names and cache salt (`Names`), the routing chunk
size (`Hashing`, given for a large body only: a small one is hashed by the decide stage, after admission). The hashes are used only if the request reached the decide stage with what they were computed
from — the same endpoint, served model, namespace and chunk size, and the very prompt objects (`Front.hasher`);
otherwise they are computed there as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError
from gateway.pipeline.json_body import bulk_lists
from gateway.pipeline.validation import ParsedRequest, first_image, validate
from gateway.policy_schema import ModelAlias, Tenant, cache_namespace, served_model
from gateway.prefix.hashing import prefix_hashes

MODEL_CHARS = 256  # a longer `model` names nothing a tenant serves: only its head is kept, for the log line
PROMPT_FIELDS = ("messages", "tools", "prompt")  # what the canonical text is rendered from (prefix/hashing.py)


@dataclass(frozen=True, slots=True)
class Names:
    """A tenant's model names, aliases and cache salt: what the front half needs of its policy, as plain data."""

    cache_salt: str
    models: tuple[str, ...]
    aliases: tuple[ModelAlias, ...]

    @classmethod
    def of(cls, tenant: Tenant) -> Names:
        return cls(tenant.cache_salt, tuple(tenant.models), tuple(tenant.model_aliases))

    def served(self, model: object) -> str | None:
        """The model a name reaches for this tenant (an alias's served model), or None (not one of its names)."""
        return served_model(model, self.models, self.aliases)


@dataclass(frozen=True, slots=True)
class Hashing:
    """How the decide stage hashes a prompt (routing.mode approximate, a policy that uses prefixes), as plain data."""

    names: Names
    chunk_tokens: int


@dataclass(slots=True)
class Hashed:
    """Prefix hashes and what they were computed from."""

    endpoint: str
    model: str
    namespace: str
    chunk_tokens: int
    hashes: list[int]


@dataclass(slots=True)
class Front:
    """A body's validate stage worked out ahead: `parsed` or the `error` the stage raises; what the pipeline's record
    of a refusal reads first (`model`, `stream`); where its first image part is; and its prefix hashes."""

    model: str | None
    stream: bool
    parsed: ParsedRequest | None = None
    error: GatewayError | None = None
    image_at: str | None = None
    hashed: Hashed | None = None

    def validated(self) -> ParsedRequest:
        """The validate stage's result, or its error raised (at that stage, as inline)."""
        if self.error is not None:
            raise self.error
        assert self.parsed is not None
        return self.parsed

    def bulk_lists(self) -> list[list[Any]]:
        return bulk_lists(self.parsed.body) if self.parsed is not None else []

    def hasher(self, fallback: Callable[..., list[int]]) -> Callable[..., list[int]]:
        """`fallback` (prefix_hashes), answered from the hashes computed ahead when asked about what they were
        computed from (alias defaults add fields to the body, never to its prompt)."""
        hashed, parsed = self.hashed, self.parsed
        if hashed is None or parsed is None:
            return fallback

        def hasher(endpoint: str, body: dict[str, Any], model: str, namespace: str = "", chunk_tokens: int = 0,
                   *rest: Any) -> list[int]:
            if not rest and self.covers(endpoint, body, model, namespace, chunk_tokens):
                return hashed.hashes
            return fallback(endpoint, body, model, namespace, chunk_tokens, *rest)

        return hasher

    def covers(self, endpoint: str, body: dict[str, Any], model: str, namespace: str, chunk_tokens: int) -> bool:
        """Whether the hashes computed ahead are those of this prompt: the same endpoint, served model, namespace
        and chunk size, and the very prompt objects the front half rendered."""
        hashed, parsed = self.hashed, self.parsed
        return hashed is not None and parsed is not None and \
            (endpoint, model, namespace, chunk_tokens) == \
            (hashed.endpoint, hashed.model, hashed.namespace, hashed.chunk_tokens) and \
            all(body.get(k) is parsed.body.get(k) for k in PROMPT_FIELDS)


def bounded_model(model: Any) -> str | None:
    """The body's `model` as a refusal's log line names it: its head, or None when it is not a string."""
    return model[:MODEL_CHARS] if isinstance(model, str) else None


def prepare(body: dict[str, Any], endpoint: str, hashing: Hashing | None) -> Front:
    """The front half of a parsed (or translated) body; pure: inline, on a thread or in a worker process alike."""
    model = body.get("model")
    front = Front(model if isinstance(model, str) else None, body.get("stream") is True)
    try:
        front.parsed = validate(body, endpoint)
    except GatewayError as e:
        front.error = e
        return front
    front.image_at = first_image(body)
    served = hashing.names.served(front.parsed.model) if hashing is not None else None
    if hashing is not None and served is not None:
        ns = cache_namespace(hashing.names.cache_salt, body.get("cache_salt"))
        front.hashed = Hashed(endpoint, served, ns, hashing.chunk_tokens,
                              prefix_hashes(endpoint, body, served, ns, hashing.chunk_tokens))
    return front

