"""Reconciles the gateways' load view with the engines' own, and keeps each SGLang server's facts current.

Every `load_poll_s` it polls `/v1/loads` (falling back to `/get_load`, gone in 0.5.23) per server and gives each
DP-rank target its own rank's row. Now and then it re-reads `/server_info`: DP rank count (a server with N ranks
becomes N targets, see upstreams.py), version, priority scheduling, context length, KV capacity per rank and the
simulator's incarnation. At start and after every reconnect (a server that was unreachable answers again) it runs
the full preflight (gateway/preflight.py, with a probe request): each failed check is logged once, counted in
`gateway_replica_misconfigured{pool,replica,check}` and kept on the targets for `/readyz`.

vLLM servers (pool kind `vllm`) have no /server_info or /v1/loads: their load is read from /metrics and their
preflight is vLLM's own (backends/vllm_engine.py).

A server that answers the start-up read with 404 (/server_info: not that engine, or an older release) is not
unreachable, and asking again at once will not change it: the reason is logged once, and the read is retried after
1, 2, 4, ... up to 64 polls instead of on every poll. Any other answer (a 503 while a server starts) is asked again
on the next poll, as before.

The engines' gauges lag bursts, so they are a floor under the gateways' counts, not the primary signal; they also
cover traffic that did not come through any gateway. What the facts mean for the prefix index (an index key out of
use, a replica's KV capacity) goes to the routing state's one writer (`dispatch/feedback.py`) as events.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import httpx
from prometheus_client import Gauge

from gateway import preflight
from gateway.backends import vllm_engine
from gateway.backends.polls import PollClient
from gateway.background import BackgroundTask
from gateway.config import GatewayConfig, SGLangPool, VLLMPool
from gateway.observability.logging import log_event
from gateway.prediction.ttft import LoadView
from gateway.upstreams import Target, UpstreamRegistry

log = logging.getLogger("gateway.engine")
INFO_EVERY = 10  # polls between /server_info reads
BACKOFF_MAX = 64  # polls between retries of a start-up read that keeps failing on a server that answers


class _Answered(Exception):
    """The server answered, but not what the start-up read needs (logged once; retried with backoff)."""


class ReplicaFacts(Protocol):
    """Where the poller's findings about the prefix index go (`dispatch.feedback.Feedback`)."""

    async def replica_replaced(self, key: str) -> None: ...
    def replica_capacity(self, key: str, chunks: int) -> None: ...


class EnginePoller:
    def __init__(self, registry: UpstreamRegistry, client: httpx.AsyncClient, facts: ReplicaFacts, chunk_tokens: int,
                 period: float, config: GatewayConfig | None = None, metrics_registry: Any = None,
                 gets: PollClient | None = None) -> None:
        self.registry = registry
        self.client = client  # the preflights (rare: at start and after a reconnect)
        self._own_gets = gets is None
        self.gets = PollClient(client) if gets is None else gets  # every poll's GETs (backends/polls.py)
        self.facts = facts
        self.chunk_tokens = chunk_tokens
        self.period = period
        self.pools: dict[str, SGLangPool | VLLMPool] = (
            {p.name: p for p in config.pools if isinstance(p, SGLangPool | VLLMPool)} if config else {})
        self.misconfigured = Gauge("gateway_replica_misconfigured", "1 while a preflight check fails for an SGLang "
                                   "server (log line and /readyz name it)", ["pool", "replica", "check"],
                                   registry=metrics_registry, multiprocess_mode="livemostrecent") if metrics_registry is not None else None
        self.reports: dict[str, preflight.Report] = {}  # server -> last full preflight
        self._reachable: dict[str, bool] = {}
        self._refused: set[str] = set()  # servers whose last poll found nothing listening
        self._bg = BackgroundTask(self._run, "engine-poller")
        self._n = 0
        self._backoff: dict[str, tuple[int, int, str]] = {}  # server -> (failures, next poll number, last reason)

    def start(self) -> None:
        self._bg.start()

    async def first_poll(self, within_s: float) -> None:
        """The start's preflight, awaited before serving (bounded): a simulator's incarnation is part of its prefix
        index key, so entries written before it is known would be dropped as a restart's once it is."""
        try:
            await asyncio.wait_for(self._until_answered(), within_s)
            self._n = 1  # the loop's first poll need not repeat the full read
        except TimeoutError:
            log.warning("the start's preflight took over %.0f s; serving, it goes on in the background", within_s)

    async def _until_answered(self) -> None:
        # a server that was slow to answer (a busy host) is asked again within the bound: left to the loop, its
        # incarnation would arrive after the first requests and drop their entries. One that refused the
        # connection is down: the loop finds it when it comes up. Servers that answered are not asked again.
        pending = self.registry.servers()
        while True:
            await self.poll_once(servers=pending)
            pending = {s: ts for s, ts in self.registry.servers().items()
                       if not self._reachable.get(s, False) and s not in self._refused and s not in self._backoff}
            if not pending:
                return
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self._bg.stop()
        if self._own_gets:
            self.gets.close()

    async def poll_once(self, info: bool = True, servers: dict[str, list[Target]] | None = None) -> None:
        """Poll `servers` (default: every server the registry has) once, concurrently."""
        servers = self.registry.servers() if servers is None else servers
        await asyncio.gather(*(self._poll(name, ts, info) for name, ts in servers.items()))

    async def _run(self) -> None:
        while True:
            await self.poll_once(info=self._n % INFO_EVERY == 0)
            self._n += 1
            await asyncio.sleep(self.period)

    def _headers(self, t: Target) -> dict[str, str]:
        return {"authorization": f"Bearer {t.api_key}"} if t.api_key else {}

    async def _poll(self, server: str, targets: list[Target], info: bool) -> None:
        t = targets[0]
        if t.caps.engine_api == "vllm":
            await self._poll_vllm(server, targets, info)
            return
        reconnect = not self._reachable.get(server, False)
        if reconnect and not self._due(server):
            return
        try:
            # a server whose preflight failed is checked again at each /server_info read: fixed without going down
            # (a flag changed, the pool's key rotated), its finding clears at the next reconcile, not at a restart
            failing = (rep := self.reports.get(server)) is not None and not rep.ok
            if reconnect or (info and failing):
                targets = await self._preflight(server, t) or targets
            elif info:
                targets = await self._server_info(server, t) or targets
            r = await self.gets.get(f"{t.base_url}/v1/loads", headers=self._headers(t), timeout=2.0)
            if r.status_code == 404:
                r = await self.gets.get(f"{t.base_url}/get_load", headers=self._headers(t), timeout=2.0)
                rows = _rows_get_load(r.json()) if r.status_code == 200 else None
            elif r.status_code == 200:
                data = r.json()  # once: the rows and the KV use are both read from it
                rows = _rows_v1_loads(data)
                _assign_kv(targets, _kv_usage(data))
            else:
                rows = None
                _assign_kv(targets, None)
            self._reachable[server] = True
            self._refused.discard(server)
            self._backoff.pop(server, None)
            _assign(targets, rows)
        except _Answered as e:
            self._failed(server, t, str(e))
            for x in targets:
                x.state.engine_load = None
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            self._unreachable(server, e)
            for x in targets:
                x.state.engine_load = x.state.kv_usage = None

    async def _preflight(self, server: str, t: Target) -> list[Target] | None:
        pool = self.pools.get(t.pool)
        if pool is None:  # a registry built without the config (tests): server facts only
            return await self._server_info(server, t)
        assert isinstance(pool, SGLangPool)
        rep = await preflight.inspect(self.client, pool, server, t.base_url, t.api_key, self.chunk_tokens)
        if rep.facts is None and any(f.check == "reachable" for f in rep.findings):
            reason = next(f.message for f in rep.findings if f.check == "reachable")
            if "answered 404" in reason:  # up, and not this engine (or too old): logged, retried with backoff
                raise _Answered(reason)
            # not a misconfiguration: try again next poll
            raise httpx.ConnectError("refused") if rep.refused else httpx.ReadTimeout("unreachable")
        return await self._record(server, t, rep)

    async def _record(self, server: str, t: Target, rep: preflight.Report) -> list[Target] | None:
        old = self.reports.get(server)
        self.reports[server] = rep
        for f in rep.findings:
            if old is None or f.check not in old.checks():
                log_event("replica_misconfigured", pool=t.pool, replica=server, check=f.check, message=f.message)
        cleared = sorted(set(old.checks() if old else []) - set(rep.checks()))
        if cleared:
            log_event("replica_preflight_ok", pool=t.pool, replica=server, cleared=cleared,
                      still_failing=rep.checks() or None)
        if self.misconfigured is not None:
            for check in set(old.checks() if old else []) - set(rep.checks()):
                self.misconfigured.labels(t.pool, server, check).set(0)
            for check in rep.checks():
                self.misconfigured.labels(t.pool, server, check).set(1)
        checks = rep.checks()
        if rep.facts is None:
            for x in self.registry.servers().get(server, []):
                x.state.misconfigured = checks
            return None
        return await self._apply(server, t, rep.facts, misconfigured=checks)

    def _due(self, server: str) -> bool:
        b = self._backoff.get(server)
        return b is None or self._n >= b[1]

    def _unreachable(self, server: str, e: Exception) -> None:
        """The server did not answer its poll; a refused connection (nothing listening) is told apart."""
        self._reachable[server] = False
        if isinstance(e, httpx.ConnectError):
            self._refused.add(server)
        else:
            self._refused.discard(server)

    def _failed(self, server: str, t: Target, reason: str) -> None:
        n, _, last = self._backoff.get(server, (0, 0, ""))
        wait = min(BACKOFF_MAX, 1 << n)
        self._backoff[server] = (n + 1, self._n + wait, reason)
        self._reachable[server] = False
        self._refused.discard(server)
        if reason != last:
            log.warning("replica %s of pool %s answers but its start-up read failed: %s (pool kind %s; retried after "
                        "1, 2, 4 ... up to %d polls)", server, t.pool, reason, t.kind, BACKOFF_MAX)

    async def _poll_vllm(self, server: str, targets: list[Target], info: bool) -> None:
        """Load from /metrics every poll; the preflight at start, after a reconnect and (backed off) after a failure."""
        t = targets[0]
        reconnect = not self._reachable.get(server, False)
        try:
            if reconnect:
                if not self._due(server):
                    return
                pool = self.pools.get(t.pool)
                if isinstance(pool, VLLMPool):
                    rep = await vllm_engine.inspect(self.client, pool, server, t.base_url, t.api_key)
                else:  # a registry built without the config (tests): the release only
                    rep = await vllm_engine.inspect(self.client, VLLMPool(name=t.pool, model=t.upstream_model,
                                                    replicas=[{"name": server, "url": t.base_url}]),  # type: ignore[list-item]
                                                    server, t.base_url, t.api_key, with_probe=False)
                if rep.facts is None:
                    reason = next((f.message for f in rep.findings if f.check == "reachable"), "no answer")
                    if "answered 404" in reason:
                        raise _Answered(reason)
                    raise httpx.ConnectError("refused") if rep.refused else httpx.ReadTimeout("unreachable")
                targets = await self._record(server, t, rep) or targets
            r = await self.gets.get(f"{t.base_url}/metrics", headers=self._headers(t), timeout=2.0)
            if r.status_code != 200:
                raise _Answered(f"/metrics answered {r.status_code}")
            view = vllm_engine.load_from_metrics(r.text)
            if view is None:
                raise _Answered("/metrics has no vllm:num_requests_running (not a vLLM server?)")
            self._reachable[server] = True
            self._refused.discard(server)
            self._backoff.pop(server, None)
            for x in targets:
                x.state.engine_load = view
        except _Answered as e:
            self._failed(server, t, str(e))
            for x in targets:
                x.state.engine_load = None
        except (httpx.HTTPError, ValueError) as e:
            self._unreachable(server, e)
            for x in targets:
                x.state.engine_load = None

    async def _server_info(self, server: str, t: Target) -> list[Target] | None:
        _, data = await preflight.server_info(self.gets, t.base_url, self._headers(t))
        if data is None:
            return None
        return await self._apply(server, t, preflight.ServerFacts.from_info(data))

    async def _apply(self, server: str, t: Target, f: preflight.ServerFacts, **extra: Any) -> list[Target]:
        """Split or merge the server's rank targets and record its facts; a new incarnation (the simulator's) drops
        the old prefix entries. Real SGLang has no incarnation id: a restart there is caught by the cached_tokens
        feedback (the engine reports fewer cached tokens than predicted and the stale entries are dropped)."""
        before = {x.name: x.index_key for x in self.registry.servers().get(server, [])}
        inc = f.incarnation or t.incarnation
        targets = self.registry.set_ranks(server, f.ranks, version=f.version, priority_scheduling=f.priority_scheduling,
                                          low_priority_values_first=f.low_priority_values_first,
                                          context_tokens=f.context_length, incarnation=inc, **extra)
        after = {x.index_key for x in targets}
        for name, key in before.items():
            if key not in after:
                if name == server and len(targets) > 1:
                    log.info("replica %s has %d data-parallel ranks: one target per rank", server, len(targets))
                elif inc != t.incarnation:
                    log.info("replica %s has a new incarnation %s: its prefix entries are dropped", name, inc)
                await self.facts.replica_replaced(key)
        if f.max_total_num_tokens:
            for x in targets:
                # per rank; a single target standing for several ranks (pinning off) holds all of them
                ranks = f.ranks if x.dp_rank is None else 1
                self.facts.replica_capacity(x.index_key, f.max_total_num_tokens * ranks // self.chunk_tokens)
        return targets


def _assign(targets: list[Target], rows: list[tuple[int, LoadView]] | None) -> None:
    """Each rank target gets its rank's row; a server-wide target gets the sum."""
    for t in targets:
        if rows is None:
            t.state.engine_load = None
        elif t.dp_rank is None:
            t.state.engine_load = LoadView(sum(v.queued_prefill_tokens for _, v in rows),
                                           sum(v.inflight for _, v in rows))
        else:
            t.state.engine_load = next((v for r, v in rows if r == t.dp_rank), None)


def _kv_usage(data: dict[str, Any]) -> dict[int, float]:
    """Rank -> the engine's KV-cache use (`token_usage`, 0..1, clamped: an engine's number is bounded before it is
    shown), for the console; ranks that do not report it are left out."""
    out = {}
    for i, x in enumerate(_objects(data.get("loads") or [])):
        u = x.get("token_usage")
        if isinstance(u, (int, float)) and u == u:
            out[int(x.get("dp_rank", i))] = min(max(float(u), 0.0), 1.0)
    return out


def _assign_kv(targets: list[Target], usage: dict[int, float] | None) -> None:
    """Each rank target its rank's use; a server-wide target the mean over its ranks."""
    for t in targets:
        if not usage:
            t.state.kv_usage = None
        elif t.dp_rank is None:
            t.state.kv_usage = sum(usage.values()) / len(usage)
        else:
            t.state.kv_usage = usage.get(t.dp_rank)


def _objects(items: Any) -> list[dict[str, Any]]:
    """The rows of a load answer; any other shape raises TypeError: the server is taken as not answering."""
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise TypeError(f"load rows of another shape: {type(items).__name__}")
    return items


def _rows_v1_loads(data: Any) -> list[tuple[int, LoadView]]:
    # 0.5.9 has no num_waiting_uncached_tokens: the prefill floor reads 0 there (the gateways' own count remains)
    if not isinstance(data, dict):
        raise TypeError(f"/v1/loads answered a JSON {type(data).__name__}, not an object")
    return [(int(x.get("dp_rank", i)), LoadView(float(x.get("num_waiting_uncached_tokens", 0)),
                                                float(x.get("num_running_reqs", 0) + x.get("num_waiting_reqs", 0))))
            for i, x in enumerate(_objects(data.get("loads") or []))]


def _rows_get_load(data: Any) -> list[tuple[int, LoadView]]:
    rows = _objects(data) if isinstance(data, list) else []
    return [(int(x.get("dp_rank", i)), LoadView(float(x.get("num_pending_tokens", 0)), float(x.get("num_reqs", 0))))
            for i, x in enumerate(rows)]

