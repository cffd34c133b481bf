"""API key -> tenant. Keys are compared as SHA-256 digests; the raw key is never stored, logged or traced."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from gateway.errors import AuthenticationFailed
from gateway.policy_schema import Tenant


class TenantIndex:
    def __init__(self, tenants: Iterable[Tenant]) -> None:
        self.tenants: dict[str, Tenant] = {t.name: t for t in tenants}
        self._by_hash: dict[str, Tenant] = {h: t for t in self.tenants.values() for h in t.api_key_hashes}

    def for_key(self, key: str) -> Tenant | None:
        """The tenant a raw key belongs to (compared as its SHA-256 digest), if any."""
        return self._by_hash.get(hashlib.sha256(key.strip().encode()).hexdigest())

    def identify(self, authorization: str | None) -> Tenant:
        if not authorization:
            raise AuthenticationFailed("You didn't provide an API key. Send it in an Authorization header using "
                                       "Bearer auth (Authorization: Bearer <key>).")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.")
        tenant = self.for_key(key)
        if tenant is None:
            # OpenAI's wording: clients (litellm among them) classify a 401 as an authentication error by this text
            raise AuthenticationFailed("Incorrect API key provided. Use a key issued for this gateway "
                                       "(the key is not echoed back).")
        return tenant
