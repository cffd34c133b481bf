"""Applies the shared control state to this instance and carries admin changes to every instance.

An admin change is written to the store, audited, then announced on the event channel; every instance (the
writer included) re-reads the whole state on the announcement and applies it, so instances converge on what is
stored, whatever order messages arrive in. A periodic re-read covers messages lost while the channel was down.
Events that are actions rather than state (reload policies, flush a replica's prefix entries) are carried out by
each instance on receipt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.background import BackgroundTask
from gateway.control.state import ControlState, PoolOverride, TenantOverride
from gateway.control.store import ControlStore, StoreUnavailable
from gateway.policy_schema import Tenant
from gateway.upstreams import UpstreamRegistry

log = logging.getLogger("gateway.control")
Action = Callable[[dict[str, Any]], Awaitable[None]]


class ControlPlane:
    def __init__(self, store: ControlStore, registry: UpstreamRegistry, resync_s: float = 5.0,
                 actions: dict[str, Action] | None = None) -> None:
        self.store = store
        self.registry = registry
        self.resync_s = resync_s
        self.actions = actions or {}
        self.state = ControlState()
        self.applied_at = 0.0
        # what the config says, per configured server (a DP server's rank targets appear later and share it)
        self._base = {t.server: (t.pricing, t.weight) for t in registry.targets}
        self._listener = BackgroundTask(self._listen, "control-events")
        self._resyncer = BackgroundTask(self._resync_loop, "control-resync")

    # -- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        self._listener.start()
        self._resyncer.start()

    async def stop(self) -> None:
        await self._listener.stop()
        await self._resyncer.stop()

    async def refresh(self) -> None:
        try:
            state = await self.store.load()
        except StoreUnavailable as e:
            log.warning("%s; keeping the last known control state", e)
            return
        self.apply(state)

    def apply(self, state: ControlState) -> None:
        """Make this instance's registry match the state (drained flags, pool weights and prices)."""
        for t in self.registry.targets:
            pricing, weight = self._base[t.server]
            o = state.pools.get(t.pool)
            s = t.state
            s.drained = t.name in state.drained or t.server in state.drained  # draining a server drains its ranks
            s.weight = o.weight if o is not None and o.weight is not None else weight
            s.pricing = o.pricing if o is not None and o.pricing is not None else pricing
        self.state = state
        self.applied_at = time.time()

    async def _listen(self) -> None:
        async for ev in self.store.events():
            kind = ev.get("kind")
            try:
                if kind in ("changed", "resync"):
                    await self.refresh()
                elif kind in self.actions:
                    await self.actions[kind](ev)
            except Exception:  # one bad event must not stop this instance from hearing the next (logged)
                log.exception("control event %r failed on this instance", kind)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_s)
            await self.refresh()

    # -- changes (admin API) -------------------------------------------------------------------------------------
    async def change(self, who: str, what: str, detail: dict[str, Any], write: Awaitable[None] | None,
                     event: dict[str, Any] | None = None) -> None:
        """Persist (`write`), audit, announce. Raises StoreUnavailable, leaving nothing half-applied: a change that
        cannot reach every instance is refused rather than applied to this one only."""
        if write is not None:
            await write
        await self.store.audit({"at": time.time(), "who": who, "what": what, **detail})
        await self.store.publish(event or {"kind": "changed"})
        if event is None:
            await self.refresh()  # the writer applies at once, without waiting for its own message

    async def drain(self, who: str, replica: str, drained: bool) -> None:
        await self.change(who, "drain" if drained else "undrain", {"replica": replica},
                          self.store.set_drained(replica, drained))

    async def set_pool(self, who: str, pool: str, override: PoolOverride | None) -> None:
        detail = {"pool": pool, "override": override.model_dump(mode="json") if override else None}
        await self.change(who, "pool", detail, self.store.set_pool(pool, override))

    async def override_tenant(self, who: str, tenant: str, override: TenantOverride | None) -> None:
        detail = {"tenant": tenant, "override": override.model_dump(mode="json") if override else None}
        await self.change(who, "tenant_override", detail, self.store.set_tenant(tenant, override))

    # -- reads -------------------------------------------------------------------------------------------------
    def effective(self, tenant: Tenant) -> Tenant:
        """The tenant's policy with its live on-call override applied (SLA, objective, SLA-miss behaviour; the pin
        is read with `pinned_pool`)."""
        o = self.state.tenants.get(tenant.name)
        if o is None or not o.active():
            return tenant
        upd: dict[str, Any] = {k: v for k, v in (("ttft_sla_ms", o.ttft_sla_ms), ("objective", o.objective),
                                                 ("on_sla_miss", o.on_sla_miss)) if v is not None}
        return tenant.model_copy(update=upd) if upd else tenant

    def pinned_pool(self, tenant: str) -> str | None:
        o = self.state.tenants.get(tenant)
        return o.pin_pool if o is not None and o.active() else None
