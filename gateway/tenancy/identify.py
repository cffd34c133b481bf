"""API key -> tenant. Keys are compared as SHA-256 digests; the raw key is never stored, logged or traced."""

from __future__ import annotations

import hashlib

from gateway.config import GatewayConfig, Tenant
from gateway.errors import AuthenticationFailed


class TenantIndex:
    def __init__(self, cfg: GatewayConfig) -> None:
        self._by_hash: dict[str, Tenant] = {h: t for t in cfg.tenants for h in t.api_key_hashes}

    def identify(self, authorization: str | None) -> Tenant:
        if not authorization:
            raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.")
        tenant = self._by_hash.get(hashlib.sha256(key.strip().encode()).hexdigest())
        if tenant is None:
            raise AuthenticationFailed("Invalid API key.")
        return tenant
