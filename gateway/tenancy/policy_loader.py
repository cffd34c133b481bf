"""Read a policy directory into validated tenants: parse (YAML) -> merge over defaults -> validate (pydantic,
unknown fields rejected) -> cross-check against the gateway config. Every error names the file and the field:
`tenants/acme.yaml: rate_limits.requests_per_minute: Input should be greater than or equal to 1`.

Layout: `<dir>/defaults.yaml` (optional) and `<dir>/tenants/<name>.yaml`, one per tenant; the file's stem is the
tenant's name.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.config import ConfigError, GatewayConfig, check_tenants, error_location
from gateway.policy_schema import PolicyDefaults, Tenant


class PolicyError(ConfigError):
    """A policy directory that cannot be used; the running policy stays in force."""


@dataclass(frozen=True)
class PolicySet:
    tenants: tuple[Tenant, ...]
    fingerprint: str  # sha256 over file names and contents: changes iff the directory's policy text changes
    source: str


def snapshot(root: Path, tenants_dir: Path | None = None) -> tuple[dict[str, bytes], str]:
    """(relative path -> bytes, fingerprint) of the policy files. Reads through symlinks, as a Kubernetes ConfigMap
    mount swaps a `..data` link on update (its dot-named entries are skipped)."""
    files: dict[str, bytes] = {}
    defaults = root / "defaults.yaml"
    if defaults.is_file():
        files["defaults.yaml"] = defaults.read_bytes()
    tdir = tenants_dir or root / "tenants"
    if tdir.is_dir():
        for f in sorted(tdir.iterdir()):
            if f.suffix in (".yaml", ".yml") and not f.name.startswith(".") and f.is_file():
                files[f"tenants/{f.name}"] = f.read_bytes()
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return files, h.hexdigest()


def _yaml_mapping(name: str, data: bytes) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(data) or {}
    except yaml.YAMLError as e:
        raise PolicyError(f"{name}: invalid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise PolicyError(f"{name}: (root): expected a mapping of fields")
    return doc


def _validation_error(name: str, e: ValidationError) -> PolicyError:
    return PolicyError("\n".join(f"{name}: {error_location(err)}: {err['msg']}" for err in e.errors()))


def merge(defaults: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """A tenant's own values win field by field; nested sections (rate_limits, budget, cache) merge by key;
    lists replace."""
    out = dict(defaults)
    for k, v in own.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_policies(files: dict[str, bytes], fingerprint: str, cfg: GatewayConfig, source: str) -> PolicySet:
    defaults: dict[str, Any] = {}
    if "defaults.yaml" in files:
        defaults = _yaml_mapping("defaults.yaml", files["defaults.yaml"])
        try:  # validated alone too, so an error in it is reported against it, not against every tenant
            PolicyDefaults.model_validate(defaults)
        except ValidationError as e:
            raise _validation_error("defaults.yaml", e) from None
    tenants, where = [], []
    for name, data in files.items():
        if not name.startswith("tenants/"):
            continue
        own = _yaml_mapping(name, data)
        stem = Path(name).stem
        if own.get("name", stem) != stem:
            raise PolicyError(f"{name}: name: must match the file name ({stem!r}) or be left out")
        try:
            tenants.append(Tenant.model_validate({**merge(defaults, own), "name": stem}))
        except ValidationError as e:
            raise _validation_error(name, e) from None
        where.append(f"{name}: ")
    if not tenants:
        raise PolicyError(f"{source}: no tenant files under tenants/")
    try:
        check_tenants(cfg, tenants, where)
    except ValueError as e:
        raise PolicyError(str(e)) from None
    return PolicySet(tuple(tenants), fingerprint, source)


def load_policies(root: str | Path, cfg: GatewayConfig, tenants_dir: str | Path | None = None) -> PolicySet:
    path = Path(root)
    if not path.is_dir():
        raise PolicyError(f"{path}: policy directory not found")
    files, fp = snapshot(path, Path(tenants_dir) if tenants_dir else None)
    return parse_policies(files, fp, cfg, str(path))
