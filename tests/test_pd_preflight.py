"""`gateway check` on a PD pool (pd_preflight.py): a well-formed deployment passes; each thing the two sides must
agree on (roles, bootstrap port, transfer backend, page size, prefill DP ranks, local prefill) is named when it is
wrong, on simulated SGLang prefill and decode servers started with it."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import yaml

from gateway.config import parse_config
from gateway.preflight import check_config
from tests.gateway_fixtures import config
from tests.support import env_without_proxies, free_port, start_pd_sims


@pytest.fixture(scope="module")
def sims():
    st, pre, dec, boots = start_pd_sims(1, 1, disaggregation_transfer_backend="mori")
    yield st, pre, dec, boots
    st.stop()


def pool(st, boots, **disagg) -> dict:
    prefill = {"name": "pre-0", "url": st.urls[0], "bootstrap_port": boots[0], **disagg.pop("prefill_extra", {})}
    return {"name": "pd", "kind": "sglang", "model": "zai-org/GLM-5.2",
            "replicas": [{"name": "dec-0", "url": st.urls[1]}], "disaggregation": {"prefill": [prefill], **disagg}}


def checks(cfg: dict) -> dict[str, list[str]]:
    reports = asyncio.run(check_config(parse_config(cfg)))
    return {r.server: r.checks() for r in reports}


def test_a_well_formed_pd_pool_passes(sims):
    st, _, _, boots = sims
    assert checks(config([pool(st, boots)])) == {"dec-0": [], "pre-0": []}


@pytest.mark.parametrize("change,server,check", [
    ({"transfer_backend": "nixl"}, "dec-0", "transfer_backend"),
    ({"prefill_extra": {"dp_size": 2}}, "pre-0", "pd_dp_size"),
    ({"local_prefill": True}, "dec-0", "local_prefill"),
])
def test_each_disagreement_is_named(sims, change, server, check):
    st, _, _, boots = sims
    assert check in checks(config([pool(st, boots, **change)]))[server]


def test_wrong_bootstrap_port_and_swapped_roles(sims):
    st, _, _, boots = sims
    wrong = checks(config([pool(st, [free_port()])]))
    assert wrong["pre-0"].count("bootstrap") == 2  # nothing listens there, and the server says another port
    swapped = pool(st, boots)
    swapped["replicas"][0]["url"], swapped["disaggregation"]["prefill"][0]["url"] = st.urls[0], st.urls[1]
    got = checks(config([swapped]))
    assert "pd_role" in got["dec-0"] and "pd_role" in got["pre-0"]


def test_page_sizes_must_match():
    st, _, _, boots = start_pd_sims(1, 1, decode_overrides={"page_size": 32}, disaggregation_transfer_backend="mori")
    try:
        got = checks(config([pool(st, boots)]))
        assert "pd_page_size" in got["dec-0"] and "pd_page_size" in got["pre-0"]
    finally:
        st.stop()


def test_gateway_check_cli_exits_1_and_names_the_check(sims, tmp_path):
    st, _, _, boots = sims
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(config([pool(st, boots, transfer_backend="mooncake")])))
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "check", "--config", str(path)], capture_output=True,
                         text=True, timeout=60, env=env_without_proxies())
    assert out.returncode == 1, out.stdout + out.stderr
    assert "pd/dec-0: transfer_backend" in out.stdout and "pd/pre-0: transfer_backend" in out.stdout
