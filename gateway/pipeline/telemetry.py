"""The request's span, per the OpenTelemetry GenAI semantic conventions (names, counts and timings only).

Kind SERVER, named `{gen_ai.operation.name} {gen_ai.request.model}`. At the end: `gen_ai.provider.name` (the serving
pool's kind: sglang, openai, litellm), `gen_ai.response.model` as served (the upstream model, not the client's
alias), `gen_ai.usage.{input,output}_tokens`, `gen_ai.usage.cache_read.input_tokens`; `gen_ai.request.max_tokens`
only when the client set it. A failure sets status ERROR and `error.type` (the HTTP status or the end reason).
The dispatcher's attempt spans are its children (the relay hands this span to the dispatcher as their parent).
With tracing off (a NoOpTracer: no exporter configured) there is no span at all and none of this work is done.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import NoOpTracer, SpanKind, Status, StatusCode

from gateway.pipeline.outcome import Outcome
from gateway.pipeline.validation import ParsedRequest
from gateway.routing.decision import Decision


def operation(endpoint: str) -> str:
    return "chat" if endpoint == "chat/completions" else "text_completion"


def start_span(tracer: Any, endpoint: str, parsed: ParsedRequest, tenant: str, request_id: str) -> Any:
    """The request's span, or None when tracing is off (`request_id`: the correlation id, logged and echoed)."""
    if isinstance(tracer, NoOpTracer):
        return None
    attrs: dict[str, Any] = {"gen_ai.operation.name": operation(endpoint), "gen_ai.request.model": parsed.model,
                             "gateway.tenant": tenant, "gateway.request_id": request_id}
    if parsed.max_output_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = parsed.max_output_tokens
    return tracer.start_span(f"{attrs['gen_ai.operation.name']} {parsed.model}", kind=SpanKind.SERVER, attributes=attrs)


def end_span(span: Any, decision: Decision[Any] | None, out: Outcome, status: str, reason: str, prompt: int,
             cached: int, completion: int) -> None:
    """`status`, `reason`: how the request ended as accounting reads it (a client that left named as such)."""
    if span is None:
        return
    target = out.served_by
    attrs: dict[str, Any] = {
        "gen_ai.usage.input_tokens": prompt,
        "gen_ai.usage.output_tokens": completion,
        "gen_ai.usage.cache_read.input_tokens": cached,
        "gateway.route": decision.branch if decision else "",
        "gateway.status": status,
        "gateway.reason": reason,
        "gateway.attempts": out.attempts,
    }
    if target is not None:
        attrs.update({"gen_ai.provider.name": target.kind, "gen_ai.response.model": target.upstream_model,
                      "gateway.pool": target.pool, "gateway.replica": target.name})
    span.set_attributes(attrs)
    if reason not in ("ok", "client_disconnect"):
        span.set_attribute("error.type", status if status != "200" else reason)
        span.set_status(Status(StatusCode.ERROR, reason))
    span.end()
