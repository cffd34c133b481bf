"""The running tenant policies: swapped whole and atomically on reload (file change, admin API or a peer's reload
event); a directory that fails to load never replaces them — the error is kept for the admin API and logged."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from gateway.background import BackgroundTask
from gateway.config import GatewayConfig
from gateway.tenancy.identify import TenantIndex
from gateway.tenancy.policy_loader import PolicyError, PolicySet, parse_policies, snapshot

log = logging.getLogger("gateway.policies")


class PolicyStore:
    def __init__(self, cfg: GatewayConfig, on_reload: Callable[[str], None] | None = None) -> None:
        """Loads at once: a startup with an invalid policy directory fails (ConfigError) instead of serving none."""
        self.cfg = cfg
        self.source = cfg.policies
        self.on_reload = on_reload  # metrics hook: "ok" | "error"
        if self.source is None:
            self.current = PolicySet(tuple(cfg.tenants), "inline", "gateway config")
        else:
            files, fp = self._snapshot()
            self.current = parse_policies(files, fp, cfg, self.source.dir)
        self.index = TenantIndex(self.current.tenants)
        self.loaded_at = time.time()
        self.last_error: str | None = None
        self._failed_fingerprint: str | None = None
        self._watcher = BackgroundTask(self._watch, "policy-watch")

    def reload(self) -> PolicySet:
        """Re-read the directory; on success swap atomically and return the new set, else raise PolicyError and
        keep serving the old one."""
        if self.source is None:
            raise PolicyError("tenants are inline in the gateway config; there is no policy directory to reload")
        files, fp = self._snapshot()
        try:
            new = parse_policies(files, fp, self.cfg, self.source.dir)
        except PolicyError as e:
            self.last_error, self._failed_fingerprint = str(e), fp
            log.error("policy reload rejected; the running policy stays in force:\n%s", e)
            if self.on_reload:
                self.on_reload("error")
            raise
        self.current, self.index = new, TenantIndex(new.tenants)  # one assignment each, no await between
        self.loaded_at, self.last_error, self._failed_fingerprint = time.time(), None, None
        log.info("policies reloaded: %d tenants, fingerprint %s", len(new.tenants), new.fingerprint[:12])
        if self.on_reload:
            self.on_reload("ok")
        return new

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
            if fp not in (self.current.fingerprint, self._failed_fingerprint):
                try:
                    self.reload()
                except PolicyError:
                    pass  # reported by reload(); the old policy keeps serving

    def status(self) -> dict[str, object]:
        return {"source": self.current.source, "fingerprint": self.current.fingerprint, "tenants": len(self.current.tenants),
                "loaded_at": self.loaded_at, "last_error": self.last_error}
