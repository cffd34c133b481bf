"""Secrets named by environment variable are resolved when the app is built: a missing one fails the start with a
ConfigError naming the variable (never the first request), and the values reach only where they are used."""

import dataclasses
import subprocess
import sys

import pytest
import yaml

from gateway.app import create_app
from gateway.config import ConfigError, hash_key, parse_config
from gateway.secrets import resolve
from gateway.upstreams import UpstreamRegistry
from tests.support import env_without_proxies

ENV = "H10_TEST_UPSTREAM_KEY"


def cfg(**pool: object) -> dict:
    return {
        "models": [{"name": "glm-5.2", "pools": ["hosted"]}],
        "pools": [{"name": "hosted", "kind": "openai", "model": "m", "base_url": "http://127.0.0.1:1/v1", **pool}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_key("sk-t")], "models": ["glm-5.2"]}],
    }


@pytest.mark.parametrize("value", [None, ""])
def test_a_pools_missing_api_key_env_fails_the_start_naming_the_variable(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    config = parse_config(cfg(api_key_env=ENV))
    with pytest.raises(ConfigError, match=rf"pools\[0\] \(hosted\)\.api_key_env: \${ENV} is not set"):
        create_app(config)
    with pytest.raises(ConfigError, match=ENV):
        UpstreamRegistry(config)  # a registry built alone resolves the same way


def test_resolved_keys_reach_the_targets_and_nothing_is_read_later(monkeypatch):
    monkeypatch.setenv(ENV, "sk-upstream")
    config = parse_config(cfg(api_key_env=ENV))
    secrets = resolve(config)
    assert secrets.pool_keys == {"hosted": "sk-upstream"} and secrets.redis_password is None
    monkeypatch.delenv(ENV)  # read once: a registry built from the resolved keys needs no environment
    assert UpstreamRegistry(config, secrets.pool_keys).by_pool["hosted"][0].api_key == "sk-upstream"
    assert resolve(parse_config(cfg())).pool_keys == {"hosted": None}  # no api_key_env: no key, no error


def test_redis_password_and_admin_hashes_env_are_checked_at_start(monkeypatch):
    monkeypatch.delenv("H10_TEST_REDIS_PW", raising=False)
    with pytest.raises(ConfigError, match=r"routing.redis_password_env: \$H10_TEST_REDIS_PW is not set"):
        create_app(parse_config({**cfg(), "routing": {"redis_password_env": "H10_TEST_REDIS_PW"}}))
    monkeypatch.setenv("H10_TEST_ADMIN_HASHES", "not-a-digest")
    with pytest.raises(ConfigError, match=r"admin.token_hashes_env: \$H10_TEST_ADMIN_HASHES"):
        create_app(parse_config({**cfg(), "admin": {"token_hashes_env": "H10_TEST_ADMIN_HASHES"}}))


def test_a_target_is_immutable_and_its_live_state_is_one_object():
    t = UpstreamRegistry(parse_config(cfg())).by_pool["hosted"][0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.healthy = False  # type: ignore[misc]
    t.state.healthy = False  # the writer's way (HealthChecker)
    assert not t.healthy and not t.routable()
    assert not t.caps.prefix_cache and not t.caps.cache_salt and t.url("models") == "http://127.0.0.1:1/v1/models"


@pytest.mark.parametrize("command", ["serve", "check"])
def test_serve_and_check_refuse_to_start_naming_the_unset_variable(tmp_path, command):
    """`gateway serve` exits 2 with the config error before listening; `gateway check` says the same."""
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg(api_key_env=ENV)))
    env = {k: v for k, v in env_without_proxies().items() if k != ENV}
    args = [sys.executable, "-m", "gateway.cli", command, "--config", str(path)] + (["--port", "1"] if command == "serve"
                                                                                    else [])
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and f"${ENV} is not set" in r.stdout + r.stderr
