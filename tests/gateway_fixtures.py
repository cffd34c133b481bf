"""Builders for gateway configs and running gateways in tests."""

from __future__ import annotations

from typing import Any

from gateway.app import create_admin_app, create_app
from gateway.config import hash_key, parse_config
from gateway.servers import make_server
from tests.support import ServerThread

KEY_A = "sk-test-tenant-a"
KEY_B = "sk-test-tenant-b"


def sglang_pool(name: str, urls: list[str], model: str = "zai-org/GLM-5.2") -> dict[str, Any]:
    return {"name": name, "kind": "sglang", "model": model,
            "replicas": [{"name": f"{name}-{i}", "url": u} for i, u in enumerate(urls)],
            "pricing": {"type": "gpu_hour", "gpus_per_replica": 4, "usd_per_gpu_hour": 2.0,
                        "prefill_tokens_per_s": 16700, "decode_tokens_per_s": 3600}}


def config(pools: list[dict[str, Any]], models: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    models = models or [{"name": "glm-5.2", "pools": [p["name"] for p in pools]}]
    tenants = extra.pop("tenants", None) or [
        {"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": [m["name"] for m in models]},
    ]
    cfg = {"models": models, "pools": pools, "tenants": tenants,
           "health": {"interval_s": 0.3, "timeout_s": 2.0},
           # a connect on loopback is refused at once or made at once; on a busy machine the accept can still wait:
           # a generous ceiling, so no test sees a connect timeout it is not about
           "timeouts": {"connect": 10.0, "first_byte": 10.0, "idle": 5.0, "total": 30.0},
           "retry": {"backoff_initial": 0.0, "jitter": 0.0},
           "circuit_breaker": {"failure_threshold": 3, "cooldown_s": 1.0}}
    for k, v in extra.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    return cfg


class GatewayThread(ServerThread):
    """A gateway as `gateway serve` runs it: the client listener (`urls[0]`: the APIs) and the admin listener
    (`admin_url`: the admin API and /metrics) over one instance (`app`). `served`: the client listener on the
    gateway's own HTTP protocol (its limits, its parser errors, WebSocket handshakes answered by the API) rather than
    uvicorn's."""

    def __init__(self, app: Any, http_limits: Any = None, served: bool = False) -> None:
        super().__init__([app, create_admin_app(app)])
        self.app = app
        self.admin_url = self.urls[1]
        if served:
            self.servers[0] = make_server(app, "127.0.0.1", self.ports[0], timeout_keep_alive=5, openai_errors=True,
                                          http_limits=http_limits)


def start_gateway(cfg: dict[str, Any], served: bool = False, **kw: Any) -> GatewayThread:
    parsed = parse_config(cfg)
    gw = GatewayThread(create_app(parsed, **kw), parsed.http, served)
    gw.start()
    return gw
