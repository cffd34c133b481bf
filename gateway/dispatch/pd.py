"""Dispatch to a prefill/decode-disaggregated SGLang pool: both legs of a request, as SGLang's PD router sends them.

The routing engine chose a decode server (a target of the pool). Here, per attempt on it:

1. the pair decision (`routing/pd.py`): the prefill rank (prefix affinity + prefill queue) and whether to
   disaggregate at all (`decide: auto` with decode servers that prefill locally);
2. unified: the request goes to the decode server alone, as to any SGLang server;
3. disaggregated: the same body, plus `bootstrap_host` (the prefill server's host), `bootstrap_port` (its
   `--disaggregation-bootstrap-port`) and `bootstrap_room` (minted here, 62 random bits moved so that
   room % dp_size is the chosen prefill rank: SGLang puts the room on that rank on both sides), goes to the prefill
   server (not streamed: its one-token answer is drained) and to the decode server (the client's answer) at once.

Failures, per leg. Before the commit point (the decode leg's first byte):
- the prefill leg fails (refused, 5xx, timeout): the decode leg is cancelled (its KV reservation freed), the prefill
  server's breaker records it, and the pair is tried again with another prefill rank (at most `prefill_attempts`);
  when none is left the attempt fails with `leg="prefill"`, which the dispatcher does not hold against the decode
  server;
- the decode leg fails: the prefill leg is cancelled and the decode server's failure goes to the dispatcher, which
  tries the next decode server with a fresh pair.
After the commit point, a leg failing ends the stream with an error event (the decode server aborts a request
whose KV never arrives). Whatever happens, the prefill load view (`queued_tokens`, `inflight`) is given back when
the leg ends.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import Counter as PromCounter

from gateway.backends.base import AttemptFailed, Backend, Opened, UpstreamCall
from gateway.circuit_breaker import CircuitBreaker
from gateway.config import GatewayConfig, SGLangPool
from gateway.pd_config import Disaggregation
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.routing.pd import DecodeView, PdChoice, PdRequest, PrefillView, decide, kv_fits, room_for_rank
from gateway.tokenizer import count_tokens
from gateway.upstreams import CAPABILITIES, Target, TargetState

PIN_FIELDS = ("data_parallel_rank", "routed_dp_rank")
PREFILL_ATTEMPTS = 2


@dataclass(eq=False)
class PrefillRank:
    """One DP rank of a prefill server as this instance sees it. `queued_tokens`/`inflight`: written here only."""

    name: str
    server: str
    rank: int
    dp_size: int
    bootstrap_host: str
    bootstrap_port: int
    target: Target  # its server's (breaker shared by its ranks)
    queued_tokens: float = 0.0
    inflight: int = 0


@dataclass
class PdPool:
    pool: SGLangPool
    cfg: Disaggregation
    ranks: list[PrefillRank]
    index: MemoryPrefixIndex
    branches: Counter[str] = field(default_factory=Counter)
    decode_kv: Counter[str] = field(default_factory=Counter)  # decode target -> KV of this instance's requests there

    def load(self) -> dict[str, dict[str, float]]:
        """The prefill load view (admin state, tests): what this instance has sent and not yet seen end."""
        return {r.name: {"queued_tokens": r.queued_tokens, "inflight": r.inflight} for r in self.ranks}


def build_pools(cfg: GatewayConfig, keys: dict[str, str | None] | None = None) -> dict[str, PdPool]:
    out: dict[str, PdPool] = {}
    cb = cfg.circuit_breaker
    for pool in cfg.pools:
        if not isinstance(pool, SGLangPool) or pool.disaggregation is None:
            continue
        d = pool.disaggregation
        ranks = []
        for srv in d.prefill:
            state = TargetState(CircuitBreaker(cb.failure_threshold, cb.cooldown_s), None)
            target = Target(pool.name, srv.name, "sglang", srv.url, f"{srv.url}/v1", pool.model,
                            (keys or {}).get(pool.name), pool.health_path, pool.timing, CAPABILITIES["sglang"], state)
            host = urlsplit(srv.url).hostname or "127.0.0.1"
            for k in range(srv.dp_size):
                name = srv.name if srv.dp_size == 1 else f"{srv.name}/dp{k}"
                ranks.append(PrefillRank(name, srv.name, k, srv.dp_size, host, srv.bootstrap_port, target))
        out[pool.name] = PdPool(pool, d, ranks, MemoryPrefixIndex())
    return out


class PdBackend:
    """The SGLang backend, with both legs for targets of a PD pool; any other target goes straight through."""

    def __init__(self, inner: Backend, cfg: GatewayConfig, keys: dict[str, str | None] | None = None,
                 metrics_registry: Any = None) -> None:
        self.inner = inner
        self.pools = build_pools(cfg, keys)
        self.chunk_tokens = cfg.routing.chunk_tokens
        self.sla_s = cfg.routing.ttft_sla_ms / 1000
        self.ttl_s = cfg.routing.residency_ttl_s
        self.decisions = PromCounter("gateway_pd_decisions", "PD pool pair decisions by branch (routing/pd.py)",
                                     ["pool", "branch"], registry=metrics_registry) if metrics_registry is not None and self.pools else None
        self.prefill_failures = PromCounter("gateway_pd_prefill_failures", "prefill legs that failed before the "
                                            "commit point", ["pool", "prefill"], registry=metrics_registry) \
            if metrics_registry is not None and self.pools else None

    async def open(self, target: Target, call: UpstreamCall) -> Opened:
        pd = self.pools.get(target.pool)
        if pd is None:
            return await self.inner.open(target, call)
        n, prompt = call.body.get("n"), call.body.get("prompt")
        if (isinstance(n, int) and n > 1) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)):
            if pd.cfg.local_prefill:
                self._count(pd, "unified_batch")
                return replace(await self.inner.open(target, call), choice="unified_batch")
            raise AttemptFailed("this pool serves prefill/decode disaggregated: one sequence per request (n = 1, one "
                                "prompt)", status=400, param="n")
        req = self._request(call)
        view = self._decode_view(target, req, pd)
        if not kv_fits(view, req.pd, pd.cfg):
            self._count(pd, "decode_kv_full")
            raise AttemptFailed(f"decode server {target.name} has too little free KV for this request's prompt and "
                                "output", status=503, overloaded=True, leg="decode_kv")
        need = req.pd.prompt_tokens + req.pd.output_tokens
        pd.decode_kv[target.name] += need  # released when the answer is closed, or the attempt fails
        try:
            opened = await self._open(pd, target, call, req, view)
        except BaseException:
            _release(pd.decode_kv, target.name, need)
            raise
        inner_close = opened.close

        async def close() -> None:
            try:
                await inner_close()
            finally:
                _release(pd.decode_kv, target.name, need)

        return replace(opened, close=close)

    def admin_state(self, pool: str) -> dict[str, Any] | None:
        """A PD pool's part of /admin/state: its prefill ranks (circuit, load view), this instance's KV count per
        decode server, and the decision's branch counts."""
        pd = self.pools.get(pool)
        if pd is None:
            return None
        return {"prefill": [{"name": r.name, "server": r.server, "bootstrap_port": r.bootstrap_port,
                             "circuit": r.target.breaker.state.value, "queued_tokens": round(r.queued_tokens),
                             "inflight": r.inflight} for r in pd.ranks],
                "decode_kv_tokens": dict(pd.decode_kv),
                "decide": pd.cfg.decide, "branches": dict(pd.branches)}


    async def _open(self, pd: PdPool, target: Target, call: UpstreamCall, req: _Req, view: DecodeView) -> Opened:
        tried: set[str] = set()
        last: AttemptFailed | None = None
        for _ in range(PREFILL_ATTEMPTS):
            choice = decide(req.pd, self._prefill_views(pd, req, tried), view, pd.cfg, target.timing)
            self._count(pd, choice.branch)
            if choice.branch == "no_prefill":
                break
            # what the answer's x-gateway-pd says: "<branch>" or "<branch>; prefill=<rank>"
            if not choice.disaggregate:
                return replace(await self.inner.open(target, call), choice=choice.branch)
            assert choice.prefill is not None
            rank = next(r for r in pd.ranks if r.name == choice.prefill.name)
            try:
                return replace(await self._pair(pd, rank, target, call, req, choice),
                               choice=f"{choice.branch}; prefill={rank.name}")
            except _PrefillFailed as e:
                tried.add(rank.name)
                last = e.error
        detail = f": {last.message}" if last is not None else ": no prefill server is available"
        raise AttemptFailed(f"the prefill leg of pool {target.pool} failed{detail}",
                            status=last.status if last is not None else 503, leg="prefill")

    # -- the decision's inputs -------------------------------------------------------------------------------
    def _request(self, call: UpstreamCall) -> _Req:
        rreq = call.routing  # the request as routed: prefix hashes, prompt estimate, the tenant's SLA
        if rreq is not None:
            prompt, hashes, sla = rreq.prompt_tokens, rreq.hashes, rreq.ttft_sla_s
            out = rreq.max_output_tokens
        else:
            prompt, hashes, sla, out = _estimate_prompt(call.body), (), self.sla_s, None
        body_max = call.body.get("max_tokens") or call.body.get("max_completion_tokens")
        output = out or (body_max if isinstance(body_max, int) and not isinstance(body_max, bool) else 1000)
        return _Req(PdRequest(prompt, max(1, output), sla), hashes)

    def _prefill_views(self, pd: PdPool, req: _Req, tried: set[str]) -> list[PrefillView]:
        matches = pd.index.match_sync(req.hashes, [r.name for r in pd.ranks]) if req.hashes else {}
        return [PrefillView(r.name, r.server, r.rank, min(req.pd.prompt_tokens, matches.get(r.name, 0) * self.chunk_tokens),
                            r.queued_tokens, r.name not in tried and r.target.breaker.available())
                for r in pd.ranks]

    def _decode_view(self, target: Target, req: _Req, pd: PdPool) -> DecodeView:
        """The decode server as this instance sees it: the engine's load row, and the KV (prompt + output cap) of the
        requests this instance has in flight there (the headroom check; the capacity is the pool timing's)."""
        load = target.engine_load
        t = target.timing
        return DecodeView(target.name, load.inflight if load else 0.0, t.max_running, t.kv_capacity_tokens,
                          pd.decode_kv.get(target.name, 0), load.queued_prefill_tokens if load else 0.0, 0, True)

    def _count(self, pd: PdPool, branch: str) -> None:
        pd.branches[branch] += 1
        if self.decisions is not None:
            self.decisions.labels(pd.pool.name, branch).inc()

    # -- both legs -------------------------------------------------------------------------------------------
    async def _pair(self, pd: PdPool, rank: PrefillRank, target: Target, call: UpstreamCall, req: _Req,
                    choice: PdChoice) -> Opened:
        room = room_for_rank(secrets.randbits(62), rank.rank, rank.dp_size)
        boot = {"bootstrap_host": rank.bootstrap_host, "bootstrap_port": rank.bootstrap_port, "bootstrap_room": room}
        decode_call = replace(call, body={**call.body, **boot})
        pbody = {k: v for k, v in call.body.items() if k not in PIN_FIELDS and k != "stream_options"}
        prefill_call = replace(call, body={**pbody, **boot, "stream": False}, stream=False)
        uncached = max(0, req.pd.prompt_tokens - (choice.prefill.cached_tokens if choice.prefill else 0))
        if not rank.target.breaker.acquire():
            raise _PrefillFailed(AttemptFailed(f"prefill server {rank.server}: breaker open",
                                               status=503, overloaded=True))
        rank.queued_tokens += uncached
        rank.inflight += 1
        leg = _PrefillLeg(self, pd, rank, uncached, req.hashes)
        prefill_task = asyncio.create_task(leg.run(prefill_call))
        decode_task = asyncio.create_task(self.inner.open(target, decode_call))
        try:
            await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task.done() and prefill_task.exception() is not None and \
                    (not decode_task.done() or decode_task.exception() is not None):
                # before the commit point: the decode server would wait for KV that never comes
                await _cancel(decode_task)
                raise _PrefillFailed(leg.error or AttemptFailed("prefill leg failed"))
            try:
                opened = await decode_task
            except AttemptFailed as e:
                if _kv_failure(e):  # the decode server says the KV never came: the prefill side failed first
                    raise _PrefillFailed(e) from None
                raise
        except BaseException:
            await _cancel(prefill_task)
            await _cancel(decode_task)
            raise

        async def close() -> None:
            try:
                await opened.close()
            finally:
                await _cancel(prefill_task)  # its answer is drained by now; if not, the leg ends here

        return replace(opened, close=close)


@dataclass(frozen=True)
class _Req:
    pd: PdRequest
    hashes: Sequence[int]


class _PrefillFailed(Exception):
    def __init__(self, error: AttemptFailed) -> None:
        super().__init__(error.message)
        self.error = error


class _PrefillLeg:
    """One prefill leg: its request, its breaker verdict, and the load it holds until it ends."""

    def __init__(self, backend: PdBackend, pd: PdPool, rank: PrefillRank, uncached: int, hashes: Sequence[int]) -> None:
        self.backend, self.pd, self.rank, self.uncached, self.hashes = backend, pd, rank, uncached, hashes
        self.error: AttemptFailed | None = None
        self.released = False

    async def run(self, call: UpstreamCall) -> None:
        b = self.rank.target.breaker
        try:
            opened = await self.backend.inner.open(self.rank.target, call)
            await opened.close()
        except AttemptFailed as e:
            self.error = e
            b.failure(None)
            if self.backend.prefill_failures is not None:
                self.backend.prefill_failures.labels(self.pd.pool.name, self.rank.server).inc()
            raise
        except BaseException:
            b.release()
            raise
        finally:
            self._release()
        b.success()
        if self.hashes:  # the prompt is in this rank's cache now
            self.pd.index.insert_sync(self.rank.name, self.hashes, self.backend.ttl_s)

    def _release(self) -> None:
        if not self.released:
            self.released = True
            self.rank.queued_tokens = max(0.0, self.rank.queued_tokens - self.uncached)
            self.rank.inflight -= 1


async def _cancel(task: asyncio.Task[Any]) -> None:
    """End a leg's task; an attempt it opened meanwhile is closed (which cancels that upstream request)."""
    if not task.done():
        task.cancel()
    try:
        res = await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # we are being cancelled ourselves (the client left): not the leg's ending to swallow
        return
    except Exception:  # noqa: BLE001 - the leg's own failure was recorded where it happened
        return
    if isinstance(res, Opened):
        await res.close()


def _release(counts: Counter[str], name: str, tokens: int) -> None:
    counts[name] -= tokens
    if counts[name] <= 0:
        del counts[name]


def _kv_failure(e: AttemptFailed) -> bool:
    """SGLang's decode-side aborts for a room whose KV did not arrive (transfer failed, bootstrap unreachable)."""
    m = e.message.lower()
    return "kv transfer" in m or "bootstrap" in m or "kvcache" in m


def _estimate_prompt(body: dict[str, Any]) -> int:
    msgs = body.get("messages")
    if isinstance(msgs, list):
        return sum(count_tokens(str(m.get("content") or "")) for m in msgs if isinstance(m, dict))
    p = body.get("prompt")
    return count_tokens(p) if isinstance(p, str) else 0


__all__ = ["PdBackend", "PdPool", "build_pools", "kv_fits"]
