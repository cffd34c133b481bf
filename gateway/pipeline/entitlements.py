"""Entitlements: which pools may serve this tenant for this model, in fallback order.

The model's pools the tenant may use (its `pools` list, its price cap), then its own fallback pools; or only the
pool on-call pinned it to. A model the tenant may not use is reported exactly like one that does not exist (404:
nothing leaks). A client may narrow the route to one of those pools with `x-gateway-pool` (403 otherwise).

A name the tenant does not serve may be one of its `model_aliases` (exact, then glob): the route is then the served
model's (`route.name`), while the request keeps the name the client asked for, which its response reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway.config import ModelRoute, PerTokenPricing
from gateway.control.plane import ControlPlane
from gateway.errors import ModelNotFound, PermissionDenied
from gateway.pipeline.validation import ParsedRequest
from gateway.policy_schema import Tenant
from gateway.tenancy.policy_store import PolicyStore
from gateway.upstreams import UpstreamRegistry


class Entitlements:
    def __init__(self, models: Sequence[ModelRoute], registry: UpstreamRegistry, policies: PolicyStore,
                 control: ControlPlane) -> None:
        """`models`: the configured models; `policies`, `control`: their versions key the memo (a live change or an
        on-call pin resolves anew)."""
        self.models, self.registry, self.policies, self.control = models, registry, policies, control
        self._routes: dict[tuple[str, str, str, float, str | None], ModelRoute] = {}

    def route_for(self, tenant: Tenant, model: str) -> ModelRoute:
        """Memoized per policy/control version (the admin API's explain uses the same resolution)."""
        pin = self.control.pinned_pool(tenant.name)  # in the key: a pin lapses by time, with no state change
        key = (tenant.name, model, self.policies.current.fingerprint, self.control.applied_at, pin)
        route = self._routes.get(key)
        if route is not None:
            return route
        alias = tenant.alias_for(model)
        if alias is not None:
            try:
                route = self.route_for(tenant, alias.model)  # the served model's route, under its own name
            except ModelNotFound:  # its pools are all out of bounds for this tenant: the name asked for, not found
                raise ModelNotFound(f"The model '{model}' does not exist or you do not have access to it.",
                                    param="model") from None
            if len(self._routes) > 10_000:
                self._routes.clear()
            self._routes[key] = route
            return route
        if model in tenant.models:
            r = next((r for r in self.models if r.name == model), None)
            pools = [pin] if pin is not None else \
                [p for p in r.pools if self._pool_allowed(tenant, p)] + \
                [p for p in tenant.fallback_pools if p not in r.pools and self._pool_allowed(tenant, p)] if r else []
            if r is not None and pools:
                if len(self._routes) > 10_000:
                    self._routes.clear()
                route = self._routes[key] = ModelRoute(name=model, pools=pools, vision=r.vision)
                return route
        raise ModelNotFound(f"The model '{model}' does not exist or you do not have access to it.", param="model")

    def resolve(self, tenant: Tenant, model: str, pin: str | None) -> ModelRoute:
        route = self.route_for(tenant, model)
        if pin is None:
            return route
        if pin not in route.pools:
            raise PermissionDenied("This key may not pin requests to that pool.", param="x-gateway-pool")
        return route.model_copy(update={"pools": [pin]})

    @staticmethod
    def with_alias_defaults(tenant: Tenant, parsed: ParsedRequest) -> ParsedRequest:
        """`parsed` with its alias's default output cap when it names none (chat `max_tokens`)."""
        alias = tenant.alias_for(parsed.model)
        if alias is None or alias.max_output_tokens is None or parsed.max_output_tokens is not None:
            return parsed
        body = {**parsed.body, "max_tokens": alias.max_output_tokens}
        return replace(parsed, body=body, max_output_tokens=alias.max_output_tokens)

    def _pool_allowed(self, tenant: Tenant, pool: str) -> bool:
        if tenant.pools is not None and pool not in tenant.pools and pool not in tenant.fallback_pools:
            return False
        cap = tenant.max_price_per_mtok
        head = self.registry.head(pool)
        price = head.pricing if head else None
        return cap is None or not isinstance(price, PerTokenPricing) or max(price.input_per_mtok, price.output_per_mtok) <= cap
