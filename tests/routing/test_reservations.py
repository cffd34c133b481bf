"""Decision-time load reservations (routing/load.py: Reservations): requests that arrive together must not all
decide on the same loads. Each decision claims its target's load in the same synchronous step, the next decision
sees the claim, and the claim goes once the dispatch's own load is counted (or expires)."""

from __future__ import annotations

import asyncio

from gateway.prediction.ttft import LoadView
from gateway.routing.load import Reservations
from gateway.routing.request import RoutingRequest
from tests.routing.pipeline_fixtures import CHUNK, REPLICAS, pipeline_router


def _long(i: int) -> RoutingRequest:
    """A 60k-token prompt nobody holds: ~3.7 s of prefill alone, so nothing meets the 2.22 s SLA and the least
    (fleet-delay) TTFT decides: the replica with the least queued prefill."""
    hashes = tuple(i * 1000 + k for k in range(60_000 // CHUNK))
    return RoutingRequest(f"req-{i}", "t", "glm-5.2", "chat/completions", True, 60_000, 64, hashes, group_key=hashes[8])


def test_simultaneous_arrivals_spread_instead_of_herding() -> None:
    """Four long prompts decided at once (the trace delivers ~10 in the same millisecond): each sees the claims of
    the ones before it, so they take four replicas. Without the claims every one sees four idle replicas and all
    take the same one (the tie-break)."""
    router, route = pipeline_router()

    async def burst() -> list[str]:
        ds = await asyncio.gather(*(router.decide(_long(i), route) for i in range(4)))  # type: ignore[arg-type]
        return [d.chosen.name for d in ds]

    assert sorted(asyncio.run(burst())) == REPLICAS
    assert len(router.reservations) == 4

    router2, route2 = pipeline_router()
    router2.reservations.ttl_s = 0.0  # claims gone at once: the herding this prevents

    async def burst2() -> list[str]:
        ds = await asyncio.gather(*(router2.decide(_long(i), route2) for i in range(4)))  # type: ignore[arg-type]
        return [d.chosen.name for d in ds]

    assert len(set(asyncio.run(burst2()))) == 1


def test_a_dry_run_claims_nothing_and_a_release_drops_the_claim() -> None:
    router, route = pipeline_router()
    asyncio.run(router.decide(_long(1), route, dry_run=True))  # type: ignore[arg-type]
    assert len(router.reservations) == 0
    d = asyncio.run(router.decide(_long(1), route))  # type: ignore[arg-type]
    assert len(router.reservations) == 1
    router.reservations.release("req-1")
    assert len(router.reservations) == 0
    assert d.chosen is not None


def test_overlay_adds_live_claims_and_expires_old_ones() -> None:
    now = [100.0]
    r = Reservations(ttl_s=5.0, clock=lambda: now[0])
    r.reserve("a", "x", 1000)
    r.reserve("b", "x", 500)
    r.reserve("c", "y", 200)
    v = r.overlay({"x": LoadView(100, 1)})
    assert v["x"] == LoadView(1600, 3) and v["y"] == LoadView(200, 1)
    now[0] += 6
    assert r.overlay({"x": LoadView(100, 1)}) == {"x": LoadView(100, 1)} and len(r) == 0
