"""A tenant's policy: who it is (key hashes), what it may use, and how its requests are routed, limited and billed.

One YAML file per tenant under `policies/tenants/`, merged over `policies/defaults.yaml` (or inline under
`tenants:` in the gateway config). Unknown fields are rejected; `policies/schema.json` is generated from these
models (`gateway policies schema`) for editors.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.flow.settings import FlowPolicy
from gateway.typed import Strict, sha256_hex_list


# Upper bounds far above any real tenant: they catch a typo (an extra six zeros) in a file or a live change before
# it silently lifts a limit, without ever binding a real one.
class RateLimits(Strict):
    requests_per_minute: int | None = Field(default=None, ge=1, le=1_000_000_000)
    tokens_per_minute: int | None = Field(default=None, ge=1, le=1_000_000_000_000, description="prompt + completion tokens")


class Budget(Strict):
    """Spend caps in USD (UTC day / calendar month), from real usage priced per pool (cached tokens as cached)."""

    usd_per_day: float | None = Field(default=None, gt=0, le=1e9)
    usd_per_month: float | None = Field(default=None, gt=0, le=1e9)


class CachePolicy(Strict):
    """Prefix-cache isolation. By default a tenant's prompts never share KV-cache entries (nor prefix-index entries)
    with another tenant's: a per-tenant `cache_salt` is forwarded to SGLang and mixed into the prefix hash.
    Tenants naming the same `sharing_group` share one namespace; `isolated: false` without a group joins the
    fleet-wide shared namespace."""

    isolated: bool = True
    sharing_group: str | None = Field(default=None, min_length=1)

    def salt(self, tenant: str) -> str:
        if self.sharing_group:
            return f"group:{self.sharing_group}"
        return f"tenant:{tenant}" if self.isolated else "shared"


class ModelAlias(Strict):
    """A client-facing model name (or glob) served by one of the tenant's models: agents ask for their vendor's names
    (`claude-sonnet-4-5`, `gpt-5-codex`) and cannot be told otherwise. The response reports the name asked for."""

    match: str = Field(min_length=1, max_length=200,
                       description="an exact model name, or a glob (`*`, `?`, `[...]`) such as `claude-*`")
    model: str = Field(min_length=1, description="the served model (one of the tenant's `models`)")
    max_output_tokens: int | None = Field(default=None, ge=1,
                                          description="the output cap sent when a request through this alias names none")

    @property
    def is_glob(self) -> bool:
        return any(c in self.match for c in "*?[")

    def matches(self, name: str) -> bool:
        return name == self.match or (self.is_glob and fnmatch.fnmatchcase(name, self.match))


def alias_for(name: str, models: Sequence[str], aliases: Sequence[ModelAlias]) -> ModelAlias | None:
    """The alias answering `name` for a tenant serving `models` with `aliases`: none for a model it serves itself;
    else the first exact match, then the first glob that matches. (A function of plain data: a large body's front
    half resolves names with it in a worker process, pipeline/front.py.)"""
    if name in models:
        return None
    exact = next((a for a in aliases if a.match == name), None)
    return exact or next((a for a in aliases if a.is_glob and a.matches(name)), None)


def served_model(name: object, models: Sequence[str], aliases: Sequence[ModelAlias]) -> str | None:
    """The model `name` reaches for a tenant serving `models` with `aliases` (an alias's served model), or None (not
    one of its names)."""
    if not isinstance(name, str):
        return None
    alias = alias_for(name, models, aliases)
    return alias.model if alias is not None else (name if name in models else None)


def cache_namespace(cache_salt: str, client_salt: object = None) -> str:
    """A tenant's cache namespace (`cache_salt`: its own) subdivided by a client's salt, if it sent one."""
    return f"{cache_salt}:{client_salt}" if isinstance(client_salt, str) and client_salt else cache_salt


class _PolicyFields(Strict):
    """Everything a tenant's file or the defaults file may set."""

    models: list[str] | None = Field(default=None, min_length=1, description="client-facing model names it may use")
    pools: list[str] | None = Field(default=None, min_length=1,
                                    description="pools it may be served by; unset = every pool of its models")
    fallback_pools: list[str] = Field(default_factory=list, description="tried after its models' own pools")
    objective: Literal["cost", "latency"] | None = None
    ttft_sla_ms: float | None = Field(default=None, gt=0, le=600_000,
                                      description="TTFT target (p95); default routing.ttft_sla_ms; at most the SDKs' 600 s timeout")
    on_sla_miss: Literal["spill", "shed"] | None = Field(default=None, description="no replica meets the SLA")
    max_price_per_mtok: float | None = Field(default=None, ge=0,
                                             description="per-token pools priced above this (input or output) are skipped")
    priority: Literal["high", "normal", "low"] = "normal"
    max_concurrent: int | None = Field(default=None, ge=1, le=1_000_000, description="in-flight requests; over it -> 429")
    max_concurrent_scope: Literal["instance", "fleet"] = Field(
        default="instance", description="instance: max_concurrent per gateway instance; fleet: across every instance "
        "(Redis; per instance while Redis is away)")
    rate_limits: RateLimits = RateLimits()
    budget: Budget = Budget()
    cache: CachePolicy = CachePolicy()
    model_aliases: list[ModelAlias] = Field(
        default_factory=list, description="names (exact or glob) answered by a served model; first match wins, exact "
        "names before globs; a name the tenant serves itself is never aliased")
    hosted_tools: Literal["drop", "refuse"] = Field(
        default="drop", description="tools only the provider's servers run (web_search, file_search, code_interpreter, "
        "computer use, MCP...): drop them with an `x-gateway-dropped` header (the turn is served), or refuse the request")
    flow: FlowPolicy = Field(default_factory=FlowPolicy, description="band, weight and queue under flow control "
                             "(docs/flow-control.md)")
    client_metadata: Literal["strip", "forward"] = Field(
        default="strip", description="client-identifying fields (Codex's client_metadata, Anthropic metadata.user_id, "
        "OpenAI user / safety_identifier) removed before upstream, or forwarded as sent")


class PolicyDefaults(_PolicyFields):
    """`policies/defaults.yaml`: applied under every tenant's own file (a tenant's value wins, field by field)."""


class TenantFile(_PolicyFields):
    """`policies/tenants/<name>.yaml` as written (the JSON Schema editors use): the name comes from the file, and
    fields left out come from the defaults."""

    name: str | None = Field(default=None, description="optional; must equal the file name")
    api_key_hashes: list[str] = Field(min_length=1, description="sha256 hex of each key: `printf %s KEY | sha256sum`")


class Tenant(_PolicyFields):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    api_key_hashes: list[str] = Field(min_length=1, description="sha256 hex of each key; never the key itself")
    models: list[str] = Field(min_length=1)

    @field_validator("api_key_hashes")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        return sha256_hex_list(v)

    @model_validator(mode="after")
    def _aliases_serve_own_models(self) -> Tenant:
        for i, a in enumerate(self.model_aliases):
            if a.model not in self.models:
                raise ValueError(f"model_aliases[{i}].model: {a.model!r} is not one of this tenant's models "
                                 f"{self.models}")
        return self

    @property
    def cache_salt(self) -> str:
        return self.cache.salt(self.name)

    def cache_namespace(self, client_salt: object = None) -> str:
        """The namespace sent to SGLang as `cache_salt` and mixed into the prefix hash — one rule for both, so the
        index predicts what the engine will reuse. A client's own salt only subdivides its tenant's namespace."""
        return cache_namespace(self.cache_salt, client_salt)

    def alias_for(self, name: str) -> ModelAlias | None:
        """The alias answering `name` (`alias_for`)."""
        return alias_for(name, self.models, self.model_aliases)

    def served(self, name: object) -> str | None:
        """The model `name` reaches for this tenant (`served_model`)."""
        return served_model(name, self.models, self.model_aliases)
