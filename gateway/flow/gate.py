"""When may a queued request go: the routing engine's decision for it, read against the time it has left.

The decision's chosen target comes with its predicted TTFT, which is the request's own prefill (`own`, what it
would take on an idle replica) plus the wait behind what that replica already has queued (`ahead`). The request goes
when `ahead` fits in what is left of its SLA after its own prefill, less the headroom. A request whose own prefill
already exceeds that (a long cold prompt, or one that waited past its deadline) goes when `ahead` is within the
headroom alone: holding it longer would not bring it back within the SLA, and an idle replica is capacity lost.
A decision without a chosen target (shed, nothing healthy) never admits; one without predictions (policies that
do not predict) always does.
"""

from __future__ import annotations

from typing import Any

from gateway.prediction.ttft import LoadView, predict_ttft
from gateway.routing.decision import Decision
from gateway.routing.features import Candidate


def admits(decision: Decision[Any], sla_s: float, waited_s: float, headroom: float) -> bool:
    chosen = decision.chosen
    if chosen is None:
        return False
    cand: Candidate[Any] | None = decision.features.get(chosen.name)
    if cand is None or cand.ttft_raw <= 0:
        return True
    scale = cand.ttft / cand.ttft_raw  # the learned correction, applied to both parts alike
    own = predict_ttft(cand.info.timing, LoadView(), cand.uncached_tokens) * scale
    ahead = max(0.0, cand.ttft - own)
    room = max(sla_s * (1 - headroom) - waited_s - own, sla_s * headroom)
    return ahead <= room
