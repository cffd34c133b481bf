"""Fitted timing profiles (shared/reference/sglang-simulator-spec.md section 6) and per-replica settings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class TimingModel:
    """Per DP rank. Prefill: P0 + sum n_i (P1 + P2 c_i); decode step: D0 + D1 B; alpha tokens per step."""

    t_api: float = 0.11  # HTTP, templating, tokenize, SSE write (s); delays every delivered event
    p0: float = 0.03  # per prefill forward (s)
    p1: float = 50.6e-6  # per uncached token (s)
    p2: float = 0.352e-9  # per uncached token x context token (s)
    d0: float = 15.5e-3  # per decode step (s)
    d1: float = 0.65e-3  # per running request per step (s)
    alpha: float = 3.5  # tokens per decode step (MTP accept length); 1 without speculative decoding
    jitter_sigma: float = 0.0  # lognormal sigma per forward

    def prefill_time(self, chunks: list[tuple[int, float]]) -> float:
        """chunks: (n uncached tokens in this forward, c = resident context + n/2) per request."""
        return self.p0 + sum(n * (self.p1 + self.p2 * c) for n, c in chunks)

    def decode_time(self, batch: int) -> float:
        return self.d0 + self.d1 * batch


@dataclass(frozen=True)
class ReplicaConfig:
    """Server arguments of one simulated SGLang server (names as SGLang's, reported in /server_info)."""

    profile: str = "mi355x-glm52-tp4"
    model_path: str = "amd/GLM-5.2-MXFP4"
    served_model_name: str = "zai-org/GLM-5.2"
    tp_size: int = 4
    dp_size: int = 1
    context_length: int = 1_048_576
    page_size: int = 64
    chunked_prefill_size: int = 16_384
    max_prefill_tokens: int = 16_384
    max_running_requests: int = 48
    max_queued_requests: int | None = None
    max_total_num_tokens: int = 2_400_000  # KV capacity per rank, tokens
    schedule_policy: str = "fcfs"
    enable_cache_report: bool = True
    enable_metrics: bool = True
    disable_radix_cache: bool = False
    stream_interval: int = 1
    api_key: str | None = None
    speculative_algorithm: str | None = "EAGLE"
    speculative_num_steps: int = 5
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 6
    kv_cache_dtype: str = "fp8_e4m3"
    sse_style: str = "0.5.13"  # "0.5.9" (pydantic, all nulls) or "0.5.13" (fast path)
    version: str = "0.5.13.post1"
    default_output_tokens: int = 256  # mean output length when EOS is not ignored
    seed: int = 0
    time_scale: float = 1.0  # k > 1 runs k times faster than real time; reported latencies stay simulated
    timing: TimingModel = field(default_factory=TimingModel)

    def with_overrides(self, **kw: Any) -> ReplicaConfig:
        timing_kw = {k: kw.pop(k) for k in list(kw) if k in TimingModel.__dataclass_fields__}
        cfg = replace(self, **kw)
        if timing_kw:
            cfg = replace(cfg, timing=replace(cfg.timing, **timing_kw))
        return cfg


PROFILES: dict[str, ReplicaConfig] = {
    # One TP4 group of an MI355X node, GLM-5.2 MXFP4, EAGLE-MTP 5/1/6, fp8 KV (spec 6.2).
    "mi355x-glm52-tp4": ReplicaConfig(),
    # One TP8 rank per node: prefill 1.25x faster, same decode cap (spec 6.5).
    "mi355x-glm52-tp8": ReplicaConfig(
        profile="mi355x-glm52-tp8",
        tp_size=8,
        timing=TimingModel(p1=50.6e-6 / 1.25, p2=0.352e-9 / 1.25),
    ),
    # One TP4 group of a B200 node, GLM-5.2 FP8 (spec 6.5 inferred profile).
    "b200-glm52": ReplicaConfig(
        profile="b200-glm52",
        model_path="zai-org/GLM-5.2-FP8",
        timing=TimingModel(t_api=0.09, p1=41.6e-6, p2=0.289e-9, d0=12.5e-3, d1=0.50e-3),
    ),
}


def profile(name: str, **overrides: Any) -> ReplicaConfig:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name].with_overrides(**overrides)
