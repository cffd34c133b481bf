"""`gateway check` for PD pools: what a prefill/decode-disaggregated SGLang deployment must agree on.

On top of the per-server checks (`preflight.py`, run on the decode servers and the prefill servers alike):
- `pd_role`          each decode server runs `--disaggregation-mode decode`, each prefill server `prefill` (a
                     unified server would ignore the bootstrap fields; a decode server listed as prefill never
                     answers)
- `bootstrap`        each prefill server's bootstrap server answers on the configured port (`/health`), and the
                     server's own `disaggregation_bootstrap_port` is that port (else every decode leg waits for KV
                     that nobody sends, until SGLANG_DISAGGREGATION_WAITING_TIMEOUT)
- `transfer_backend` every server uses the pool's `transfer_backend` (mooncake, mori, nixl do not talk to each other)
- `pd_page_size`     prefill and decode servers have the same page size (the KV is sent page by page)
- `pd_dp_size`       a prefill server's DP rank count is the configured `dp_size` (the gateway picks the prefill rank
                     through `bootstrap_room % dp_size`)
- `local_prefill`    the pool lets `decide: auto` prefill on decode servers that do not (they refuse requests without
                     bootstrap fields)
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import httpx

from gateway.config import SGLangPool
from gateway.preflight import Finding, Report, inspect, server_info


async def _info(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> dict[str, Any] | None:
    try:
        status, data = await server_info(client, url, headers)
    except (httpx.HTTPError, ValueError):
        return None
    return data if status == 200 else None


async def _bootstrap_ok(client: httpx.AsyncClient, host: str, port: int) -> str | None:
    """None when the bootstrap server answers; else what went wrong."""
    try:
        r = await client.get(f"http://{host}:{port}/health", timeout=2.0)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}"
    return None if r.status_code == 200 else f"HTTP {r.status_code}"


async def check_pool(client: httpx.AsyncClient, pool: SGLangPool, api_key: str | None, chunk_tokens: int,
                     decode_reports: list[Report]) -> list[Report]:
    """The prefill servers' reports (per-server and PD checks); PD findings are added to `decode_reports` too."""
    d = pool.disaggregation
    assert d is not None
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    prefill_reports = list(await asyncio.gather(*(inspect(client, pool, s.name, s.url, api_key, chunk_tokens,
                                                          with_probe=False) for s in d.prefill)))
    infos = await asyncio.gather(*(_info(client, s.url, headers) for s in d.prefill),
                                 *(_info(client, r.url, headers) for r in decode_reports))
    p_infos, d_infos = infos[:len(d.prefill)], infos[len(d.prefill):]
    pages: dict[str, int] = {}
    sides = [(rep, info, "prefill") for rep, info in zip(prefill_reports, p_infos)]
    sides += [(rep, info, "decode") for rep, info in zip(decode_reports, d_infos)]
    for rep, info, want in sides:
        if info is None:
            continue  # `reachable` already says so
        mode = str(info.get("disaggregation_mode") or "null")
        if mode != want:
            rep.findings.append(Finding("pd_role", f"--disaggregation-mode is {mode!r}, the pool lists it as a "
                                        f"{want} server"))
        backend = info.get("disaggregation_transfer_backend")
        if backend is not None and backend != d.transfer_backend:
            rep.findings.append(Finding("transfer_backend", f"--disaggregation-transfer-backend {backend}, the pool "
                                        f"says {d.transfer_backend}: the two sides cannot exchange KV"))
        if isinstance(info.get("page_size"), int):
            pages[f"{rep.server} ({want})"] = info["page_size"]
        if want == "decode" and d.local_prefill and info.get("disaggregation_decode_local_prefill") is not True:
            rep.findings.append(Finding("local_prefill", "the pool has local_prefill: true but this decode server "
                                        "refuses requests without bootstrap fields"))
    for srv, rep, info in zip(d.prefill, prefill_reports, p_infos):
        problem = await _bootstrap_ok(client, urlsplit(srv.url).hostname or "127.0.0.1", srv.bootstrap_port)
        if problem is not None:
            rep.findings.append(Finding("bootstrap", f"no bootstrap server on port {srv.bootstrap_port} ({problem}): "
                                        "decode legs would wait for KV that is never sent"))
        if info is None:
            continue
        port = info.get("disaggregation_bootstrap_port")
        if isinstance(port, int) and port != srv.bootstrap_port:
            rep.findings.append(Finding("bootstrap", f"the server's --disaggregation-bootstrap-port is {port}, the "
                                        f"pool says {srv.bootstrap_port}"))
        dp = info.get("dp_size")
        if isinstance(dp, int) and dp != srv.dp_size:
            rep.findings.append(Finding("pd_dp_size", f"the server has {dp} DP ranks, the pool says dp_size "
                                        f"{srv.dp_size}: the room would land on another rank than chosen"))
    if len(set(pages.values())) > 1:
        msg = ", ".join(f"{k}: {v}" for k, v in sorted(pages.items()))
        for rep in [*prefill_reports, *decode_reports]:
            rep.findings.append(Finding("pd_page_size", f"prefill and decode page sizes differ ({msg})"))
    return prefill_reports
