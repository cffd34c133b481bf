"""Secrets the config names by environment variable, resolved once, at start (`create_app`, `gateway check`).

A named variable that is unset or empty refuses the start with a ConfigError that names it: otherwise the gateway
would listen and fail later, request by request (a pool's upstream 401s) or silently (Redis unauthenticated, so every
shared-state call fails and limits fall back to per-instance shares). Values are only ever passed on, never logged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.config import ConfigError, GatewayConfig
from gateway.typed import sha256_hex_list


@dataclass(frozen=True)
class Secrets:
    pool_keys: dict[str, str | None] = field(default_factory=dict)  # pool -> its upstream API key (None: no key)
    redis_password: str | None = None
    admin_hashes: list[str] = field(default_factory=list)  # admin token digests: the config's and the env's


def _required(environ: Mapping[str, str], env: str, where: str) -> str:
    value = environ.get(env)
    if not value:
        raise ConfigError(f"{where}: ${env} is not set")
    return value


def pool_keys(config: GatewayConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    return {p.name: _required(environ, p.api_key_env, f"pools[{i}] ({p.name}).api_key_env") if p.api_key_env else None
            for i, p in enumerate(config.pools)}


def resolve(config: GatewayConfig, environ: Mapping[str, str] = os.environ) -> Secrets:
    env = config.routing.redis_password_env
    redis_password = _required(environ, env, "routing.redis_password_env") if env else None
    hashes_env = config.admin.token_hashes_env
    raw = [h.strip() for h in environ.get(hashes_env, "").split(",") if h.strip()] if hashes_env else []
    try:
        admin_hashes = config.admin.token_hashes + sha256_hex_list(raw)
    except ValueError as e:
        raise ConfigError(f"admin.token_hashes_env: ${hashes_env}: {e}") from None
    return Secrets(pool_keys(config, environ), redis_password, admin_hashes)
