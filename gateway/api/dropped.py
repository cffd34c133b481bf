"""What a bridge (Responses, Messages) left out of a request it served, and why: counted
(`gateway_bridge_dropped_total{api,kind}`), logged once per request, and told to the client in `x-gateway-dropped`.
Pure but for `report`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

log = logging.getLogger("gateway.bridge")

# Why a bridge left part of a request out (a bounded set: a metric label). Each is what the provider's own API does
# with it, or what a pool of this gateway cannot do:
#   hosted_tool      a tool only the provider's servers run (web search, file search, code interpreter, computer use,
#                    MCP), dropped per the tenant's `hosted_tools: drop`
#   deferred_tool    an Anthropic tool with `defer_loading` (shown to the model only through tool search)
#   unknown_block    a content block / part of a type the bridge does not know (the provider ignores them too)
#   unknown_item     an input item of a type the bridge does not know, or one it cannot place (an orphan output)
#   client_metadata  client-identifying fields, per the tenant's `client_metadata: strip`
#   tool_choice      a tool_choice naming a dropped tool
#   image            an image block sent to a model configured `vision: false` (Anthropic's models all take images,
#                    so a Messages client is served without it; the OpenAI APIs refuse it, as OpenAI does)
DROP_KINDS = ("hosted_tool", "deferred_tool", "unknown_block", "unknown_item", "client_metadata", "tool_choice",
              "image")
HEADER = "x-gateway-dropped"
_HEADER_ENTRIES = 16  # the header names this many parts at most, then "+N more"


@dataclass
class Dropped:
    """What a translation left out of the request it serves: (where, kind) pairs in request order."""

    entries: list[tuple[str, str]] = field(default_factory=list)

    def add(self, where: str, kind: str) -> None:
        assert kind in DROP_KINDS, kind
        self.entries.append((where[:80], kind))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def header(self) -> str:
        """`tools[6]=hosted_tool, input[3].content[1]=unknown_block`: bounded, paths only (never client text beyond a
        field path the gateway wrote)."""
        shown = ", ".join(f"{w}={k}" for w, k in self.entries[:_HEADER_ENTRIES])
        more = len(self.entries) - _HEADER_ENTRIES
        return shown + (f", +{more} more" if more > 0 else "")

    def report(self, metrics: Any, api: str, request_id: str | None) -> None:
        """Count each dropped part and log one line for the request."""
        if not self.entries:
            return
        for _, kind in self.entries:
            metrics.bridge_dropped.labels(api, kind).inc()
        log.info(orjson.dumps({"request_id": request_id, "api": api, "dropped": self.header()}).decode())
