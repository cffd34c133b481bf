"""`gateway check --config FILE`: everything that would make a config go quietly wrong, before it serves.

- every SGLang server: its preflight (preflight.py: reachable, key, cache report, priority, DP pinning, page size,
  context length, version, the served model name);
- every hosted pool (`kind: openai`): a minimal real request — one token, the pool's model, its key — so a wrong
  key (`api_key`), a model the endpoint does not serve (`model`) or an endpoint that does not answer (`reachable`)
  is a named failure, not a pass with nothing checked;
- the config itself: one URL under two replica names (`duplicate_url`) — the same server counted twice, its load
  and prefix entries split between two names.

One line per server or pool, one line per finding; exit 1 if any, 2 on a config error. `litellm` pools are listed
as not probed (their provider's API is litellm's to speak)."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.config import ConfigError, GatewayConfig, OpenAIPool, SGLangPool, VLLMPool, load_config
from gateway.preflight import Finding, check_config, describe
from gateway.secrets import pool_keys


@dataclass
class PoolReport:
    pool: str
    url: str
    findings: list[Finding] = field(default_factory=list)
    note: str = ""


def duplicate_urls(cfg: GatewayConfig) -> list[Finding]:
    """One finding per URL configured under more than one replica name (in one pool or across pools)."""
    seen: dict[str, list[str]] = {}
    for pool in cfg.pools:
        if isinstance(pool, SGLangPool | VLLMPool):
            for r in pool.replicas:
                seen.setdefault(r.url, []).append(f"{pool.name}/{r.name}")
    return [Finding("duplicate_url", f"{url} is configured as {' and '.join(names)}: one server counted as "
                    f"{len(names)}, its load and prefix entries split between the names")
            for url, names in seen.items() if len(names) > 1]


def _message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
    except (ValueError, AttributeError):
        return r.text[:200]
    if isinstance(err, dict):
        return str(err.get("message") or err)[:200]
    return str(err)[:200]


async def probe_hosted(client: httpx.AsyncClient, pool: OpenAIPool, key: str | None, timeout: float) -> PoolReport:
    """A one-token chat request to the pool's endpoint with its model and key."""
    rep = PoolReport(pool.name, pool.base_url)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": pool.model, "messages": [{"role": "user", "content": "gateway check"}], "max_tokens": 1}
    try:
        r = await client.post(f"{pool.base_url}/chat/completions", json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        rep.findings.append(Finding("reachable", f"{pool.base_url}/chat/completions: {type(e).__name__}: {e}"))
        return rep
    msg = _message(r) if r.status_code != 200 else ""
    if r.status_code in (401, 403):
        rep.findings.append(Finding("api_key", f"the endpoint refused the pool's key ({r.status_code}: {msg}); check "
                                    f"api_key_env ({pool.api_key_env or 'unset'})"))
    elif r.status_code == 404 or ("model" in msg.lower() and 400 <= r.status_code < 500):
        rep.findings.append(Finding("model", f"the endpoint does not serve model {pool.model!r} ({r.status_code}: "
                                    f"{msg})"))
    elif r.status_code != 200:
        rep.findings.append(Finding("probe", f"a one-token request answered {r.status_code}: {msg}"))
    else:
        rep.note = f"answered a one-token request as {pool.model}"
    return rep


async def run_checks(cfg: GatewayConfig) -> tuple[list[Any], list[PoolReport], list[Finding]]:
    keys = pool_keys(cfg)
    async with httpx.AsyncClient(trust_env=False) as client:
        servers, hosted = await asyncio.gather(
            check_config(cfg, client),
            asyncio.gather(*(probe_hosted(client, p, keys[p.name], min(cfg.timeouts.first_byte, 30.0))
                             for p in cfg.pools if isinstance(p, OpenAIPool))))
    return servers, list(hosted), duplicate_urls(cfg)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        servers, hosted, config_findings = asyncio.run(run_checks(cfg))
    except ConfigError as e:
        print(e)
        return 2
    bad = 0
    for rep in servers:
        print(("ok    " if rep.ok else "FAIL  ") + describe(rep))
        for f in rep.findings:
            bad += 1
            print(f"  {rep.pool}/{rep.server}: {f.check}: {f.message}")
    for h in hosted:
        print(("ok    " if not h.findings else "FAIL  ") + f"{h.pool} {h.url}" + (f": {h.note}" if h.note else ""))
        for f in h.findings:
            bad += 1
            print(f"  {h.pool}: {f.check}: {f.message}")
    for p in cfg.pools:
        if p.kind == "litellm":
            print(f"skip  {p.name}: litellm pool, not probed")
    for f in config_findings:
        bad += 1
        print(f"FAIL  config: {f.check}: {f.message}")
    print(f"{len(servers)} server(s), {len(hosted)} hosted pool(s), {bad} misconfiguration(s)")
    return 1 if bad else 0
