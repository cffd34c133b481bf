"""The pair decision of a prefill/decode-disaggregated pool: which prefill rank, which decode server, and whether to
disaggregate this request at all. Pure: no I/O, no clock; the gateway (`dispatch/pd.py`) and the virtual-clock
fleet (`gateway_lab/replay/pd.py`) both call it with their own views.

Prefers:
- prefill: the rank that finishes this prompt first, i.e. the least (queued uncached tokens + this prompt's uncached
  tokens there) — prefix affinity and the prefill queue in one number; ties to the rank holding more of the prompt,
  then by name;
- decode: among servers whose KV still has `kv_headroom` free after this request's prompt + output, the least
  (running share + KV used share); none fits: the one with the most free KV (`decode_kv_tight`);
- disaggregate (`decide: auto`, decode servers that prefill locally): compare the predicted TTFT of the pair
  (prefill queue + compute + KV transfer + the wait for the decode server's next step) with prefilling on the
  decode server (its queue + compute), the latter charged for the decode steps it stalls (`itl_weight` x prefill
  seconds x the streams running there: the stream-seconds it costs the others). A short uncached prompt stays on the
  decode server. When only one is predicted within the tenant's SLA, that one; otherwise the lower TTFT once the
  stall is charged.

Branches (the decision's label, counted as `gateway_pd_decisions_total{pool,branch}` and in replay tables):
`pd_fixed` (decide: always), `pd_only` (auto without local prefill), `unified_short`, `unified_no_prefill`,
`pd_sla`, `unified_sla` (the prefill pool is congested), `pd_cheaper`, `unified_cheaper`, `pd_faster`,
`unified_faster`, `no_prefill` (nothing can serve the pair).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.pd_config import Disaggregation
from gateway.prediction.ttft import LoadView, predict_ttft
from gateway.settings.pools import PoolTiming


@dataclass(frozen=True)
class PrefillView:
    name: str  # "<server>/dp<rank>" (or the server's name with one rank)
    server: str
    rank: int
    cached_tokens: int  # of this prompt, predicted held there (prefix index)
    queued_tokens: float  # uncached tokens sent there and not yet prefilled
    available: bool = True  # breaker closed, server up


@dataclass(frozen=True)
class DecodeView:
    name: str
    inflight: float  # requests running or waiting there
    max_running: int
    kv_capacity: int
    kv_used: int | None = None  # tokens in use (None: not reported yet)
    queued_prefill_tokens: float = 0.0  # local prefills waiting (unified serving)
    cached_tokens: int = 0  # of this prompt, predicted held there (unified serving)
    available: bool = True


@dataclass(frozen=True)
class PdRequest:
    prompt_tokens: int
    output_tokens: int
    ttft_sla_s: float


@dataclass(frozen=True)
class PdChoice:
    disaggregate: bool
    branch: str
    decode: str | None
    prefill: PrefillView | None = None
    ttft_pd: float | None = None
    ttft_unified: float | None = None


def prefill_ttft(v: PrefillView, req: PdRequest, cfg: Disaggregation) -> float:
    """Predicted first token of the pair: the prefill rank's queue and this prompt's uncached part, then the KV
    transfer of the whole prompt (the decode server holds none of it)."""
    t = cfg.prefill_timing
    uncached = max(0, req.prompt_tokens - v.cached_tokens)
    return t.base_s + (v.queued_tokens + uncached) / t.prefill_tokens_per_s + cfg.link.seconds(req.prompt_tokens)


def choose_prefill(views: Sequence[PrefillView], req: PdRequest, cfg: Disaggregation) -> tuple[PrefillView, float] | None:
    best: tuple[float, int, str, PrefillView] | None = None
    for v in views:
        if not v.available:
            continue
        key = (prefill_ttft(v, req, cfg), -v.cached_tokens, v.name, v)
        if best is None or key[:3] < best[:3]:
            best = key
    return (best[3], best[0]) if best is not None else None


def kv_fits(v: DecodeView, req: PdRequest, cfg: Disaggregation) -> bool:
    if v.kv_used is None:
        return True
    free = v.kv_capacity - v.kv_used - (req.prompt_tokens + req.output_tokens)
    return free >= cfg.kv_headroom * v.kv_capacity


def choose_decode(views: Sequence[DecodeView], req: PdRequest, cfg: Disaggregation) -> tuple[DecodeView, str] | None:
    live = [v for v in views if v.available]
    if not live:
        return None
    fits = [v for v in live if kv_fits(v, req, cfg)]
    if not fits:
        tight = max(live, key=lambda v: (v.kv_capacity - (v.kv_used or 0), -v.inflight, v.name))
        return tight, "decode_kv_tight"
    best = min(fits, key=lambda v: (v.inflight / max(1, v.max_running) + (v.kv_used or 0) / max(1, v.kv_capacity),
                                    v.name))
    return best, "decode_load"


def decode_step_s(t: PoolTiming, inflight: float) -> float:
    """One decode forward at this batch size (the pool timing's full-batch step, scaled down linearly)."""
    return t.decode_step_s * max(1.0, inflight) / t.max_running


def decide(req: PdRequest, prefills: Sequence[PrefillView], decode: DecodeView, cfg: Disaggregation,
           decode_timing: PoolTiming) -> PdChoice:
    """Disaggregate this request on (best prefill rank, `decode`), or serve it whole on `decode`."""
    pick = choose_prefill(prefills, req, cfg)
    join = decode_step_s(decode_timing, decode.inflight + 1)  # the received request joins at the next step boundary
    t_pd = pick[1] + join if pick is not None else None
    if cfg.decide == "always" or not cfg.local_prefill:
        if pick is None:
            return PdChoice(False, "no_prefill", None)
        return PdChoice(True, "pd_fixed" if cfg.decide == "always" else "pd_only", decode.name, pick[0], t_pd)
    uncached = max(0, req.prompt_tokens - decode.cached_tokens)
    load = LoadView(decode.queued_prefill_tokens, decode.inflight)
    t_uni = predict_ttft(decode_timing, load, uncached)
    if uncached <= cfg.min_uncached_tokens:
        return PdChoice(False, "unified_short", decode.name, None, t_pd, t_uni)
    if pick is None or t_pd is None:
        return PdChoice(False, "unified_no_prefill", decode.name, None, None, t_uni)
    # prefilling here holds every running stream of this server for the prefill's duration: stream-seconds lost
    stall = cfg.itl_weight * (uncached / decode_timing.prefill_tokens_per_s) * decode.inflight
    sla = req.ttft_sla_s
    pd_ok, uni_ok = t_pd <= sla, t_uni <= sla
    if pd_ok and not uni_ok:
        return PdChoice(True, "pd_sla", decode.name, pick[0], t_pd, t_uni)
    if uni_ok and not pd_ok:
        return PdChoice(False, "unified_sla", decode.name, None, t_pd, t_uni)
    if pd_ok:  # both within the SLA: the cheaper for everyone
        if t_uni + stall < t_pd:
            return PdChoice(False, "unified_cheaper", decode.name, None, t_pd, t_uni)
        return PdChoice(True, "pd_cheaper", decode.name, pick[0], t_pd, t_uni)
    if t_uni + stall < t_pd:  # neither: the faster, the stall charged here too (the streams it holds also wait)
        return PdChoice(False, "unified_faster", decode.name, None, t_pd, t_uni)
    return PdChoice(True, "pd_faster", decode.name, pick[0], t_pd, t_uni)


def room_for_rank(room: int, rank: int, dp_size: int) -> int:
    """`room` moved to the nearest value with room % dp_size == rank: SGLang puts a room on that rank on both sides
    (follow_bootstrap_room), so the gateway picks the prefill rank by picking the room."""
    if dp_size <= 1:
        return room
    base = room - room % dp_size + rank
    return base if base >= 0 else base + dp_size
