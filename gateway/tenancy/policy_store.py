"""The running tenant policies: swapped whole and atomically on reload (file change, admin API or a peer's reload
event); a directory that fails to load never replaces them — the error is kept for the admin API and logged.

Live changes (`tenancy/live_policy.py`, stored and shared by the control plane) are laid over the files' tenants
in `index`, the one view the request path reads; `current` stays what the files say. A live change that no longer
fits a reloaded file (say the file dropped a pool the change names) is set aside for that tenant, reported in
`live_errors`, and the file's tenant serves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.background import BackgroundTask
from gateway.config import GatewayConfig
from gateway.observability.logging import log_event
from gateway.policy_schema import Tenant
from gateway.tenancy.identify import TenantIndex
from gateway.tenancy.live_policy import LivePolicyError, apply
from gateway.tenancy.policy_loader import PolicyError, PolicySet, parse_policies, snapshot

log = logging.getLogger("gateway.policies")


class PolicyStore:
    def __init__(self, cfg: GatewayConfig, on_reload: Callable[[str], None] | None = None) -> None:
        """Loads at once: a startup with an invalid policy directory fails (ConfigError) instead of serving none."""
        self.cfg = cfg
        self.source = cfg.policies
        self.on_reload = on_reload  # metrics hook: "ok" | "error"
        # called after every reload that changed the files, with (before, after, actor): the control plane audits it
        self.on_change: Callable[[PolicySet, PolicySet, str], None] | None = None
        self.live: dict[str, dict[str, Any]] = {}  # tenant -> live fields, as last applied
        self.live_errors: dict[str, str] = {}
        if self.source is None:
            self.current = PolicySet(tuple(cfg.tenants), "inline", "gateway config")
        else:
            files, fp = self._snapshot()
            self.current = parse_policies(files, fp, cfg, self.source.dir)
        self.index = self._effective(self.current.tenants)
        self.loaded_at = time.time()
        self.last_error: str | None = None
        self._failed_fingerprint: str | None = None
        self._watcher = BackgroundTask(self._watch, "policy-watch")

    def reload(self, actor: str = "policy-file") -> PolicySet:
        """Re-read the directory; on success swap atomically and return the new set, else raise PolicyError and
        keep serving the old one. `actor`: who asked (the file watcher, an admin, a peer's event), for the audit log."""
        if self.source is None:
            raise PolicyError("tenants are inline in the gateway config; there is no policy directory to reload")
        files, fp = self._snapshot()
        try:
            new = parse_policies(files, fp, self.cfg, self.source.dir)
        except PolicyError as e:
            self.last_error, self._failed_fingerprint = str(e), fp
            # the running policy stays in force; the error (file and field) is the event's, folded on one line
            log_event("policy_error", logging.ERROR, error=str(e), kept_fingerprint=self.current.fingerprint[:12])
            if self.on_reload:
                self.on_reload("error")
            raise
        old = self.current
        self.current, self.index = new, self._effective(new.tenants)  # one assignment each, no await between
        failed_before = self.last_error is not None
        self.loaded_at, self.last_error, self._failed_fingerprint = time.time(), None, None
        log_event("policy_reload", logging.INFO, tenants=len(new.tenants), fingerprint=new.fingerprint[:12])
        if failed_before:
            log_event("policy_recovered", logging.WARNING, fingerprint=new.fingerprint[:12], how="reloaded")
        if self.on_reload:
            self.on_reload("ok")
        if self.on_change and old.fingerprint != new.fingerprint:
            self.on_change(old, new, actor)
        return new

    # -- live changes --------------------------------------------------------------------------------------------
    def base(self, name: str) -> Tenant | None:
        """The tenant as the policy files define it (no live change)."""
        return next((t for t in self.current.tenants if t.name == name), None)

    def set_live(self, live: dict[str, dict[str, Any]]) -> None:
        """Lay the control plane's live changes over the files' tenants (a no-op when they are unchanged)."""
        live = {k: v for k, v in live.items() if v}
        if live != self.live:
            self.live = live
            self.index = self._effective(self.current.tenants)

    def _effective(self, tenants: tuple[Tenant, ...]) -> TenantIndex:
        errors, out = {}, []
        for t in tenants:
            fields = self.live.get(t.name)
            try:
                out.append(apply(self.cfg, t, fields) if fields else t)
            except LivePolicyError as e:
                errors[t.name] = str(e)
                log_event("policy_error", logging.ERROR, tenant=t.name, error=str(e), source="live change",
                          serving="the policy file's values")
                out.append(t)
        self.live_errors = errors
        return TenantIndex(out)

    def _snapshot(self) -> tuple[dict[str, bytes], str]:
        assert self.source is not None
        return snapshot(Path(self.source.dir), Path(self.source.tenants_dir) if self.source.tenants_dir else None)

    def start(self) -> None:
        if self.source is not None:
            self._watcher.start()

    async def stop(self) -> None:
        await self._watcher.stop()

    async def _watch(self) -> None:
        assert self.source is not None
        while True:
            await asyncio.sleep(self.source.watch_interval_s)
            try:
                _, fp = self._snapshot()
            except OSError as e:  # a directory being replaced (ConfigMap swap) may be briefly unreadable
                log.warning("policy directory unreadable (%s); will look again", e)
                continue
            if fp == self.current.fingerprint and self.last_error is not None:
                # the bad edit was reverted: the files are the running policy again, so its error no longer holds
                self.last_error, self._failed_fingerprint = None, None
                log_event("policy_recovered", logging.WARNING, fingerprint=fp[:12], how="reverted to the running policy")
            elif fp not in (self.current.fingerprint, self._failed_fingerprint):
                try:
                    self.reload()
                except PolicyError:
                    pass  # reported by reload(); the old policy keeps serving

    def status(self) -> dict[str, object]:
        return {"source": self.current.source, "fingerprint": self.current.fingerprint, "tenants": len(self.current.tenants),
                "loaded_at": self.loaded_at, "last_error": self.last_error}
