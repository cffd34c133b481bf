"""The `disaggregation:` section of a pool (gateway/pd_config.py) is validated at load with errors that name the
field, the shipped PD example parses, and the PD recipe starts SGLang with the flags a PD pool needs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.config import ConfigError, parse_config
from tests.gateway_fixtures import config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def pd_pool(**disagg) -> dict:
    return {"name": "pd", "kind": "sglang", "model": "m", "replicas": [{"name": "d0", "url": "http://d0:30000"}],
            "disaggregation": {"prefill": [{"name": "p0", "url": "http://p0:30000"}], **disagg}}


def test_defaults():
    d = parse_config(config([pd_pool()])).pools[0].disaggregation
    assert d is not None
    assert (d.decide, d.transfer_backend, d.local_prefill, d.prefill[0].bootstrap_port, d.prefill[0].dp_size) == \
        ("auto", "mori", False, 8998, 1)


@pytest.mark.parametrize("change,where", [
    ({"decide": "sometimes"}, "pools[0].disaggregation.decide"),
    ({"transfer_backend": "tcp"}, "pools[0].disaggregation.transfer_backend"),
    ({"prefill": []}, "pools[0].disaggregation.prefill"),
    ({"prefill": [{"name": "p0", "url": "p0:30000"}]}, "pools[0].disaggregation.prefill[0].url"),
    ({"prefill": [{"name": "p0", "url": "http://p0", "bootstrap_port": 70000}]},
     "pools[0].disaggregation.prefill[0].bootstrap_port"),
    ({"prefill": [{"name": "p0", "url": "http://a"}, {"name": "p0", "url": "http://b"}]}, "duplicate names"),
    ({"links": {}}, "pools[0].disaggregation.links"),
])
def test_bad_sections_are_refused_naming_the_field(change, where):
    with pytest.raises(ConfigError) as e:
        parse_config(config([pd_pool(**change)]))
    assert where in str(e.value)


def test_a_prefill_server_named_like_a_replica_is_refused():
    with pytest.raises(ConfigError) as e:
        parse_config(config([pd_pool(prefill=[{"name": "d0", "url": "http://p0"}])]))
    assert "d0" in str(e.value)


def test_the_pd_example_parses():
    pools = yaml.safe_load((DEPLOY / "sglang" / "pd-pool.example.yaml").read_text())
    cfg = parse_config({**pools, "tenants": [{"name": "t", "api_key_hashes": ["0" * 64], "models": ["glm-5.2"]}]})
    d = cfg.pools[0].disaggregation
    assert d is not None and len(d.prefill) == 4 and d.decide == "always"


def _recipe(tmp_path: Path, role: str) -> subprocess.CompletedProcess[str]:
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir(exist_ok=True)
    shim.write_text('#!/bin/sh\necho "$@"\n')
    shim.chmod(0o755)
    env = {"PATH": f"{shim.parent}:/usr/bin:/bin", "ROLE": role, "IB_DEVICES": "rdma0,rdma1"}
    return subprocess.run(["bash", str(DEPLOY / "sglang" / "mi355x-glm52-pd.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)


def test_the_pd_recipe_gives_each_role_its_flags(tmp_path: Path):
    assert _recipe(tmp_path, "prefill").returncode == 0
    logs = [p.read_text() for p in sorted(tmp_path.glob("sglang-*.log"))]
    assert len(logs) == 2
    for g, argv in enumerate(logs):
        assert "--disaggregation-mode prefill" in argv and "--disaggregation-transfer-backend mori" in argv
        assert f"--disaggregation-bootstrap-port {8998 + g}" in argv and "--disaggregation-ib-device rdma0,rdma1" in argv
        assert "--enable-cache-report" in argv
    for p in tmp_path.glob("sglang-*.log"):
        p.unlink()
    assert _recipe(tmp_path, "decode").returncode == 0
    for argv in (p.read_text() for p in tmp_path.glob("sglang-*.log")):
        assert "--disaggregation-mode decode" in argv and "bootstrap-port" not in argv
    bad = _recipe(tmp_path, "both")
    assert bad.returncode == 2 and "ROLE must be" in bad.stderr
