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
    schedule_policy: str = "fcfs"  # or "shortest-prefill-first" (0.5.21+); SGLang's other policies are not modelled
    enable_cache_report: bool = False  # SGLang's default: usage carries no prompt_tokens_details
    enable_metrics: bool = True
    disable_radix_cache: bool = False
    stream_interval: int = 1
    api_key: str | None = None
    speculative_algorithm: str | None = "EAGLE"
    speculative_num_steps: int = 5
    speculative_eagle_topk: int = 1
    speculative_num_draft_tokens: int = 6
    kv_cache_dtype: str = "fp8_e4m3"
    sse_style: str = "0.5.13"  # "0.5.9" (pydantic, all nulls) or "0.5.13" (fast path, also 0.5.23's)
    version: str = "0.5.23"  # the release whose surface is served: /v1/loads, /get_load, /server_info, pinning
    enable_dp_attention: bool = False  # 0.5.23 reports dp_size 1 and attn_dp_size N; per-rank caches either way
    load_balance_method: str = "round_robin"  # SGLang's `auto` outside PD: unpinned requests rotate over the ranks
    # Priority scheduling (SGLang semantics, scheduler.py _set_or_validate_priority / preempt_to_schedule): without
    # `priority` a request gets the lowest value unless default_priority_value (0.5.13+) is set; higher values first
    # unless schedule_low_priority_values_first; a waiting request preempts running ones it beats by > threshold.
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    default_priority_value: int | None = None
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    abort_on_priority_when_disabled: bool = False
    report_incarnation: bool = False  # real SGLang has no incarnation id in /server_info; tests may ask for one
    kv_events_config: str | None = None  # SGLang's --kv-events-config JSON (gateway_lab/sim/kv_events.py)
    kv_events_port_collision: bool = False  # reproduce the pre-0.5.23 plain-DP bug: every rank binds port + 0
    # Where EOS falls when it is not ignored: lognormal per workload (median tokens, shared sigma), capped by max_tokens.
    # A chat answer runs to a few hundred tokens; an agent's text turn after its tool results is short. A real model
    # ends long before a generous cap: P(> 8 x median) is ~0.5% at sigma 0.8 (an exponential put 13% past 2 x mean).
    eos_median_tokens: int = 180  # chat answers (no tools offered) and completions
    eos_agent_median_tokens: int = 60  # chat turns that offer tools (an agent answering after its tool results)
    eos_sigma: float = 0.8
    # Prefill/decode disaggregation (SGLang's --disaggregation-* flags; gateway_lab/sim/pd.py, docs/simulator.md)
    disaggregation_mode: str = "null"  # "null" (unified) | "prefill" | "decode"
    disaggregation_bootstrap_port: int = 8998  # SGLang's default; a prefill server's bootstrap server listens here
    disaggregation_transfer_backend: str = "mooncake"  # SGLang's default; mori is AMD's RDMA engine, nixl NVIDIA's
    disaggregation_ib_device: str | None = None
    # the KV link [inf]: GLM-5.2 fp8 MLA+DSA-indexer KV is ~55 KB per token, sent from one prefill TP rank over one
    # 400 Gb/s RDMA NIC (MI355X + Pollara) at ~40 GB/s effective, plus a fixed per-transfer handshake
    kv_link_gbytes_per_s: float = 40.0
    kv_link_latency_s: float = 0.001
    kv_bytes_per_token: int = 55_000
    disaggregation_bootstrap_timeout: float = 300.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (s)
    disaggregation_waiting_timeout: float = 300.0  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT (s)
    # [inf] not in SGLang: a decode server that also prefills requests sent without bootstrap fields (unified
    # serving on a decode worker, what SLA-aware PD routing falls back to); off = SGLang's refusal
    disaggregation_decode_local_prefill: bool = False
    seed: int = 0
    time_scale: float = 1.0  # k > 1 runs k times faster than real time; reported latencies stay simulated
    timing: TimingModel = field(default_factory=TimingModel)

    def at_least(self, release: str) -> bool:
        """True when the served SGLang version is `release` or newer ("0.5.13" matches "0.5.13.post1")."""
        return _release(self.version) >= _release(release)

    def check_schedule(self) -> None:
        """SGLang's start-up checks on the scheduling flags (arg_groups/validation_hook.py, schedule_policy.py)."""
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy {self.schedule_policy!r}: the simulator models {sorted(SCHEDULE_POLICIES)}")
        if self.schedule_policy == FCFS:
            return
        if not self.at_least("0.5.21"):
            raise ValueError(f"schedule_policy {self.schedule_policy!r}: not in SGLang {self.version} (added in 0.5.21)")
        if self.enable_priority_scheduling:
            raise ValueError("To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'. "
                             f"'{self.schedule_policy}' is not supported.")
        if self.disable_radix_cache:
            raise ValueError("Experimental shortest-prefill-first requires prefix caching")

    def check_disaggregation(self) -> None:
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation_mode {self.disaggregation_mode!r}: choose one of {sorted(DISAGGREGATION_MODES)}")
        if self.disaggregation_transfer_backend not in TRANSFER_BACKENDS:
            raise ValueError(f"disaggregation_transfer_backend {self.disaggregation_transfer_backend!r}: choose one of "
                             f"{sorted(TRANSFER_BACKENDS)}")
        if self.kv_link_gbytes_per_s <= 0 or self.kv_bytes_per_token <= 0 or self.kv_link_latency_s < 0:
            raise ValueError("kv_link_gbytes_per_s and kv_bytes_per_token must be > 0, kv_link_latency_s >= 0")

    def kv_transfer_time(self, tokens: int) -> float:
        """Seconds to move `tokens` of KV from a prefill server to a decode server over the link model."""
        return self.kv_link_latency_s + tokens * self.kv_bytes_per_token / (self.kv_link_gbytes_per_s * 1e9)

    def with_overrides(self, **kw: Any) -> ReplicaConfig:
        timing_kw = {k: kw.pop(k) for k in list(kw) if k in TimingModel.__dataclass_fields__}
        cfg = replace(self, **kw)
        if timing_kw:
            cfg = replace(cfg, timing=replace(cfg.timing, **timing_kw))
        return cfg


# What the simulator's scheduler models of SGLang's --schedule-policy: arrival order (with priority scheduling: by
# priority, then arrival), and 0.5.21's shortest-prefill-first (by uncached tokens, the running chunk capped so that
# shorter waiting prefills share its forward; SGLang refuses it together with --enable-priority-scheduling).
FCFS, SHORTEST_PREFILL_FIRST = "fcfs", "shortest-prefill-first"
SCHEDULE_POLICIES = frozenset({FCFS, SHORTEST_PREFILL_FIRST})

DISAGGREGATION_MODES = frozenset({"null", "prefill", "decode"})
TRANSFER_BACKENDS = frozenset({"mooncake", "mori", "nixl", "fake"})

# `--sglang-version` choices -> the release string /server_info and /v1/loads report
SGLANG_VERSIONS = {"0.5.9": "0.5.9", "0.5.13": "0.5.13.post1", "0.5.23": "0.5.23"}


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def for_version(cfg: ReplicaConfig, short: str) -> ReplicaConfig:
    """`cfg` as SGLang `short` (a SGLANG_VERSIONS key) serves it: its version string and SSE byte style."""
    if short not in SGLANG_VERSIONS:
        raise ValueError(f"unknown SGLang version {short!r}; choose one of {sorted(SGLANG_VERSIONS)}")
    return cfg.with_overrides(version=SGLANG_VERSIONS[short], sse_style="0.5.9" if short == "0.5.9" else "0.5.13")


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
