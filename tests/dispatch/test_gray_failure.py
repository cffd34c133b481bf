"""A gray failure end to end over loopback HTTP: four simulated replicas, one slowed (prefill alone, then decode
alone) through the simulator's switch. The gateway must learn it (the replica's own TTFT correction, its observed
TTFT/ITL), eject it as a latency outlier with the reason, expose it in /metrics and admin state, and take it back
once the fault clears. Conditions are waited on by request count, never by wall-clock figures."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest

from gateway.api.admin.routes import _replica_truth
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import start_sims

TS = 4.0  # simulator speed; the pool's timing is stated in wall time to match (as loadtests/fleet_http.py does)
TIMING = {"base_s": 0.14 / TS, "prefill_tokens_per_s": 16700 * TS, "decode_step_s": 0.0467 / TS}
PROMPT = "x" * 4 * 3000  # ~3,000 tokens (the simulator's rule: 4 characters a token), each request its own


def body(i: int) -> dict:
    return {"model": "glm-5.2", "stream": True, "max_tokens": 12, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{i:08d} " + PROMPT}]}


class Traffic:
    """Streams from a few threads until told to stop; counts the replica that served each."""

    def __init__(self, url: str, threads: int = 4, body_of: Callable[[int], dict] = body) -> None:
        self.url = url
        self.body_of = body_of
        self.served: list[str] = []
        self.n = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(threads)]

    def run(self) -> None:
        with httpx.Client(timeout=60, trust_env=False) as c:
            while not self.stop.is_set():
                with self.lock:
                    self.n += 1
                    i = self.n
                with c.stream("POST", self.url + "/v1/chat/completions", json=self.body_of(i),
                              headers={"authorization": f"Bearer {KEY_A}"}) as r:
                    for _ in r.iter_lines():
                        pass
                    if r.status_code == 200:
                        with self.lock:
                            self.served.append(r.headers["x-gateway-replica"])

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def until(self, pred, most: int, what: str) -> None:
        """Wait until `pred()` holds, for at most `most` more served requests."""
        start = len(self.served)
        while not pred():
            assert len(self.served) - start < most, f"not seen within {most} requests: {what}"
            self.stop.wait(0.05)


@pytest.mark.parametrize("phase,reasons", [("prefill", {"latency_ttft", "latency_itl"}), ("decode", {"latency_itl"})])
def test_a_slowed_replica_is_learned_ejected_shown_and_taken_back(phase: str, reasons: set[str]):
    """Slowed prefill shows in TTFT and, as in SGLang (prefill forwards run ahead of decode), in the running streams'
    inter-token latency too: either may be the worst signal. Slowed decode shows in ITL alone."""
    sims, _ = start_sims(4, time_scale=TS)
    pool = {**sglang_pool("p", sims.urls), "timing": TIMING}
    gw = start_gateway(config([pool], outlier_detection={"interval_s": 0.2, "min_samples": 6, "consecutive": 2,
                                                         "base_ejection_s": 2.0}))
    st = gw.app.state.gateway
    slow = "p-3"
    try:
        with Traffic(gw.urls[0]) as traffic:
            traffic.until(lambda: len(traffic.served) >= 60, 200, "warm-up")
            assert set(traffic.served) == {"p-0", "p-1", "p-2", "p-3"}
            r = httpx.post(sims.urls[3] + "/_sim/fault", json={"kind": "slow", "phase": phase, "factor": 6})
            assert r.json()["slow"][phase] == 6.0
            traffic.until(lambda: gw.call(lambda: st.feedback.outliers.ejected(slow)) is not None, 400,
                          f"{slow} ejected")
            truth = gw.call(lambda: _replica_truth(st, slow))
            ejection = truth["outlier"]["ejected"]
            reason = ejection["reason"]
            assert reason in reasons and set(ejection["signals"]) <= reasons
            assert truth["outlier"]["ejected"]["times_peers"] > 2.5
            peers = [gw.call(lambda n=n: _replica_truth(st, n)) for n in ("p-0", "p-1", "p-2")]
            assert all(p["outlier"]["ejected"] is None for p in peers)  # one slow replica, one ejection
            def peers_max(key: str) -> float:  # over the peers with observations in the window
                return max(v for p in peers if (v := p["observed"][key]) is not None)

            if phase == "prefill":  # observed TTFT far above the model's, and its own correction above its peers'
                assert truth["observed"]["recent_ttft_residual_p50"] > 1.5 * peers_max("recent_ttft_residual_p50")
                assert truth["ttft_correction"] > max(p["ttft_correction"] for p in peers)
            else:  # the decode-slowed replica's ITL gave it away: the ejection names that signal alone. (Its window's
                # ITL p50 is no judge here: ejected after two slow intervals, the window still holds pre-fault samples,
                # and on a busy machine the peers' ITL rises with the machine's load.)
                assert ejection["signals"]["latency_itl"] > 2.5  # its ITL, times its peers', when it was ejected
            metrics = gw.call(lambda: st.metrics.render().decode())
            assert f'gateway_replica_ejected{{pool="p",replica="{slow}"}} 1.0' in metrics
            assert f'gateway_replica_ejections_total{{pool="p",reason="{reason}",replica="{slow}"}} 1.0' in metrics
            assert f'gateway_replica_ttft_seconds_count{{pool="p",replica="{slow}"}}' in metrics
            assert f'gateway_replica_itl_seconds_count{{pool="p",replica="{slow}"}}' in metrics
            # while ejected it takes no new request
            first = gw.call(lambda: st.feedback.outliers.ejected(slow))
            mark = len(traffic.served)
            traffic.until(lambda: len(traffic.served) >= mark + 20, 40, "20 more requests")
            if gw.call(lambda: st.feedback.outliers.ejected(slow)) is first:  # the same ejection throughout
                # at most the streams in flight when it began (4 threads) finish there, later than faster ones
                assert traffic.served[mark:].count(slow) <= 4
            httpx.post(sims.urls[3] + "/_sim/fault", json={"kind": "clear"}).raise_for_status()
            back = len(traffic.served)
            # back in routing once the ejection ends, on a clean slate, and it serves again
            traffic.until(lambda: slow in traffic.served[back:], 600, f"{slow} serving again")
            traffic.until(lambda: traffic.served[back:].count(slow) >= 8, 600, f"{slow} taking its share")
            # and it stays in: on probation it is judged on its last few requests, so on a machine whose cores are
            # busy one more short ejection can come from the machine's noise (each is tested above); what must not
            # happen is a healed replica kept out
            traffic.until(lambda: gw.call(lambda: st.feedback.outliers.ejected(slow)) is None, 600,
                          f"{slow} in routing after the clear")
    finally:
        gw.stop()
        sims.stop()
