"""The chaos suite's fast scenarios, end to end, as separate processes (two gateway instances, a private Redis,
three simulated replicas): poison bodies, content-caused failures, malformed HTTP, a concurrency burst, a budget and
rate burst, one x-request-id reused by 100 requests in sequence and at once, a header flood with 100 slowloris
connections, and a bounded fuzz of every endpoint (drawn bodies and 300 type confusions). The full suite (replica SIGKILL/hang/503, Redis down 30 s, SIGTERM) is
`python -m loadtests.chaos`; its table is in docs/results/2026-11-27-loadtests.md."""

from __future__ import annotations

import asyncio

import pytest

from loadtests import chaos
from loadtests.chaos_stack import Stack


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    yield s
    s.stop()


@pytest.mark.parametrize("scenario", ["poison", "content_failures", "edges", "burst_concurrency", "budget_burst",
                                      "reused_id", "header_flood", "fuzz"])
def test_chaos_scenario(stack, scenario):
    # a connect timeout for a machine whose cores are busy with other work: the scenarios judge the gateway's answers
    a = chaos.parse_args(["--quick", "--only", scenario, "--fuzz", "400", "--connect-timeout", "30"])
    results = asyncio.run(chaos.run(a, stack))
    t = results[scenario]
    assert t.check, chaos.table(results)
    assert t.sent > 0
