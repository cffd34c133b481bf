"""What the gateway reads from a vLLM server (0.32+), which has no /server_info or /v1/loads:

- load: `/metrics` (Prometheus text): `vllm:num_requests_running` + `vllm:num_requests_waiting`, summed over the
  server's label sets (one per engine); vLLM publishes no count of waiting prefill tokens, so that floor reads 0;
- release: `/version`;
- the preflight (`inspect`): reachable, the pool's key accepted, and a text probe sent twice, whose usage must carry
  `prompt_tokens_details.cached_tokens` (`--enable-prompt-tokens-details`) and report the repeat cached
  (`--enable-prefix-caching`; a CPU build or an older release may leave it off);
- KV-event publishers: `/kv_event_sources`, `{dp_rank: KVEventsConfig}` with `endpoint` / `replay_endpoint` as
  the server was started (a wildcard host means the replica URL's host).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx

from gateway.config import VLLMPool
from gateway.prediction.ttft import LoadView
from gateway.preflight import PROBE_HEADER, Finding, Report, ServerFacts

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
# ~600 tokens of text in any BPE: longer than a few blocks of every block size vLLM takes (16..256)
PROBE_TEXT = " ".join(f"gateway preflight probe {i}" for i in range(150))


def load_from_metrics(text: str) -> LoadView | None:
    """The engine's queue from its Prometheus text, or None when neither gauge is there (not a vLLM /metrics)."""
    running = waiting = 0.0
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_"):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        value = rest.rsplit(" ", 1)[-1] if "{" in line else rest
        try:
            v = float(value)
        except ValueError:
            continue
        if name == RUNNING:
            running += v
            seen = True
        elif name == WAITING:
            waiting += v
            seen = True
    return LoadView(0.0, running + waiting) if seen else None


async def version(client: httpx.AsyncClient, base_url: str, headers: dict[str, str], timeout: float = 2.0) -> tuple[int, str]:
    r = await client.get(f"{base_url}/version", headers=headers, timeout=timeout)
    if r.status_code != 200:
        return r.status_code, ""
    data = r.json()
    return 200, str(data.get("version") or "") if isinstance(data, dict) else ""


async def inspect(client: httpx.AsyncClient, pool: VLLMPool, server: str, url: str, api_key: str | None,
                  with_probe: bool = True) -> Report:
    rep = Report(pool.name, server, url)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        status, ver = await version(client, url, headers)
    except (httpx.HTTPError, ValueError) as e:
        rep.refused = isinstance(e, httpx.ConnectError)
        rep.findings.append(Finding("reachable", f"/version unreachable ({type(e).__name__}: {e})"))
        return rep
    if status != 200:
        rep.findings.append(Finding("reachable", f"/version answered {status}: not a vLLM server?"))
        return rep
    rep.facts = ServerFacts(version=ver, low_priority_values_first=True)  # vLLM serves lower values first
    if not with_probe:
        return rep
    body = {"model": pool.model, "messages": [{"role": "user", "content": PROBE_TEXT}], "max_tokens": 1}
    usages: list[dict[str, Any]] = []
    try:
        for _ in range(2):
            r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=30.0,
                                  headers={**headers, PROBE_HEADER: "preflight"})
            if r.status_code == 401:
                rep.findings.append(Finding("api_key", "the probe request answered 401: the pool's api_key_env "
                                            f"({pool.api_key_env or 'unset'}) does not hold the server's --api-key"))
                return rep
            data = r.json() if r.status_code == 200 else None
            u = data.get("usage") if isinstance(data, dict) else None
            if not isinstance(u, dict):
                return rep  # a failing probe is the health checks' business
            usages.append(u)
    except (httpx.HTTPError, ValueError):
        return rep
    details = usages[-1].get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    rep.facts.cache_report = isinstance(cached, int)
    if not isinstance(cached, int):
        rep.findings.append(Finding("cache_report", "usage has no prompt_tokens_details.cached_tokens: start vLLM "
                                    "with --enable-prompt-tokens-details (prefix feedback and cost are blind)"))
    elif cached == 0:
        rep.findings.append(Finding("prefix_cache", "a repeated prompt reported 0 cached tokens: start vLLM with "
                                    "--enable-prefix-caching (prefix-affinity routing gains nothing)"))
    return rep


def endpoints_of(sources: Any, replica_url: str) -> list[tuple[int, str, str | None, str]]:
    """[(rank, pub endpoint, replay endpoint or None, topic)] from /kv_event_sources; [] when events are off."""
    if not isinstance(sources, dict):
        return []
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    out = []
    for rank, cfg in sources.items():
        if not isinstance(cfg, dict) or cfg.get("publisher", "zmq") != "zmq" or cfg.get("enable_kv_cache_events") is False:
            continue
        pub = _dial(cfg.get("endpoint"), host)
        if pub is None:
            continue
        try:
            r = int(rank)
        except ValueError:
            continue
        out.append((r, pub, _dial(cfg.get("replay_endpoint"), host), str(cfg.get("topic") or "")))
    return sorted(out)


def _dial(endpoint: Any, host: str) -> str | None:
    """A bind endpoint (`tcp://*:5557`) as one to connect to: the wildcard becomes the replica's host."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    hostport = endpoint[len("tcp://"):]
    h, _, port = hostport.rpartition(":")
    if not port.isdigit():
        return None
    if h in ("*", "0.0.0.0", "", "[::]", "::"):
        h = host
    return f"tcp://{h}:{port}"
