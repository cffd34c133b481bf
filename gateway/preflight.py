"""Preflight of one SGLang server (vLLM's: backends/vllm_engine.py): what `/server_info` and a one-token probe say, and which of its settings make the
gateway go quietly wrong. Run at start and on every reconnect by the engine poller, and on demand by
`gateway check --config FILE` (gateway/check.py; exits 1 when any check fails).

Checks (one name each; the metric label and the `/readyz` detail use it):
- `reachable`    /server_info answers (nothing else can be checked otherwise)
- `api_key`      the pool's key is accepted (401 = wrong or missing `api_key_env`)
- `cache_report` `--enable-cache-report` is on: without it usage has no cached_tokens, so prefix feedback and cost go
                 blind. Read from /server_info and confirmed by a text probe (a multimodal prompt would report
                 `cached_tokens: 0` even without the flag, so the probe is text only)
- `priority`     priority scheduling on while the gateway sends no explicit priority (requests without one get the
                 lowest value unless --default-priority-value), or --abort-on-priority-when-disabled while the gateway
                 always sends one (every request refused with 503)
- `dp_pinning`   several DP ranks (dp_size, or attn_dp_size with DP attention) and pinning off or header pinning on a
                 release without the header (< 0.5.13): SGLang then spreads requests over ranks and prefix hits halve
- `page_size`    the gateway's `routing.chunk_tokens` is not a multiple of the server's page size
- `context_length` the pool's `context_tokens` exceeds the server's context length
- `version`      the release is unknown or older than 0.5.9
- `served_model` the pool's `model` is not a name the server serves (its /v1/models): the gateway would ask for a
                 model the engine does not answer to under that name (e.g. a --served-model-name left out)
PD pools add their prefill servers and the checks of `pd_preflight.py` (roles, bootstrap ports, transfer backend,
page sizes, DP ranks).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from gateway.config import GatewayConfig, SGLangPool, VLLMPool
from gateway.secrets import pool_keys
from gateway.upstreams import release

log = logging.getLogger("gateway.preflight")
OLDEST = (0, 5, 9)


# the most DP ranks a server is believed to have: each becomes a target and a replica label value in the metrics, so a
# server reporting dp_size 10^6 must not make a million (real deployments: up to a few dozen per server)
MAX_RANKS = 256


@dataclass
class Finding:
    check: str
    message: str


@dataclass
class ServerFacts:
    """What the gateway uses from a server's /server_info (None: not reported)."""

    version: str = ""
    ranks: int = 1  # independent schedulers (each its own KV cache): dp_size x attn_dp_size
    dp_attention: bool = False
    max_total_num_tokens: int | None = None  # per rank
    page_size: int | None = None
    context_length: int | None = None
    max_req_input_len: int | None = None
    cache_report: bool | None = None
    priority_scheduling: bool | None = None
    default_priority_value: int | None = None
    abort_on_priority: bool = False
    low_priority_values_first: bool = False
    schedule_policy: str | None = None  # fcfs, or e.g. shortest-prefill-first (0.5.21+): the engine orders by itself
    incarnation: str | None = None  # the simulator's, when asked; real SGLang has none

    @classmethod
    def from_info(cls, d: dict[str, Any]) -> ServerFacts:
        def num(k: str) -> int | None:
            v = d.get(k)
            return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

        dp, attn = num("dp_size") or 1, num("attn_dp_size") or 1
        prio = d.get("enable_priority_scheduling")
        cache = d.get("enable_cache_report")
        dpv = d.get("default_priority_value")
        return cls(version=str(d.get("version") or ""), ranks=min(dp * attn, MAX_RANKS),
                   dp_attention=bool(d.get("enable_dp_attention")) or attn > 1,
                   max_total_num_tokens=num("max_total_num_tokens"), page_size=num("page_size"),
                   context_length=num("context_length"), max_req_input_len=num("max_req_input_len"),
                   cache_report=cache if isinstance(cache, bool) else None,
                   priority_scheduling=prio if isinstance(prio, bool) else None,
                   default_priority_value=dpv if isinstance(dpv, int) and not isinstance(dpv, bool) else None,
                   abort_on_priority=bool(d.get("abort_on_priority_when_disabled")),
                   low_priority_values_first=bool(d.get("schedule_low_priority_values_first")),
                   schedule_policy=str(d["schedule_policy"]) if d.get("schedule_policy") else None,
                   incarnation=str(d["incarnation"]) if d.get("incarnation") else None)


@dataclass
class Report:
    pool: str
    server: str
    url: str
    facts: ServerFacts | None = None
    findings: list[Finding] = field(default_factory=list)
    refused: bool = False  # /server_info's connection was refused (down for sure), not slow or failing

    @property
    def ok(self) -> bool:
        return not self.findings

    def checks(self) -> list[str]:
        return [f.check for f in self.findings]


class Getter(Protocol):
    """What reads a server's answers: an httpx.AsyncClient, or the polls' lean one (backends/polls.py)."""

    async def get(self, url: str, *, headers: dict[str, str], timeout: float) -> Any: ...


async def server_info(client: Getter, base_url: str, headers: dict[str, str],
                      timeout: float = 2.0) -> tuple[int, dict[str, Any] | None]:
    """(status, body) of /server_info, falling back to /get_server_info on 404; raises httpx.HTTPError."""
    r = await client.get(f"{base_url}/server_info", headers=headers, timeout=timeout)
    if r.status_code == 404:
        r = await client.get(f"{base_url}/get_server_info", headers=headers, timeout=timeout)
    if r.status_code != 200:
        return r.status_code, None
    data = r.json()
    return 200, data if isinstance(data, dict) else None


async def served_models(client: httpx.AsyncClient, base_url: str, headers: dict[str, str],
                        timeout: float = 2.0) -> set[str] | None:
    """The model names a server's /v1/models lists; None when it does not answer with a list (no verdict)."""
    try:
        r = await client.get(f"{base_url}/v1/models", headers=headers, timeout=timeout)
        data = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return None
    return {str(m["id"]) for m in items if isinstance(m, dict) and m.get("id")}


PROBE_HEADER = "x-gateway-probe"


async def probe(client: httpx.AsyncClient, base_url: str, model: str, headers: dict[str, str],
                timeout: float = 30.0) -> tuple[int, dict[str, Any] | None]:
    """A one-token text chat request (no priority: a server with --abort-on-priority-when-disabled would refuse it)."""
    body = {"model": model, "messages": [{"role": "user", "content": "gateway preflight probe"}], "max_tokens": 1}
    # marked as the gateway's own probe (an engine ignores the header; the simulator's queued faults skip it)
    r = await client.post(f"{base_url}/v1/chat/completions", json=body, headers={**headers, PROBE_HEADER: "preflight"},
                          timeout=timeout)
    try:
        data = r.json()
    except ValueError:
        data = None
    return r.status_code, data if isinstance(data, dict) else None


async def inspect(client: httpx.AsyncClient, pool: SGLangPool, server: str, url: str, api_key: str | None,
                  chunk_tokens: int, with_probe: bool = True) -> Report:
    """The preflight of one server; never raises for what the server does (an unreachable one is a finding)."""
    rep = Report(pool.name, server, url)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        status, info = await server_info(client, url, headers)
    except (httpx.HTTPError, ValueError) as e:
        rep.refused = isinstance(e, httpx.ConnectError)
        rep.findings.append(Finding("reachable", f"/server_info unreachable ({type(e).__name__}: {e})"))
        return rep
    if status == 401:
        rep.findings.append(Finding("api_key", "/server_info answered 401: the server runs --api-key and the pool's "
                                    f"api_key_env ({pool.api_key_env or 'unset'}) does not hold that key"))
        return rep
    if info is None:
        rep.findings.append(Finding("reachable", f"/server_info answered {status}"))
        return rep
    facts = rep.facts = ServerFacts.from_info(info)
    served = await served_models(client, url, headers)
    if served is not None and pool.model not in served:
        rep.findings.append(Finding("served_model", f"the pool's model {pool.model!r} is not served here (the server "
                                    f"serves {', '.join(sorted(served)) or 'nothing'}): set the pool's model to its "
                                    "--served-model-name"))
    probe_usage: dict[str, Any] | None = None
    if with_probe:
        try:
            status, data = await probe(client, url, pool.model, headers)
            if status == 401:
                rep.findings.append(Finding("api_key", "the probe request answered 401: the pool's api_key_env "
                                            f"({pool.api_key_env or 'unset'}) does not hold the server's --api-key"))
            elif status == 200 and data is not None:
                u = data.get("usage")
                probe_usage = u if isinstance(u, dict) else {}
        except (httpx.HTTPError, ValueError):
            pass  # a slow or failing probe is the health checks' business; /server_info already answered
    rep.findings.extend(assess(facts, pool, chunk_tokens, probe_usage))
    return rep


def assess(f: ServerFacts, pool: SGLangPool, chunk_tokens: int, probe_usage: dict[str, Any] | None) -> list[Finding]:
    """The configuration checks, from the facts, the pool config and the probe's usage (None: no probe answer)."""
    out: list[Finding] = []
    details = probe_usage.get("prompt_tokens_details") if probe_usage is not None else None
    # the probe decides only when /server_info does not say: SGLang 0.5.13 leaves prompt_tokens_details null when
    # nothing of the prompt was cached, cache report on or not (its UsageProcessor._details_if_cached)
    silent = probe_usage is not None and not (isinstance(details, dict) and "cached_tokens" in details)
    if f.cache_report is False or (f.cache_report is None and silent):
        out.append(Finding("cache_report", "cached_tokens missing from usage: start SGLang with --enable-cache-report "
                           "(prefix feedback and cached-token pricing are blind without it)"))
    sends = pool.send_priority == "always" or (pool.send_priority == "auto" and f.priority_scheduling is True)
    if f.priority_scheduling and not sends and f.default_priority_value is None:
        out.append(Finding("priority", "--enable-priority-scheduling without --default-priority-value while the "
                           "gateway sends no priority (send_priority: never): requests without one get the lowest "
                           "priority and are preempted by any other"))
    if f.priority_scheduling is False and f.abort_on_priority and pool.send_priority == "always":
        out.append(Finding("priority", "--abort-on-priority-when-disabled and send_priority: always: SGLang refuses "
                           "every request with 503 (use send_priority: auto)"))
    if f.ranks > 1 and pool.dp_pinning == "off":
        out.append(Finding("dp_pinning", f"{f.ranks} data-parallel ranks{' (DP attention)' if f.dp_attention else ''} "
                           "and dp_pinning: off: SGLang spreads requests over its ranks and prefix hits split"))
    if f.ranks > 1 and pool.dp_pinning == "header" and release(f.version) < (0, 5, 13):
        out.append(Finding("dp_pinning", f"dp_pinning: header needs SGLang 0.5.13+ (this is {f.version or 'unknown'}); "
                           "use dp_pinning: body"))
    if f.page_size and chunk_tokens % f.page_size:
        out.append(Finding("page_size", f"routing.chunk_tokens {chunk_tokens} is not a multiple of the server's page "
                           f"size {f.page_size}: predicted hits do not line up with what the engine can reuse"))
    if pool.context_tokens and f.context_length and pool.context_tokens > f.context_length:
        out.append(Finding("context_length", f"the pool's context_tokens {pool.context_tokens} exceeds the server's "
                           f"context length {f.context_length}: long requests pass the edge and fail upstream"))
    if not f.version or release(f.version) < OLDEST:
        out.append(Finding("version", f"SGLang {f.version or 'version unknown'}: the gateway is tested against 0.5.9, "
                           "0.5.13 and 0.5.23"))
    return out


async def check_config(cfg: GatewayConfig, client: httpx.AsyncClient | None = None) -> list[Report]:
    """Every SGLang server of the config, concurrently (a pool's unset api_key_env is a ConfigError, as at start)."""
    keys = pool_keys(cfg)
    own = client is None
    client = client or httpx.AsyncClient(trust_env=False)
    try:
        from gateway.backends import vllm_engine  # imports this module

        jobs = []
        for pool in cfg.pools:
            if isinstance(pool, SGLangPool):
                jobs += [inspect(client, pool, r.name, r.url, keys[pool.name], cfg.routing.chunk_tokens,
                                 with_probe=pool.disaggregation is None)  # a decode server needs bootstrap fields
                         for r in pool.replicas]
            elif isinstance(pool, VLLMPool):
                jobs += [vllm_engine.inspect(client, pool, r.name, r.url, keys[pool.name]) for r in pool.replicas]
        reports = list(await asyncio.gather(*jobs))
        for pool in cfg.pools:  # PD pools: their prefill servers and what both sides must agree on
            if isinstance(pool, SGLangPool) and pool.disaggregation is not None:
                from gateway.pd_preflight import check_pool

                mine = [r for r in reports if r.pool == pool.name]
                reports += await check_pool(client, pool, keys[pool.name], cfg.routing.chunk_tokens, mine)
        return reports
    finally:
        if own:
            await client.aclose()


def describe(rep: Report) -> str:
    f = rep.facts
    if f is None:
        return f"{rep.pool}/{rep.server} {rep.url}"
    if f.low_priority_values_first and f.page_size is None:  # vLLM: release and cache report only
        return f"{rep.pool}/{rep.server} {rep.url}: vLLM {f.version or '?'}, cache report {f.cache_report}"
    return (f"{rep.pool}/{rep.server} {rep.url}: SGLang {f.version or '?'}, {f.ranks} rank(s)"
            f"{' (DP attention)' if f.dp_attention else ''}, page {f.page_size}, context {f.context_length}, "
            f"cache report {f.cache_report}, schedule policy {f.schedule_policy or '?'}, "
            f"priority scheduling {f.priority_scheduling}")
