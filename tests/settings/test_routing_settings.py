"""routing.policy: a name or a section with its own parameters, refused at load with the field's location when
it names no registered policy, misspells a parameter, or puts a policy's parameter beside `policy` (where the
default policy's parameters lived before each policy had its own section)."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, parse_config
from gateway.routing.registry import POLICIES
from tests.gateway_fixtures import config, sglang_pool

POOL = [sglang_pool("p", ["http://127.0.0.1:9"])]


def test_a_bare_name_takes_the_policys_defaults() -> None:
    cfg = parse_config(config(POOL, routing={"policy": "round_robin"}))
    assert cfg.routing.policy == POLICIES["round_robin"].params()
    assert parse_config(config(POOL)).routing.policy.type == "prefix_sla_cost"


def test_a_section_sets_the_policys_parameters() -> None:
    cfg = parse_config(config(POOL, routing={"policy": {"type": "prefix_sla_cost", "recompute_weight": 24}}))
    assert cfg.routing.policy.recompute_weight == 24  # type: ignore[attr-defined]


@pytest.mark.parametrize("routing, says", [
    ({"policy": "fastest"}, "routing.policy: Input tag 'fastest'"),
    ({"policy": {"type": "prefix_sla_cost", "recompute_wieght": 3}}, "routing.policy.recompute_wieght: Extra inputs"),
    ({"policy": {"type": "round_robin", "recompute_weight": 3}}, "routing.policy.recompute_weight: Extra inputs"),
    ({"policy": {"type": "prefix_sla_cost", "sla_headroom": 1.5}}, "routing.policy.sla_headroom: Input should be less"),
    ({"recompute_weight": 3}, "set it as routing.policy.recompute_weight"),
])
def test_errors_name_the_field(routing: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(config(POOL, routing=routing))
    assert says in str(e.value), str(e.value)
