"""Reconciles the gateways' load view with the engines' own: polls SGLang `/v1/loads` (falling back to
`/get_load`) every `load_poll_s`, and `/server_info` now and then for the replica's incarnation and KV capacity.

The engines' gauges lag bursts, so they are a floor under the gateways' counts, not the primary signal; they also
cover traffic that did not come through any gateway.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from gateway.prediction.ttft import LoadView
from gateway.prefix.index import PrefixIndex
from gateway.upstreams import Target, UpstreamRegistry
from gateway.background import BackgroundTask

log = logging.getLogger("gateway.engine")
INFO_EVERY = 10  # polls between /server_info reads


class EnginePoller:
    def __init__(self, registry: UpstreamRegistry, client: httpx.AsyncClient, index: PrefixIndex, chunk_tokens: int,
                 period: float) -> None:
        self.registry = registry
        self.client = client
        self.index = index
        self.chunk_tokens = chunk_tokens
        self.period = period
        self._bg = BackgroundTask(self._run, "engine-poller")
        self._n = 0

    def start(self) -> None:
        self._bg.start()

    async def stop(self) -> None:
        await self._bg.stop()

    async def poll_once(self, info: bool = True) -> None:
        targets = [t for t in self.registry.targets if t.kind == "sglang"]
        await asyncio.gather(*(self._poll(t, info) for t in targets))

    async def _run(self) -> None:
        while True:
            await self.poll_once(info=self._n % INFO_EVERY == 0)
            self._n += 1
            await asyncio.sleep(self.period)

    def _headers(self, t: Target) -> dict[str, str]:
        return {"authorization": f"Bearer {t.api_key}"} if t.api_key else {}

    async def _poll(self, t: Target, info: bool) -> None:
        try:
            if info:
                await self._server_info(t)
            r = await self.client.get(f"{t.base_url}/v1/loads", headers=self._headers(t), timeout=2.0)
            if r.status_code == 404:
                r = await self.client.get(f"{t.base_url}/get_load", headers=self._headers(t), timeout=2.0)
                t.engine_load = _from_get_load(r.json()) if r.status_code == 200 else None
            elif r.status_code == 200:
                t.engine_load = _from_v1_loads(r.json())
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            t.engine_load = None

    async def _server_info(self, t: Target) -> None:
        r = await self.client.get(f"{t.base_url}/server_info", headers=self._headers(t), timeout=2.0)
        if r.status_code == 404:
            r = await self.client.get(f"{t.base_url}/get_server_info", headers=self._headers(t), timeout=2.0)
        if r.status_code != 200:
            return
        data: dict[str, Any] = r.json()
        # Real SGLang has no incarnation id; the simulator does. A restart elsewhere is caught by the cached_tokens
        # feedback (the engine reports fewer cached tokens than predicted and the stale entries are dropped).
        inc = str(data.get("incarnation") or t.incarnation)
        if inc != t.incarnation:
            old = t.index_key
            t.incarnation = inc
            if old != t.index_key:
                log.info("replica %s has a new incarnation %s: its prefix entries are dropped", t.name, inc)
                await self.index.drop_replica(old)
        cap = data.get("max_total_num_tokens")
        if isinstance(cap, int) and cap > 0:
            ranks = int(data.get("dp_size") or 1)
            self.index.set_capacity(t.index_key, cap * ranks // self.chunk_tokens)


def _from_v1_loads(data: dict[str, Any]) -> LoadView:
    loads = data.get("loads") or []
    return LoadView(float(sum(x.get("num_waiting_uncached_tokens", 0) for x in loads)),
                    float(sum(x.get("num_running_reqs", 0) + x.get("num_waiting_reqs", 0) for x in loads)))


def _from_get_load(data: Any) -> LoadView:
    rows = data if isinstance(data, list) else []
    return LoadView(float(sum(x.get("num_pending_tokens", 0) for x in rows)), float(sum(x.get("num_reqs", 0) for x in rows)))
