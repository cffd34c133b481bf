"""Flow control's typed settings: the process section (`flow:` in the gateway config) and the tenant's part of its
policy (`flow:` in a tenant file). Both are validated at load; a tenant naming a band the config does not declare
fails the load, naming the field (`config.check_tenants`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway.typed import Strict, unique_names

# An engine priority added by flow control stays within this: SGLang's priority is a plain int, but a boost past a few
# classes (the pools' priority_values, 10 apart by default) would overturn the tenants' classes wholesale
PRIORITY_BOOST_MAX = 30


class Band(Strict):
    name: str = Field(min_length=1, pattern=r"^[a-z][a-z0-9_-]*$")
    sheddable: bool = Field(default=False, description="queued requests of this band are evicted (503) to make room "
                            "for a higher band's, and it is the first to be refused when the queues are full")
    engine_queue: float | None = Field(default=None, gt=0, le=4, description="this band's queue allowance (default "
                                       "flow.engine_queue): a lower band held to a shorter engine queue leaves room a "
                                       "higher band's arrival finds at once")
    engine_priority: int = Field(default=0, ge=0, le=PRIORITY_BOOST_MAX, description="added to the engine priority "
                                 "of this band's requests where the target schedules by priority (on top of the "
                                 "tenant's class): beyond the threshold (SGLang: 10) it retracts lower requests")


# the top band may queue deeper on the engines (its policy's engine priority puts it first there), the sheddable one
# only on a nearly idle replica: room for a higher band's arrival is kept by the lower bands, not taken from it
DEFAULT_BANDS = (Band(name="critical", engine_queue=1.0), Band(name="standard"),
                 Band(name="sheddable", sheddable=True, engine_queue=0.1))


class FlowControl(Strict):
    """Fair, priority- and deadline-aware admission under overload (docs/flow-control.md). Off by default: with it
    off the request path is exactly as without the section."""

    enabled: bool = False
    bands: list[Band] = Field(default_factory=lambda: list(DEFAULT_BANDS), min_length=1,
                              description="priority bands, highest first: a lower band is served only when every "
                              "higher band's queue is empty")
    default_band: str = Field(default="standard", description="the band of a tenant whose policy names none")
    max_queued_per_tenant: int = Field(default=256, ge=1, description="a tenant's queue on this instance; past it: 429")
    max_queued: int = Field(default=4096, ge=1, description="every queue on this instance together; past it a higher "
                            "band's arrival evicts the newest sheddable request, else the arrival is refused (503)")
    queue_timeout_s: float = Field(default=10.0, gt=0, le=600, description="longest wait in the queue; then 503")
    prefill_weight: float = Field(default=1.0, gt=0, description="fair-share cost of one prompt token to prefill")
    cached_weight: float = Field(default=0.1, ge=0, description="fair-share cost of one prompt token the chosen "
                                 "replica holds in its prefix cache (no prefill; still KV memory)")
    output_weight: float = Field(default=4.6, ge=0, description="fair-share cost of one expected output token (an "
                                 "MI355X decodes ~3.6k tok/s against ~16.7k prefill tok/s per replica)")
    engine_queue: float = Field(default=0.25, gt=0, le=2, description="under contention a request is dispatched "
                                "when a target has at most this fraction of its SLA queued ahead of it (or a warmer "
                                "one saves more than its extra wait): engines stay busy, not deep (gate.py)")
    burst_credit: float = Field(default=200_000, ge=0, description="how far behind its band's virtual time an idle "
                                "or under-share tenant may start, in prefill-weighted tokens / weight: its burst goes "
                                "first (controller.py)")
    contention_window_s: float = Field(default=10.0, gt=0, description="flows (tenant, band) seen within this window "
                                       "contend; a single flow is never held (its order is first come either way)")
    tick_s: float = Field(default=0.02, gt=0, le=1, description="how often a non-empty queue re-checks the fleet")
    under_share_priority: int = Field(default=10, ge=0, le=PRIORITY_BOOST_MAX, description="added to the engine "
                                      "priority of a request dispatched while its flow is under its share of its band "
                                      "(its start tag behind the band's virtual time), where the target schedules by "
                                      "priority (the pool's send_priority); 0: off. At 10 (a class's spacing, above the "
                                      "prefill levels 0-9) it goes ahead of every over-share request of its class in "
                                      "the engine's queue")
    lookahead: int = Field(default=8, ge=1, le=256, description="requests the queue passes over in one pass when "
                           "the fleet has no room for them (each costs a routing decision): one request waiting for "
                           "its one warm replica does not hold the queue behind it")
    share_waits: bool = Field(default=True, description="every instance publishes the targets its passed-over "
                              "requests wait for (through Redis), and a request goes on a target only when no other "
                              "instance has a request ahead of it in the fair order waiting there (flow/waits.py)")

    @model_validator(mode="after")
    def _bands(self) -> FlowControl:
        names = [b.name for b in self.bands]
        unique_names(names, "bands")
        if self.default_band not in names:
            raise ValueError(f"default_band: {self.default_band!r} is not one of bands {names}")
        return self

    def queue_for(self, band: int) -> float:
        q = self.bands[band].engine_queue
        return q if q is not None else self.engine_queue

    def band_index(self, name: str | None) -> int:
        names = [b.name for b in self.bands]
        return names.index(name) if name in names else names.index(self.default_band)


class FlowPolicy(Strict):
    """A tenant's place in flow control: its band, its weight within the band, its queue."""

    band: str | None = Field(default=None, description="one of the config's flow.bands; unset: flow.default_band")
    weight: float = Field(default=1.0, gt=0, le=10_000, description="share of its band's capacity, relative to the "
                          "other tenants of the band (in prefill-weighted tokens)")
    client_bands: list[str] = Field(default_factory=list, description="bands a client may ask for with the "
                                    "x-gateway-band header; any other value is ignored (the policy's band applies)")
    max_queued: int | None = Field(default=None, ge=1, description="default flow.max_queued_per_tenant")
    queue_timeout_s: float | None = Field(default=None, gt=0, le=600, description="default flow.queue_timeout_s")
