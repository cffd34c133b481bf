"""Applies the shared control state to this instance and carries admin changes to every instance.

An admin change is written to the store, audited, then announced on the event channel; every instance (the
writer included) re-reads the whole state on the announcement and applies it, so instances converge on what is
stored, whatever order messages arrive in. A periodic re-read covers messages lost while the channel was down.
Events that are actions rather than state (reload policies, flush a replica's prefix entries) are carried out by
each instance on receipt.

Every change is audited with who made it and the value before and after, read from the store at the moment of the
change, and with what would undo it (`undo`): `undo(id)` restores the before value only while the after value still
stands, so undoing never overwrites a later change. Live tenant policy changes are compare-and-set on a per-tenant
version: of two instances changing a tenant at once, one writes, the other re-reads and merges its change over the
winner's (or, when the caller named the version it saw, is refused with 409) — either way both are audited and no
write is lost. A policy file reload is audited too, once for the fleet (the first instance to see the new files).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.background import BackgroundTask
from gateway.control import history
from gateway.control.state import ControlState, LivePolicy, PoolOverride, TenantOverride
from gateway.control.store import AUDIT_MAX, ControlStore, StoreUnavailable
from gateway.errors import Conflict, GatewayError, InvalidRequest, NotFound
from gateway.observability.logging import log_event
from gateway.policy_schema import Tenant
from gateway.tenancy import live_policy
from gateway.tenancy.policy_loader import PolicySet
from gateway.tenancy.policy_store import PolicyStore
from gateway.upstreams import UpstreamRegistry

log = logging.getLogger("gateway.control")
Action = Callable[[dict[str, Any]], Awaitable[None]]
CAS_ATTEMPTS = 8  # re-reads when another instance keeps winning the compare-and-set; past it the caller retries
RELOAD_CLAIM_S = 600.0  # one audit entry per file change, however many instances notice it within this long


class ControlPlane:
    def __init__(self, store: ControlStore, registry: UpstreamRegistry, resync_s: float = 5.0,
                 actions: dict[str, Action] | None = None, policies: PolicyStore | None = None) -> None:
        self.store = store
        self.registry = registry
        self.policies = policies  # live tenant policy changes are laid over it (None: no tenant changes here)
        self._tasks: set[asyncio.Task[None]] = set()
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
        if self.policies is not None:
            self.policies.on_change = self._reloaded
        self._listener.start()
        self._resyncer.start()

    async def stop(self) -> None:
        await self._listener.stop()
        await self._resyncer.stop()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

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
        if self.policies is not None:
            self.policies.set_live({k: v.fields for k, v in state.policies.items()})
        log_changes(self.state, state)
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
    async def change(self, who: str, what: str, detail: dict[str, Any], write: Awaitable[Any] | None,
                     event: dict[str, Any] | None = None, *, before: Any = None, after: Any = None,
                     undo: dict[str, Any] | None = None, undo_of: int | None = None) -> dict[str, Any]:
        """Persist (`write`), audit, announce; returns the audit entry. Raises StoreUnavailable, leaving nothing
        half-applied: a change that cannot reach every instance is refused rather than applied to this one only."""
        if write is not None:
            await write
        entry: dict[str, Any] = {"at": time.time(), "who": who, "what": what, **detail}
        if before is not None or after is not None:
            entry.update(before=before, after=after)
        if undo is not None:
            entry["undo"] = undo
        if undo_of is not None:
            entry["undo_of"] = undo_of
        entry = await self.store.audit(entry)
        await self.store.publish(event or {"kind": "changed"})
        if event is None:
            await self.refresh()  # the writer applies at once, without waiting for its own message
        return entry

    async def drain(self, who: str, replica: str, drained: bool, *, expect: bool | None = None,
                    undo_of: int | None = None) -> dict[str, Any]:
        """`expect` (an undo): the drained flag the change being undone set; refused if it no longer stands. The flag
        a drain replaced is read in the same step that writes it, so two concurrent drains audit true befores."""
        if expect is not None and (replica in (await self.store.load()).drained) != expect:
            raise Conflict(f"{replica} is {'not drained' if expect else 'drained'} now; it changed since.",
                           param="id")
        before = await self.store.set_drained(replica, drained)
        return await self.change(who, "drain" if drained else "undrain", {"replica": replica}, None,
                                 before={"drained": before}, after={"drained": drained},
                                 undo={"kind": "drain", "replica": replica, "drained": before}, undo_of=undo_of)

    async def set_pool(self, who: str, pool: str, override: PoolOverride | None, *, expect: Any = history.ANY,
                       undo_of: int | None = None) -> dict[str, Any]:
        """Compare-and-set on the override read: of two instances changing a pool at once, the second writes over
        the first's value and audits it as its before (nothing lost, undo stays exact)."""
        after = override.model_dump(mode="json") if override else None
        for _ in range(CAS_ATTEMPTS):
            cur = (await self.store.load()).pools.get(pool)
            before = cur.model_dump(mode="json") if cur else None
            if expect is not history.ANY and before != expect:
                raise Conflict(f"Pool {pool!r}'s override changed since; it is now {before}.", param="id")
            if await self.store.cas_pool(pool, cur, override):
                return await self.change(who, "pool", {"pool": pool, "override": after}, None,
                                         before={"override": before}, after={"override": after},
                                         undo={"kind": "pool", "pool": pool, "override": before}, undo_of=undo_of)
        raise Conflict(f"Pool {pool!r} is being changed by others faster than this change could apply; retry.",
                       param="pool", retry_after=1)

    async def override_tenant(self, who: str, tenant: str, override: TenantOverride | None, *,
                              expect: Any = history.ANY, undo_of: int | None = None) -> dict[str, Any]:
        after = override.model_dump(mode="json") if override else None
        for _ in range(CAS_ATTEMPTS):
            cur = (await self.store.load()).tenants.get(tenant)  # lapsed overrides are not loaded: None
            before = cur.model_dump(mode="json") if cur else None
            if expect is not history.ANY and before != expect:
                raise Conflict(f"Tenant {tenant!r}'s override changed (or lapsed) since; it is now {before}.",
                               param="id")
            if await self.store.cas_tenant(tenant, cur, override):
                return await self.change(who, "tenant_override", {"tenant": tenant, "override": after}, None,
                                         before={"override": before}, after={"override": after},
                                         undo={"kind": "tenant_override", "tenant": tenant, "override": before},
                                         undo_of=undo_of)
        raise Conflict(f"Tenant {tenant!r}'s override is being changed by others faster than this change could "
                       "apply; retry.", param="tenant", retry_after=1)

    async def set_policy(self, who: str, tenant: str, fields: dict[str, Any], *, if_version: int | None = None,
                         replace: bool = False, undo_of: int | None = None) -> dict[str, Any]:
        """Change a tenant's live policy: `fields` merged over its current live change (`replace`: instead of it),
        validated over its policy file's tenant like a policy file, then compare-and-set on the version read.
        `if_version`: the version the caller computed its change from; if it moved, 409 (and audited)."""
        if self.policies is None:
            raise Conflict("This instance has no tenant policies to change.", param="tenant")
        base = self.policies.base(tenant)
        if base is None:
            raise NotFound(f"Unknown tenant {tenant!r}.", param="tenant")
        for _ in range(CAS_ATTEMPTS):
            cur = (await self.store.load()).policies.get(tenant) or LivePolicy()
            if if_version is not None and cur.version != if_version:
                await self._refused(who, tenant, fields, if_version, cur.version)
            try:
                new_fields = fields if replace else live_policy.combine(cur.fields, fields)
                after_t = live_policy.apply(self.policies.cfg, base, new_fields)
            except live_policy.LivePolicyError as e:
                raise InvalidRequest(f"{e}; nothing was applied.", param=e.field) from None
            try:
                before_t = live_policy.apply(self.policies.cfg, base, cur.fields)
            except live_policy.LivePolicyError:
                before_t = base  # a stored change the files no longer accept: the files' tenant is what serves
            stored = await self.store.cas_policy(tenant, cur.version, new_fields)
            if stored is None:
                if if_version is not None:
                    await self._refused(who, tenant, fields, if_version, None)
                continue  # another instance wrote first: merge over what it wrote
            changed = live_policy.diff(live_policy.view(before_t), live_policy.view(after_t))
            return await self.change(
                who, "tenant_policy", {"tenant": tenant, "version": stored.version, "fields": fields},
                None, before={k: v[0] for k, v in changed.items()}, after={k: v[1] for k, v in changed.items()},
                undo={"kind": "tenant_policy", "tenant": tenant, "fields": cur.fields, "expect": new_fields},
                undo_of=undo_of)
        raise Conflict(f"Tenant {tenant!r} is being changed by others faster than this change could apply; retry.",
                       param="tenant", retry_after=1)

    async def _refused(self, who: str, tenant: str, fields: dict[str, Any], seen: int, now: int | None) -> None:
        await self.store.audit({"at": time.time(), "who": who, "what": "tenant_policy_refused", "tenant": tenant,
                                "fields": fields, "reason": f"computed from version {seen}; another change won"})
        raise Conflict(f"Tenant {tenant!r} changed since version {seen}"
                       + (f" (now {now})" if now is not None else "") + "; nothing was applied. Re-read and retry.",
                       param="if_version")

    async def undo(self, who: str, entry_id: int | None) -> dict[str, Any]:
        """Put back what entry `entry_id` (default: the newest change not yet undone) replaced, if what it set still
        stands; the undo is itself an audited change (`undo_of`)."""
        entry = history.pick(await self.store.audit_log(AUDIT_MAX), entry_id)
        u, after, eid = entry["undo"], entry.get("after") or {}, int(entry["id"])
        kind = u["kind"]
        if kind == "drain":
            return await self.drain(who, u["replica"], bool(u["drained"]), expect=bool(after.get("drained")),
                                    undo_of=eid)
        if kind == "pool":
            o = PoolOverride.model_validate(u["override"]) if u["override"] else None
            return await self.set_pool(who, u["pool"], o, expect=after.get("override"), undo_of=eid)
        if kind == "tenant_override":
            t = TenantOverride.model_validate(u["override"]) if u["override"] else None
            return await self.override_tenant(who, u["tenant"], t if t is None or t.active() else None,
                                              expect=after.get("override"), undo_of=eid)
        if kind == "tenant_policy":
            cur = (await self.store.load()).policies.get(u["tenant"]) or LivePolicy()
            if cur.fields != u["expect"]:
                raise Conflict(f"Tenant {u['tenant']!r}'s live change has changed since entry {eid}; undo the later "
                               "change first (see the history).", param="id")
            return await self.set_policy(who, u["tenant"], u["fields"], if_version=cur.version, replace=True,
                                         undo_of=eid)
        raise Conflict(f"Audit entry {eid} ({entry.get('what')}) cannot be undone here.", param="id")

    # -- policy file reloads -----------------------------------------------------------------------------------
    def _reloaded(self, old: PolicySet, new: PolicySet, actor: str) -> None:
        task = asyncio.get_running_loop().create_task(self._audit_reload(old, new, actor))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _audit_reload(self, old: PolicySet, new: PolicySet, actor: str) -> None:
        before, after = history.policy_diff(old.tenants, new.tenants)
        try:
            if await self.store.claim(f"reload:{old.fingerprint}:{new.fingerprint}", RELOAD_CLAIM_S):
                await self.store.audit({"at": time.time(), "who": actor, "what": "policy_reload",
                                        "fingerprint": [old.fingerprint[:12], new.fingerprint[:12]],
                                        "before": before, "after": after})
        except StoreUnavailable as e:
            log.warning("policy reload not audited: %s", e)

    # -- reads -------------------------------------------------------------------------------------------------
    def effective(self, tenant: Tenant) -> Tenant:
        """The tenant's policy with its live on-call override applied (SLA, objective, SLA-miss behaviour, flow
        control band and weight; the pin is read with `pinned_pool`)."""
        o = self.state.tenants.get(tenant.name)
        if o is None or not o.active():
            return tenant
        upd: dict[str, Any] = {k: v for k, v in (("ttft_sla_ms", o.ttft_sla_ms), ("objective", o.objective),
                                                 ("on_sla_miss", o.on_sla_miss)) if v is not None}
        flow = {k: v for k, v in (("band", o.flow_band), ("weight", o.flow_weight)) if v is not None}
        if flow:  # flow control's band and weight, changed live (docs/flow-control.md)
            upd["flow"] = tenant.flow.model_copy(update=flow)
        return tenant.model_copy(update=upd) if upd else tenant

    def name_override(self, tenant: str, err: GatewayError) -> GatewayError:
        """A capacity refusal (503) for a tenant under a live on-call override or a live change of its pools says
        so, naming it: it narrowed where the request could go (a pin, a tighter SLA, shedding, fewer pools), and the
        on-call who set it must recognise their own change in the refusal (also in `x-gateway-override`)."""
        if err.status != 503:
            return err
        named = []
        o = self.state.tenants.get(tenant)
        if o is not None and o.active():
            what = ", ".join(f"{k}={v}" for k, v in o.model_dump(exclude_none=True).items() if k != "expires_at")
            until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(o.expires_at))
            named.append(f"an on-call override of tenant '{tenant}' ({what}; until {until}; "
                         f"`gateway admin override {tenant} --clear` lifts it)")
        live = self.state.policies.get(tenant)
        if live is not None and "pools" in live.fields:
            named.append(f"a live policy change of tenant '{tenant}' (pools={live.fields['pools']}; "
                         f"`gateway admin tenant {tenant} --clear` drops it)")
        if named:
            err.message = f"{err.message} In force: {'; '.join(named)}."
            err.args = (err.message,)
            err.extra_headers = {**err.extra_headers, "x-gateway-override": "; ".join(named)[:512]}
        return err

    def pinned_pool(self, tenant: str) -> str | None:
        o = self.state.tenants.get(tenant)
        return o.pin_pool if o is not None and o.active() else None


def log_changes(old: ControlState, new: ControlState) -> None:
    """What this instance now applies differently, one event line per change (`drain`, `pool_override`
    and `override` — `name` the pool or the tenant): every instance logs what it applied, so each one's log says when the change reached it."""
    for name in sorted(new.drained ^ old.drained):
        log_event("drain", replica=name, drained=name in new.drained)
    for kind, before, after in (("pool_override", old.pools, new.pools), ("override", old.tenants, new.tenants)):
        for name in sorted(before.keys() | after.keys()):
            b, a = before.get(name), after.get(name)
            if b != a:
                log_event(kind, name=name, override=a.model_dump(mode="json", exclude_none=True) if a else None,
                          was=b.model_dump(mode="json", exclude_none=True) if b else None)
