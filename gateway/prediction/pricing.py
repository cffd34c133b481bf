"""Cost of a request on a pool, from its token counts (pure)."""

from __future__ import annotations

from gateway.settings.pools import GpuHourPricing, PerTokenPricing


def request_cost(
    pricing: PerTokenPricing | GpuHourPricing | None, prompt_tokens: int, cached_tokens: int, completion_tokens: int
) -> float:
    """USD. Per-token pools bill cached input at the cached price; self-hosted pools charge the replica time the
    request occupies: uncached prefill at prefill_tokens_per_s plus its share of full-batch decode."""
    if pricing is None:
        return 0.0
    cached = max(0, min(cached_tokens, prompt_tokens))
    uncached = prompt_tokens - cached
    if isinstance(pricing, PerTokenPricing):
        cached_price = pricing.input_per_mtok if pricing.cached_input_per_mtok is None else pricing.cached_input_per_mtok
        return (uncached * pricing.input_per_mtok + cached * cached_price + completion_tokens * pricing.output_per_mtok) / 1e6
    usd_per_s = pricing.gpus_per_replica * pricing.usd_per_gpu_hour / 3600.0
    seconds = uncached / pricing.prefill_tokens_per_s + completion_tokens / pricing.decode_tokens_per_s
    return usd_per_s * seconds
