"""A PipelineRouter over one 4-replica MI355X pool with in-memory state, for tests of the gateway's routing seam."""

from __future__ import annotations

from gateway.config import parse_config
from gateway.prefix.memory import MemoryPrefixIndex
from gateway.routing.load import MemoryLoadTracker
from gateway.routing.pipeline import PipelineRouter
from gateway.routing.registry import build_engine
from gateway.upstreams import UpstreamRegistry

CHUNK = 256
REPLICAS = [f"mi355x-{i}" for i in range(4)]


def pipeline_router() -> tuple[PipelineRouter, object]:
    """(the router, the model's route)."""
    pool = {"name": "mi355x", "kind": "sglang", "model": "zai-org/GLM-5.2",
            "replicas": [{"name": n, "url": f"http://127.0.0.1:{9 + i}"} for i, n in enumerate(REPLICAS)],
            "pricing": {"type": "gpu_hour", "gpus_per_replica": 4, "usd_per_gpu_hour": 2.1,
                        "prefill_tokens_per_s": 16700, "decode_tokens_per_s": 3600}}
    cfg = parse_config({"models": [{"name": "glm-5.2", "pools": ["mi355x"]}], "pools": [pool],
                        "tenants": [{"name": "t", "api_key_hashes": ["0" * 64], "models": ["glm-5.2"]}]})
    router = PipelineRouter(UpstreamRegistry(cfg), MemoryPrefixIndex(), MemoryLoadTracker(), build_engine(cfg.routing))
    return router, cfg.models[0]
