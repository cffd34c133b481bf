"""`sglang:*` Prometheus metrics of a simulated replica (spec section 3), read from scheduler state at scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from gateway_lab.sim.engine import Rank
    from gateway_lab.sim.replica import Replica

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
               0.200, 0.400, 0.600, 0.800, 1, 2, 4, 6, 8)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
QUEUE_BUCKETS = (0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500,
                 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)


class _SchedulerCollector:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def collect(self) -> Iterator[Metric]:
        rep = self.replica
        model = rep.cfg.served_model_name
        multi = rep.cfg.dp_size > 1
        sched_labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"] + (["dp_rank"] if multi else [])

        def lv(rank: int) -> list[str]:
            return [model, "unified", "0", "0", "0"] + ([str(rank)] if multi else [])

        gauges: dict[str, Callable[[Rank], float]] = {
            "num_running_reqs": lambda r: len(r.running),
            "num_queue_reqs": lambda r: len(r.waiting),
            "num_used_tokens": lambda r: r.used_tokens(),
            "token_usage": lambda r: r.used_tokens() / rep.cfg.max_total_num_tokens,
            "max_total_num_tokens": lambda r: rep.cfg.max_total_num_tokens,
            "gen_throughput": lambda r: r.counters.last_gen_throughput,
            "cache_hit_rate": lambda r: r.counters.cached_tokens / r.counters.prompt_tokens if r.counters.prompt_tokens else 0.0,
            "spec_accept_length": lambda r: rep.cfg.timing.alpha,
            "num_retracted_reqs": lambda r: 0,
            "num_paused_reqs": lambda r: 0,
            "num_grammar_queue_reqs": lambda r: 0,
            "utilization": lambda r: min(1.0, len(r.running) / rep.cfg.max_running_requests),
            "kv_used_tokens": lambda r: r.cache.total_tokens + r.reserved,
            "kv_available_tokens": lambda r: rep.cfg.max_total_num_tokens - r.cache.total_tokens - r.reserved,
            "kv_evictable_tokens": lambda r: r.cache.evictable_tokens,
        }
        for name, fn in gauges.items():
            g = GaugeMetricFamily(f"sglang:{name}", name.replace("_", " "), labels=sched_labels)
            for rr in rep.ranks:
                g.add_metric(lv(rr.rank.dp_rank), float(fn(rr.rank)))
            yield g
        rt = CounterMetricFamily("sglang:realtime_tokens", "tokens processed by mode", labels=sched_labels + ["mode"])
        for rr in rep.ranks:
            c = rr.rank.counters
            rt.add_metric(lv(rr.rank.dp_rank) + ["prefill_compute"], c.prefill_compute_tokens)
            rt.add_metric(lv(rr.rank.dp_rank) + ["prefill_cache"], c.cached_tokens)
            rt.add_metric(lv(rr.rank.dp_rank) + ["decode"], c.generation_tokens)
        yield rt
        def tot(attr: str) -> float:
            return float(sum(getattr(rr.rank.counters, attr) for rr in rep.ranks))

        for name, attr, extra in (
            ("prompt_tokens", "prompt_tokens", None),
            ("generation_tokens", "generation_tokens", None),
            ("cached_tokens", "cached_tokens", ("cache_source", "device")),
            ("num_requests", "requests", None),
            ("num_aborted_requests", "aborted", None),
        ):
            labels = ["model_name"] + ([extra[0]] if extra else [])
            fam = CounterMetricFamily(f"sglang:{name}", name.replace("_", " "), labels=labels)
            fam.add_metric([model] + ([extra[1]] if extra else []), tot(attr))
            yield fam


class ReplicaMetrics:
    def __init__(self, replica: Replica) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(replica))
        model = replica.cfg.served_model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labelnames=["model_name"], registry=self.registry, buckets=buckets).labels(model)

        self.ttft = histogram("sglang:time_to_first_token_seconds", "TTFT", TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds", "ITL", ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds", "E2E", E2E_BUCKETS)
        self.queue = histogram("sglang:queue_time_seconds", "queue time", QUEUE_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)
