"""Discovery and upkeep of every KV-event subscription of this gateway instance (one per SGLang server x DP rank).

Every instance subscribes to every publisher itself (PUB fans out; no shared state), as llm-d's active-active
replicas do. Endpoints come from `/server_info.kv_events` (0.5.13+: a wildcard host means the replica URL's host,
ports are the base + rank), from vLLM's `/kv_event_sources` (pool kind vllm), or, for 0.5.9, from
`routing.kv_events.static`. Servers are re-read every
`discovery_interval_s`: a new server, a changed descriptor or a dead subscription is (re)subscribed.
Each batch updates the rank's blocks, and its removals, flushes and restarts are applied to the approximate index
too (index keys of the targets that stand for that rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.backends import vllm_engine
from gateway.config import KvEventsSettings
from gateway.kvevents.blocks import Applied, RankBlocks
from gateway.kvevents.subscriber import Subscription
from gateway.kvevents.wire import Batch
from gateway.tokenizers import RequestTokenizer
from gateway.upstreams import Target, UpstreamRegistry

log = logging.getLogger("gateway.kvevents")

WILDCARDS = {"*", "0.0.0.0", "::", "[::]", ""}  # host names in a descriptor that mean "the replica URL's host"


@dataclass(frozen=True)
class Endpoints:
    host: str
    port_base: int
    replay_port_base: int | None
    topic: str
    dp_size: int
    block_size: int | None

    def pub(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.port_base + rank}"

    def replay(self, rank: int) -> str | None:
        return None if self.replay_port_base is None else f"tcp://{self.host}:{self.replay_port_base + rank}"


@dataclass
class RankState:
    server: str
    rank: int
    sub: Subscription
    blocks: RankBlocks = field(default_factory=RankBlocks)

    @property
    def healthy(self) -> bool:
        return self.sub.healthy

    @property
    def plain(self) -> bool:
        return self.sub.stats.encoding == "arrays"  # <= 0.5.13: no cache_salt, no adapter on the wire


SAMPLE_CHAT = [{"role": "system", "content": "You are a helpful assistant."},
               {"role": "user", "content": "Héllo, wörld! Count 1 2 3 and return {\"ok\": true}."}]


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def endpoints_from_descriptor(d: dict[str, Any], replica_url: str) -> Endpoints | None:
    if not isinstance(d, dict) or d.get("publisher") != "zmq" or not isinstance(d.get("endpoint_port_base"), int):
        return None
    host = str(d.get("endpoint_host") or "")
    if host in WILDCARDS:
        host = urlsplit(replica_url).hostname or "127.0.0.1"
    replay = d.get("replay_endpoint_port_base")
    return Endpoints(host, d["endpoint_port_base"], replay if isinstance(replay, int) else None, str(d.get("topic") or ""),
                     max(1, int(d.get("dp_size") or 1)), d.get("block_size") if isinstance(d.get("block_size"), int) else None)


class KvCorrections(Protocol):
    """What a rank's events change in the approximate index (`dispatch.feedback.Feedback`, the one writer)."""

    def kv_cleared(self, key: str) -> None: ...
    def kv_removed(self, key: str, hashes: Sequence[int]) -> None: ...


class KvEventsManager:
    def __init__(self, settings: KvEventsSettings, registry: UpstreamRegistry, http: httpx.AsyncClient,
                 tokenizer: RequestTokenizer | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.tokenizer_checks: dict[str, str] = {}  # server -> ok | mismatch: ... | unchecked: ...
        self.tool_layouts: dict[str, str] = {}  # server -> how it renders tools (a TOOL_LAYOUTS name) | why none
        self.index: Any = None  # the PreciseIndex (for its answer counts in metrics)
        self.hasher: Any = None  # the TokenPrefixHasher (its CPU time in metrics)
        self.registry = registry
        self.http = http
        # where corrections of the approximate index go: the routing state's one writer (dispatch/feedback.py),
        # wired by the app before start
        self.feedback: KvCorrections | None = None
        self.ctx = zmq.asyncio.Context()
        self.ranks: dict[tuple[str, int], RankState] = {}
        self.endpoints: dict[str, Endpoints] = {}
        self.problems: dict[str, str] = {}  # server -> why it has no subscription (shown in /readyz)
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.feedback is None:
            raise RuntimeError("KvEventsManager.feedback must be set before start: corrections would be lost")
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kv-events discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for st in list(self.ranks.values()):
            await st.sub.stop()
        self.ranks.clear()
        self.ctx.term()

    async def _loop(self) -> None:
        while True:
            try:
                await self.discover()
            except Exception:  # never let discovery die: the next round retries
                log.exception("KV-event discovery failed")
            await asyncio.sleep(self.settings.discovery_interval_s)

    # -- discovery ---------------------------------------------------------------------------------------------
    async def discover(self) -> None:
        servers = self.registry.servers()
        for server, targets in servers.items():
            ep = await self._endpoints(server, targets[0])
            if ep is None:
                continue
            want_bs = self.settings.block_size
            if ep.block_size is not None and ep.block_size != want_bs:
                self.problems[server] = (f"engine block_size {ep.block_size} != routing.kv_events.block_size {want_bs}: "
                                         "approximate routing for this replica")
                await self._drop_server(server)
                continue
            check = await self._check_tokenizer(server, targets[0])
            if check.startswith("mismatch"):
                self.problems[server] = f"tokenizer {check}: approximate routing for this replica"
                await self._drop_server(server)
                continue
            self.problems.pop(server, None)
            if self.endpoints.get(server) != ep:
                await self._drop_server(server)
                self.endpoints[server] = ep
            for rank in range(ep.dp_size):
                st = self.ranks.get((server, rank))
                if st is None or st.sub._task is None or st.sub._task.done():
                    if st is not None:
                        await st.sub.stop()
                    self._subscribe(server, rank, ep)
        for server in [s for s in self.endpoints if s not in servers]:
            await self._drop_server(server)

    async def _endpoints(self, server: str, t: Target) -> Endpoints | None:
        static = self.settings.static.get(server)
        if static is not None:
            host = urlsplit(static.endpoint).hostname or ""
            port = urlsplit(static.endpoint).port or 0
            replay = urlsplit(static.replay_endpoint).port if static.replay_endpoint else None
            return Endpoints(host, port, replay, static.topic, static.dp_size, None)
        if t.caps.engine_api == "vllm":
            return await self._vllm_endpoints(server, t)
        try:
            r = await self.http.get(f"{t.base_url}/server_info", timeout=2.0,
                                    headers={"Authorization": f"Bearer {t.api_key}"} if t.api_key else None)
            info = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        if not isinstance(info, dict):
            return self.endpoints.get(server)  # unreachable now: keep what we had (the subscription shows health)
        desc = info.get("kv_events")
        ep = endpoints_from_descriptor(desc, t.base_url) if isinstance(desc, dict) else None
        if ep is None:
            self.problems[server] = ("no kv_events in /server_info (events off, or SGLang < 0.5.13: set "
                                     "routing.kv_events.static): approximate routing for this replica")
        return ep

    async def _vllm_endpoints(self, server: str, t: Target) -> Endpoints | None:
        try:
            r = await self.http.get(f"{t.base_url}/kv_event_sources", timeout=2.0,
                                    headers={"Authorization": f"Bearer {t.api_key}"} if t.api_key else None)
            sources = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return self.endpoints.get(server)
        ranks = vllm_engine.endpoints_of(sources, t.base_url)
        if not ranks:
            self.problems[server] = ("no publisher in /kv_event_sources (start vLLM with --kv-events-config): "
                                     "approximate routing for this replica")
            return None
        _, pub, replay, topic = ranks[0]
        host, port = urlsplit(pub).hostname or "", urlsplit(pub).port or 0
        rport = urlsplit(replay).port if replay else None
        return Endpoints(host, port, rport, topic, len(ranks), None)  # vLLM offsets each rank's ports by its rank

    async def _check_tokenizer(self, server: str, t: Target) -> str:
        """Once per server: the engine's /v1/tokenize of a sample chat against ours (0.5.13+; `messages` there).
        A mismatch means our keys can never match its events: that replica is routed approximately. Then how it
        renders tools (_learn_tools)."""
        done = self.tokenizer_checks.get(server)
        if done is not None and not done.startswith("unchecked: unreachable"):
            return done
        if self.tokenizer is None or not self.settings.tokenizer.check_engine:
            result = "unchecked: disabled"
        else:
            status, tokens = await self._engine_tokenize(t, {"messages": SAMPLE_CHAT})
            if status is None:
                result = "unchecked: unreachable"
            elif tokens is None:
                result = f"unchecked: /v1/tokenize answered {status}"
            else:
                ours = self.tokenizer.encode_request("chat/completions", {"messages": SAMPLE_CHAT}).tolist()
                result = "ok" if ours == tokens else (f"mismatch: {len(ours)} ids here, {len(tokens)} from the engine, "
                                                      f"first difference at {_first_diff(ours, tokens)}")
            if result != "ok":
                log.warning("KV events: tokenizer check against %s: %s", server, result)
            else:
                await self._learn_tools(server, t)
        self.tokenizer_checks[server] = result
        return result

    async def _learn_tools(self, server: str, t: Target) -> None:
        """How the engine hands tools to its chat template differs by release (gateway/tokenizers/real.py,
        TOOL_LAYOUTS): the layout whose rendering of a probe with a tool gives the engine's own ids is adopted, so a
        request with tools is keyed (and counted) as the engine will see it. `tools` in health: the layout, or why
        none."""
        learn = getattr(self.tokenizer, "learn_tool_layout", None)
        if learn is None:
            return
        from gateway.tokenizers.real import TOOLS_PROBE  # the tokenizer with `learn_tool_layout` is that module's

        status, tokens = await self._engine_tokenize(t, TOOLS_PROBE)
        if tokens is None:
            self.tool_layouts[server] = f"unchecked: /v1/tokenize with tools answered {status}"
            return
        layout = learn(tokens)
        self.tool_layouts[server] = layout or "mismatch: no known layout renders the engine's ids"
        # one tokenizer keys every request: servers that render tools apart cannot all be matched
        others = {v for k, v in self.tool_layouts.items() if k != server and not v.startswith(("mismatch", "unchecked"))}
        if layout is None or others - {layout}:
            log.warning("KV events: tools as %s renders them: %s (requests with tools are keyed as %s; others: %s)",
                        server, self.tool_layouts[server], getattr(self.tokenizer, "tool_layout", None), sorted(others))

    async def _engine_tokenize(self, t: Target, body: dict[str, Any]) -> tuple[int | None, list[int] | None]:
        """The engine's token ids for a chat body: (status, ids), (None, None) when unreachable."""
        try:
            path = "/tokenize" if t.caps.engine_api == "vllm" else "/v1/tokenize"
            r = await self.http.post(f"{t.base_url}{path}", json={"model": t.upstream_model, **body}, timeout=5.0,
                                     headers={"Authorization": f"Bearer {t.api_key}"} if t.api_key else None)
            data = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None, None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        return r.status_code, tokens if isinstance(tokens, list) else None

    def _subscribe(self, server: str, rank: int, ep: Endpoints) -> None:
        holder: dict[str, RankState] = {}
        sub = Subscription(self.ctx, ep.pub(rank), ep.replay(rank), ep.topic,
                           on_batch=lambda b: self._on_batch(holder["st"], b),
                           on_reset=lambda why: self._on_reset(holder["st"], why))
        adopt = self.hasher.keys_before if self.hasher is not None else None  # places blocks under unseen parents
        st = holder["st"] = RankState(server, rank, sub, RankBlocks(page=ep.block_size or self.settings.block_size,
                                                                    adopt=adopt))
        self.ranks[(server, rank)] = st
        sub.start()

    async def _drop_server(self, server: str) -> None:
        for key in [k for k in self.ranks if k[0] == server]:
            await self.ranks.pop(key).sub.stop()
        self.endpoints.pop(server, None)

    # -- events -> blocks, and corrections of the approximate index --------------------------------------------
    def _targets_of(self, server: str, rank: int) -> list[str]:
        return [t.index_key for t in self.registry.servers().get(server, []) if t.dp_rank in (None, rank)]

    def _on_batch(self, st: RankState, batch: Batch) -> None:
        if batch.events and not batch.maps and self.hasher is not None:
            self.hasher.plain_needed = True  # namespaced requests get their plain keys too (request_keys.py)
        applied = st.blocks.apply(batch.events, Applied())
        if applied.cleared:
            self._correct(st, drop=True)
        if applied.removed:
            self._correct(st, removed=applied.removed)

    def _on_reset(self, st: RankState, why: str) -> None:
        st.blocks.clear()
        self._correct(st, drop=True)

    def _correct(self, st: RankState, drop: bool = False, removed: list[int] | None = None) -> None:
        fb = self.feedback
        if fb is None:
            return  # not started: nothing subscribes, so no event arrives
        for key in self._targets_of(st.server, st.rank):
            if drop:
                fb.kv_cleared(key)
            else:
                fb.kv_removed(key, removed or [])

    # -- what the index and the operators see -------------------------------------------------------------------
    def ranks_for(self, index_key: str) -> list[RankState] | None:
        name = index_key.rpartition("@")[0]
        t = next((x for x in self.registry.targets if x.name == name), None)
        if t is None or not t.caps.prefix_cache:
            return None
        ep = self.endpoints.get(t.server)
        if ep is None:
            return None
        ranks = range(ep.dp_size) if t.dp_rank is None else [t.dp_rank]
        out = [self.ranks.get((t.server, r)) for r in ranks]
        return None if any(x is None for x in out) else out  # type: ignore[return-value]

    def health(self) -> dict[str, Any]:
        subs = {f"{s}/rank{r}": {**st.sub.health(), "blocks": len(st.blocks), "orphans": st.blocks.orphans,
                                         "adoptions": st.blocks.adoptions, "partials": st.blocks.partials}
                for (s, r), st in sorted(self.ranks.items())}
        return {"subscriptions": subs, "unsubscribed": dict(self.problems), "tokenizer": dict(self.tokenizer_checks),
                "tools": dict(self.tool_layouts),
                "healthy": sum(1 for st in self.ranks.values() if st.healthy), "total": len(self.ranks)}

    def collector(self) -> KvEventsCollector:
        return KvEventsCollector(self)


class KvEventsCollector:
    """Per-subscription health as Prometheus series, read at scrape time."""

    def __init__(self, manager: KvEventsManager) -> None:
        self.m = manager

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        labels = ["server", "rank"]
        healthy = GaugeMetricFamily("gateway_kv_events_healthy", "1 while the subscription is connected and in "
                                    "sequence (else the replica is routed on the approximate index)", labels=labels)
        lag = GaugeMetricFamily("gateway_kv_events_lag_seconds", "Receive time minus the last batch's timestamp",
                                labels=labels)
        blocks = GaugeMetricFamily("gateway_kv_events_blocks", "Blocks the engine rank holds, per its events", labels=labels)
        counters = {name: CounterMetricFamily(f"gateway_kv_events_{name}", text, labels=labels) for name, text in (
            ("batches", "Event batches applied"), ("gaps", "Sequence gaps seen"),
            ("replayed_batches", "Batches recovered from the replay socket"),
            ("replay_failures", "Gaps that could not be replayed (the rank's view was dropped)"),
            ("resets", "Sequence restarts (engine restarts)"), ("disconnects", "Publisher connections lost"))}
        for (server, rank), st in sorted(self.m.ranks.items()):
            lv = [server, str(rank)]
            s = st.sub.stats
            healthy.add_metric(lv, 1.0 if st.healthy else 0.0)
            lag.add_metric(lv, s.lag_s)
            blocks.add_metric(lv, float(len(st.blocks)))
            for name, v in (("batches", s.batches), ("gaps", s.gaps), ("replayed_batches", s.replays),
                            ("replay_failures", s.replay_failures), ("resets", s.resets),
                            ("disconnects", s.disconnects)):
                counters[name].add_metric(lv, float(v))
        yield healthy
        yield lag
        yield blocks
        yield from counters.values()
        if self.m.index is not None:
            answers = CounterMetricFamily("gateway_kv_events_index_answers", "Per-replica prefix answers: from the "
                                          "events, or the approximate fallback (replica unsubscribed or unhealthy)",
                                          labels=["source"])
            for source, n in self.m.index.answers.items():
                answers.add_metric([source], float(n))
            yield answers
        if self.m.hasher is not None:
            cpu = CounterMetricFamily("gateway_request_tokenize_seconds", "CPU spent tokenizing and hashing requests "
                                      "for precise matching", labels=["tokenizer"])
            cpu.add_metric([self.m.hasher.tokenizer.name], self.m.hasher.cpu_s)
            yield cpu
