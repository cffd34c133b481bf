"""A healthy replica sent long prompts is not a latency outlier. The engine runs a queued prefill before its next
decode step, so the streams on a replica taking long prompts see their tokens stall for whole prefills: their mean
inter-token latency rises with the load, while each decode step is as fast as anywhere. The outlier detector judges
the decode share (dispatch/replica_stats.py `decode_itl`: the first quartile of its gaps), so such a replica keeps its
place in routing; a replica whose decode itself is slow is still ejected (tests/dispatch/test_gray_failure.py)."""

from __future__ import annotations

import threading

import httpx

from gateway.dispatch.replica_stats import decode_itl
from tests.dispatch.test_gray_failure import TIMING, TS, Traffic
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims


def test_decode_itl_leaves_out_the_gaps_a_prefill_took_and_keeps_a_slow_decode():
    steady = [0.01] * 20
    assert abs(decode_itl(0.01, steady) - 0.01) < 1e-12  # every step alike: all of it is decode
    stalled = [0.01] * 18 + [0.5, 0.5]  # two gaps held whole prefills: the mean rose with them
    mean = sum(stalled) / len(stalled)
    assert abs(decode_itl(mean, stalled) - 0.01) < 1e-9
    slow = [0.06] * 18 + [0.5, 0.5]  # a slow replica: every step slow, the median with them
    assert decode_itl(sum(slow) / len(slow), slow) > 5 * decode_itl(mean, stalled)
    starved = [0.01] * 6 + [0.5] * 14  # prefills one after another: most gaps hold one, a quarter do not
    assert abs(decode_itl(sum(starved) / len(starved), starved) - 0.01) < 1e-9
    burst = [0.0] * 10 + [0.01] * 10  # half the tokens came together: those gaps are no step of the engine's
    assert decode_itl(0.005, burst, burst_s=0.001) == 0.005
    assert decode_itl(0.02, None) == 0.02 and decode_itl(0.02, [0.1, 0.2, 0.3]) == 0.02  # too few reads: the mean


def stream_body(i: int) -> dict:
    """Short prompts (each its own), answers long enough that a prefill on their replica cuts in."""
    return {"model": "glm-5.2", "stream": True, "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{i:08d} " + "y" * 4 * 300}]}


SHARED = "z" * 4 * 16_000  # ~16k tokens every long prompt starts with: routing keeps them where it is cached


class LongPrompts:
    """Long prompts through the gateway, one after another, each a shared 16k-token prefix and 24k tokens of its own:
    routing sends them where the prefix is cached, whose engine prefills their own 24k between the decode steps of
    the streams it serves there."""

    def __init__(self, url: str) -> None:
        self.url, self.stop, self.sent = url, threading.Event(), 0
        self.served: list[str] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=60, trust_env=False) as c:
            while not self.stop.is_set():
                self.sent += 1
                r = c.post(self.url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY_A}"}, json={
                    "model": "glm-5.2", "max_tokens": 1,
                    "messages": [{"role": "user", "content": SHARED + f" {self.sent:08d} " + "w" * 4 * 24_000}]})
                if r.status_code == 200:
                    self.served.append(r.headers["x-gateway-replica"])
                self.stop.wait(0.05)  # room for decode steps between the prefills: load, not starvation

    def __enter__(self) -> LongPrompts:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def test_a_replica_busy_with_long_prefills_is_not_ejected_for_its_streams_stalls():
    sims, _ = start_sims(4, time_scale=TS)
    pool = {**sglang_pool("p", sims.urls), "timing": TIMING}
    # the TTFT residual is not judged here (it is elsewhere): this is about the streams' tokens
    gw = start_gateway(config([pool], outlier_detection={"interval_s": 0.2, "min_samples": 6, "consecutive": 2,
                                                         "ttft_factor": 1000.0, "base_ejection_s": 2.0}))
    st = gw.app.state.gateway
    names = ("p-0", "p-1", "p-2", "p-3")

    def itl_p50(name: str) -> float | None:
        return gw.call(lambda: st.feedback.stats.view(name).itl_p50_s)

    def stalled(long: LongPrompts) -> bool:
        """The replica taking most long prompts: its streams' mean ITL over the window far above each peer's, what
        judging the mean would eject it for."""
        if len(long.served) < 5:
            return False
        busy = max(names, key=long.served.count)
        mine, peers = itl_p50(busy), [itl_p50(n) for n in names if n != busy]
        return mine is not None and all(p for p in peers) and mine > 2.5 * max(p for p in peers if p)

    try:
        with Traffic(gw.urls[0], body_of=stream_body) as traffic, LongPrompts(gw.urls[0]) as long:
            traffic.until(lambda: stalled(long), 1500, "a replica's streams stalled by its prefills")
            busy = max(names, key=long.served.count)
            mark = traffic.served.count(busy)
            # it goes on serving, judged every 0.2 s on its last few streams, as long as it takes to be judged anew
            traffic.until(lambda: traffic.served.count(busy) >= mark + 12, 1500, f"12 more streams on {busy}")
            metrics = gw.call(lambda: st.metrics.render().decode())
            assert 'gateway_replica_ejections_total{pool="p",reason="latency_itl"' not in metrics
    finally:
        gw.stop()
        sims.stop()
