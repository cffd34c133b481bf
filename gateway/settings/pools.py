"""Settings of what serves the models: pools of replicas or hosted endpoints, their pricing and timing, and which
pools serve each client-facing model (`models:` and `pools:` of the gateway config)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from gateway.pd_config import Disaggregation
from gateway.typed import HttpUrl
from gateway.typed import Strict as _Strict


class PerTokenPricing(_Strict):
    type: Literal["per_token"] = "per_token"
    input_per_mtok: float = Field(ge=0)
    cached_input_per_mtok: float | None = Field(default=None, ge=0)  # None: same as input
    output_per_mtok: float = Field(ge=0)


class GpuHourPricing(_Strict):
    """Self-hosted: a replica costs gpus x usd_per_gpu_hour whether busy or not; a request's marginal share is
    the replica time it occupies at the pool's capacity (prefill at prefill_tokens_per_s, decode at the full-batch
    decode_tokens_per_s)."""

    type: Literal["gpu_hour"] = "gpu_hour"
    gpus_per_replica: int = Field(ge=1)
    usd_per_gpu_hour: float = Field(ge=0)
    prefill_tokens_per_s: float = Field(gt=0)
    decode_tokens_per_s: float = Field(gt=0)


Pricing = Annotated[PerTokenPricing | GpuHourPricing, Field(discriminator="type")]


class Replica(_Strict):
    name: str = Field(min_length=1)
    url: HttpUrl
    dp_size: int | None = Field(default=None, ge=1, le=64, description="data-parallel ranks of this server; unset: "
                                "discovered from /server_info (dp_size, or attn_dp_size with DP attention)")


class PoolTiming(_Strict):
    """What the TTFT predictor assumes about one replica of the pool; corrected online from observed TTFTs.
    Defaults: one MI355X TP4 rank serving GLM-5.2 (docs/simulator.md)."""

    base_s: float = Field(default=0.14, ge=0, description="TTFT floor: API overhead + one prefill forward")
    prefill_tokens_per_s: float = Field(default=16_700, gt=0)
    max_running: int = Field(default=48, ge=1)
    decode_step_s: float = Field(default=0.0467, gt=0, description="decode step time at a full batch")
    tokens_per_step: float = Field(default=3.5, gt=0)
    expected_output_tokens: int = Field(default=1000, ge=1)
    kv_capacity_tokens: int = Field(default=2_400_000, ge=1, description="overridden by /server_info when reachable")


class _PoolBase(_Strict):
    name: str = Field(min_length=1)
    model: str = Field(min_length=1, description="model name sent upstream")
    pricing: Pricing | None = None
    weight: float = Field(default=1.0, ge=0)
    timing: PoolTiming = PoolTiming()
    max_n: int | None = Field(default=None, ge=1, le=128, description="largest `n` a request may ask of this pool; "
                              "default 8 for sglang (each sequence holds KV cache), 128 (OpenAI's bound) otherwise")
    max_sequences: int | None = Field(default=None, ge=1, le=2048, description="largest prompts x n a completions "
                                      "request may ask of this pool (a prompt list is a batch); default 64 for sglang, "
                                      "2048 otherwise")
    context_tokens: int | None = Field(default=None, ge=1, description="the model's context length here: larger "
                                       "max_tokens are refused at the edge "
                                       "(unset: the servers' /server_info context, when reported)")
    vocab_size: int | None = Field(default=None, ge=1, description="the model's vocabulary size here: a completions "
                                   "prompt of token ids holding an id at or past it is refused at the edge (400) "
                                   "(unset: not checked; no engine reports it, and real SGLang's scheduler dies on "
                                   "such an id)")
    responses: Literal["bridge", "native"] = Field(default="bridge", description="how /v1/responses is served: "
                                                   "bridge = translated onto this pool's chat/completions; native = "
                                                   "forwarded to its own /v1/responses (docs/agent-apis.md)")


class SGLangPool(_PoolBase):
    kind: Literal["sglang"] = "sglang"
    replicas: list[Replica] = Field(min_length=1)
    api_key_env: str | None = None  # SGLang --api-key, if the servers use one
    health_path: str = Field(default="/ping", description="liveness probe: /ping is a flag check on every SGLang "
                             "release; /health runs a generation and is slow behind a long prefill (busy, not dead)")
    dp_pinning: Literal["auto", "body", "header", "off"] = Field(
        default="auto", description="a server with N DP ranks becomes N targets, each pinned to its rank: body field "
        "(routed_dp_rank from 0.5.13, data_parallel_rank before), header X-Data-Parallel-Rank (0.5.13+); auto = body; "
        "off = one target per server (SGLang spreads requests over its ranks itself)")
    send_priority: Literal["auto", "always", "never"] = Field(
        default="auto", description="auto: send an explicit priority (priority_values) to servers whose /server_info "
        "says enable_priority_scheduling; never to others, so --abort-on-priority-when-disabled cannot refuse them")
    disaggregation: Disaggregation | None = Field(default=None, description="a PD deployment: `replicas` are the "
                                                  "decode servers, these the prefill servers (docs/pd.md)")
    priority_values: dict[Literal["high", "normal", "low"], int] = Field(
        default_factory=lambda: {"high": 10, "normal": 0, "low": -10},  # type: ignore[arg-type]
        description="the SGLang priority sent per tenant class; `normal` is explicit so the server's default "
        "(lowest, or --default-priority-value) never applies")

    @field_validator("priority_values")
    @classmethod
    def _all_classes(cls, v: dict[str, int]) -> dict[str, int]:
        return {"high": 10, "normal": 0, "low": -10, **v}  # a partial mapping keeps the defaults for the rest


class VLLMPool(_PoolBase):
    """Self-hosted vLLM servers (0.32+; docs/engines.md), one entry per server. vLLM has no /server_info or
    /v1/loads: its load is read from /metrics (`vllm:num_requests_running` + `waiting`), its release from /version,
    its KV-event publishers from /kv_event_sources. Start it with `--enable-prefix-caching`,
    `--enable-prompt-tokens-details` (usage then carries cached_tokens) and, for precise routing, `--kv-events-config`."""

    kind: Literal["vllm"] = "vllm"
    replicas: list[Replica] = Field(min_length=1)
    api_key_env: str | None = None  # vLLM --api-key, if the servers use one
    health_path: str = Field(default="/health", description="liveness probe (vLLM answers /health and /ping)")
    send_priority: Literal["never", "always"] = Field(
        default="never", description="always: send `priority` (servers started with --scheduling-policy priority; "
        "vLLM refuses it otherwise); the class values are negated, since vLLM serves lower values first")
    priority_values: dict[Literal["high", "normal", "low"], int] = Field(
        default_factory=lambda: {"high": 10, "normal": 0, "low": -10},  # type: ignore[arg-type]
        description="the priority per tenant class, as for sglang pools (higher = sooner; sent negated)")

    @field_validator("priority_values")
    @classmethod
    def _all_classes(cls, v: dict[str, int]) -> dict[str, int]:
        return {"high": 10, "normal": 0, "low": -10, **v}

    @field_validator("replicas")
    @classmethod
    def _no_dp(cls, v: list[Replica]) -> list[Replica]:
        for r in v:
            if r.dp_size not in (None, 1):
                raise ValueError(f"{r.name}: dp_size: vLLM ranks cannot be pinned per request; list one server each")
        return v


class OpenAIPool(_PoolBase):
    """Any OpenAI-compatible hosted endpoint (e.g. a provider serving GLM-5.2 on B200)."""

    kind: Literal["openai"] = "openai"
    base_url: HttpUrl
    api_key_env: str | None = None
    health_path: str = "/models"


class LiteLLMPool(_PoolBase):
    """Other providers through litellm (imported only by this pool kind's adapter)."""

    kind: Literal["litellm"] = "litellm"
    api_key_env: str | None = None
    api_base: str | None = None

    @field_validator("responses")
    @classmethod
    def _bridged(cls, v: str) -> str:
        if v == "native":
            raise ValueError("'native' needs an HTTP /v1/responses endpoint; litellm pools are always bridged")
        return v


Pool = Annotated[SGLangPool | VLLMPool | OpenAIPool | LiteLLMPool, Field(discriminator="kind")]


class ModelRoute(_Strict):
    name: str = Field(min_length=1, description="client-facing model name")
    pools: list[str] = Field(min_length=1, description="pools serving it, in fallback order")
    vision: bool = Field(default=True, description="whether the model takes image input. false (a text-only model "
                         "such as GLM-5.2): an image on the OpenAI APIs is refused with 400 before any replica sees "
                         "it, as OpenAI and the engines refuse one for a text-only model; on the Anthropic Messages "
                         "API, whose models all take images, it is left out and named in x-gateway-dropped")
