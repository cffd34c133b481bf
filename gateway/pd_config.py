"""The `disaggregation:` section of an SGLang pool: its prefill servers, the KV link, and when to disaggregate.

A pool with this section is a prefill/decode-disaggregated SGLang deployment (docs/pd.md). Its `replicas` are the
decode servers (`--disaggregation-mode decode`): they are the routing targets, stream the answer and carry the
pool's load, breakers and pricing. The prefill servers (`--disaggregation-mode prefill`) listed here receive the
second leg of every disaggregated request, with the bootstrap fields SGLang expects.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from gateway.typed import HttpUrl, Strict, unique_names


class PrefillServer(Strict):
    name: str = Field(min_length=1)
    url: HttpUrl
    bootstrap_port: int = Field(default=8998, gt=0, lt=65536, description="the server's "
                                "--disaggregation-bootstrap-port (SGLang's default 8998)")
    dp_size: int = Field(default=1, ge=1, le=64, description="its DP ranks: a room lands on rank room % dp_size, "
                         "so the gateway chooses the rank by choosing the room")


class KvLink(Strict):
    """The KV transfer the gateway predicts with (the defaults: GLM-5.2 fp8 KV over MI355X RDMA; docs/pd.md)."""

    gbytes_per_s: float = Field(default=40.0, gt=0)
    latency_s: float = Field(default=0.001, ge=0)
    bytes_per_token: int = Field(default=55_000, ge=1)

    def seconds(self, tokens: int) -> float:
        return self.latency_s + tokens * self.bytes_per_token / (self.gbytes_per_s * 1e9)


class PrefillTiming(Strict):
    """What the predictor assumes about one prefill server (defaults: an MI355X TP4 rank, GLM-5.2)."""

    base_s: float = Field(default=0.14, ge=0, description="TTFT floor: API overhead + one prefill forward")
    prefill_tokens_per_s: float = Field(default=16_700, gt=0)


class Disaggregation(Strict):
    prefill: list[PrefillServer] = Field(min_length=1)
    transfer_backend: Literal["mooncake", "mori", "nixl"] = Field(default="mori", description="what the servers "
                                                                  "were started with (gateway check compares)")
    decide: Literal["always", "auto"] = Field(default="auto", description="always: every request takes both legs; "
                                              "auto: per request, whichever predicts the better TTFT within the SLA")
    local_prefill: bool = Field(default=False, description="the decode servers also prefill requests sent without "
                                "bootstrap fields (the simulator's --disaggregation-decode-local-prefill); without it "
                                "`auto` can only disaggregate")
    min_uncached_tokens: int = Field(default=256, ge=0, description="auto: at most this many uncached prompt tokens "
                                     "are prefilled on the decode server (vllm-router's bypass), whatever the queues")
    itl_weight: float = Field(default=1.0, ge=0, description="auto: seconds of TTFT one stream-second of decode "
                              "stalled by a prefill on the decode server counts as (0: TTFT alone decides)")
    kv_headroom: float = Field(default=0.05, ge=0, lt=1, description="a decode server whose KV would be fuller than "
                               "1 - kv_headroom after this request is passed over")
    link: KvLink = Field(default_factory=KvLink)
    prefill_timing: PrefillTiming = Field(default_factory=PrefillTiming)

    @model_validator(mode="after")
    def _names(self) -> Disaggregation:
        unique_names([p.name for p in self.prefill], "prefill")
        return self
