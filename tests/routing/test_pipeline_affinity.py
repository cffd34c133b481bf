"""The stored-replica hint (RoutingRequest.affinity_hint): the hinted target counts as holding the previous turn's
prompt chunks, a floor under the prefix index's match, so a chain's next turn lands on the replica that served the
last one even when the index has forgotten it. The policy is unchanged: the hint only raises one match."""

from __future__ import annotations

import asyncio

from gateway.routing.pipeline import PipelineRouter
from gateway.routing.request import RoutingRequest
from tests.routing.pipeline_fixtures import CHUNK, REPLICAS, pipeline_router


def _req(conv: int, **kw: object) -> RoutingRequest:
    hashes = tuple(conv * 1000 + i for i in range(24))  # a 24-chunk prompt the (empty) index knows nothing of
    return RoutingRequest(f"r{conv}", "t", "glm-5.2", "chat/completions", False, 24 * CHUNK, 64, hashes,
                          group_key=hashes[8], **kw)  # type: ignore[arg-type]


def _first(router: PipelineRouter, route: object, req: RoutingRequest) -> str:
    # a dry run: nothing dispatched here, so no decision's reserved load may bear on the next (the load bound)
    return asyncio.run(router.decide(req, route, dry_run=True)).ranked[0].name  # type: ignore[arg-type]


def test_the_hinted_replica_wins_where_cold_placement_would_choose_another() -> None:
    router, route = pipeline_router()
    for conv in range(12):
        cold = _first(router, route, _req(conv))
        for other in (n for n in REPLICAS if n != cold):
            # the previous turn covered 20 of this turn's 24 chunks on `other`
            assert _first(router, route, _req(conv, affinity_hint=other, affinity_tokens=20 * CHUNK)) == other


def test_the_hint_travels_from_the_adapters_call() -> None:
    """The Responses adapter names the stored turn's replica in its Call (pipeline/call.py); the request path's routing
    request carries it, and decide treats it like the field (no ambient state: only the request that named it)."""
    from gateway.config import ModelRoute, parse_config
    from gateway.pipeline.call import Call
    from gateway.pipeline.decide import routing_request
    from gateway.pipeline.validation import validate
    from tests.gateway_fixtures import config, sglang_pool

    cfg = parse_config(config([sglang_pool("p", ["http://127.0.0.1:9"])]))
    parsed = validate({"model": "glm-5.2", "messages": [{"role": "user", "content": "hi"}]}, "chat/completions")

    def rreq(call: Call) -> RoutingRequest:
        route = ModelRoute(name="glm-5.2", pools=["p"])
        return routing_request(cfg.routing, "gid", cfg.tenants[0], "chat/completions", parsed, route.name, call)

    hinted = rreq(Call(api="responses", affinity=("p-1", 20 * CHUNK)))
    assert (hinted.affinity_hint, hinted.affinity_tokens) == ("p-1", 20 * CHUNK)
    assert rreq(Call()).affinity_hint is None
    router, route = pipeline_router()
    cold = _first(router, route, _req(1))
    other = next(n for n in REPLICAS if n != cold)
    assert _first(router, route, _req(1, affinity_hint=other, affinity_tokens=20 * CHUNK)) == other


def test_no_effect_without_a_covered_chunk_or_a_live_target() -> None:
    router, route = pipeline_router()
    cold = _first(router, route, _req(2))
    other = next(n for n in REPLICAS if n != cold)
    assert _first(router, route, _req(2, affinity_hint=other, affinity_tokens=CHUNK - 1)) == cold  # < one chunk
    assert _first(router, route, _req(2, affinity_hint="gone-replica", affinity_tokens=20 * CHUNK)) == cold


def test_the_hint_is_a_floor_never_lowering_what_the_index_knows() -> None:
    router, route = pipeline_router()
    req = _req(3)
    cold = _first(router, route, req)
    other = next(n for n in REPLICAS if n != cold)
    target = router.registry.get(cold)
    assert target is not None
    router.index.insert_sync(target.index_key, req.hashes, 600.0)  # type: ignore[attr-defined]
    # the index says `cold` holds all 24 chunks; a hint of 2 chunks on `other` cannot outweigh that
    assert _first(router, route, _req(3, affinity_hint=other, affinity_tokens=2 * CHUNK)) == cold
    assert router.hinted(_req(3, affinity_hint=cold, affinity_tokens=2 * CHUNK), [], {"k": 5}) == {"k": 5}
