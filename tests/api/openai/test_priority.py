"""Priority against SGLang's semantics: with --enable-priority-scheduling a request without `priority`
ranks lowest (unless --default-priority-value), and a waiting request preempts running ones it beats by more than
the threshold. The gateway sends every class explicitly, so high runs before normal before low whatever the
server's default says."""

import threading
import time

import httpx
import pytest

from gateway.config import hash_key
from tests.gateway_fixtures import config, sglang_pool, start_gateway
from tests.support import start_sims, wait_until

CLASSES = ("high", "normal", "low")
KEYS = {c: f"sk-priority-{c}" for c in CLASSES}


def _timed(url: str, body: dict, done: dict, tag: str, headers: dict | None = None) -> None:
    r = httpx.post(url, json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    done[tag] = time.monotonic()


def _contend(send, blocker_tag: str, order: list[str], sim: str) -> dict[str, float]:
    """One long request occupies the only running slot; the others queue behind it in `order` (arrival order), and
    their finish times tell the scheduler's order. `sim`: the server's URL, whose queue is watched."""
    done: dict[str, float] = {}
    rank = lambda: httpx.get(f"{sim}/_sim/state").json()["ranks"][0]  # noqa: E731
    # the server runs 100x slower until every request is queued, so the blocker cannot finish first however slowly
    # this machine sends them (a busy machine once let it, and a queue that never formed timed the test out)
    httpx.post(f"{sim}/_sim/config", json={"slow_factor": 100.0}).raise_for_status()
    threads = [threading.Thread(target=send, args=(blocker_tag, 1500, done))]
    threads[0].start()
    wait_until(lambda: len(rank()["running"]) == 1, timeout=60, what="the blocker running")
    for i, tag in enumerate(order, 1):
        t = threading.Thread(target=send, args=(tag, 150, done))
        t.start()
        threads.append(t)
        # queued before the next is sent: FCFS would serve them in `order`
        wait_until(lambda i=i: len(rank()["waiting"]) == i, timeout=60, what=f"{tag} queued")
    httpx.post(f"{sim}/_sim/config", json={"slow_factor": 1.0}).raise_for_status()
    for t in threads:
        t.join(60)
    return done


def _sim(**kw):
    return start_sims(1, time_scale=5.0, max_running_requests=1, enable_priority_scheduling=True, **kw)


def test_sim_without_priority_ranks_lowest_unless_a_default_is_set():
    """SGLang's rule, reproduced: a request without `priority` is served after an explicit -10 ... unless the server
    runs --default-priority-value 0 (0.5.13+)."""
    for default, first in ((None, "explicit-low"), (0, "no-priority")):
        sims, _ = _sim(default_priority_value=default)
        try:
            url = f"{sims.urls[0]}/v1/completions"

            def send(tag, n, done, url=url):
                body = {"prompt": f"{tag} " * 50, "max_tokens": n, "ignore_eos": True}
                if tag == "explicit-low":
                    body["priority"] = -10
                elif tag == "blocker":
                    body["priority"] = 1000
                _timed(url, body, done, tag)

            done = _contend(send, "blocker", ["no-priority", "explicit-low"], sims.urls[0])
            assert min(("no-priority", "explicit-low"), key=done.__getitem__) == first
        finally:
            sims.stop()


def test_sim_preempts_a_running_request_beaten_by_more_than_the_threshold():
    """A normal (0) request does not retract a running low (-10) one (difference 10 is not above the threshold 10)
    and waits for it; a high (+10) one does (difference 20) and finishes first."""
    sims, _ = _sim()
    try:
        url = f"{sims.urls[0]}/v1/completions"

        def send(tag, n, done):
            prio = {"blocker": -10, "high": 10, "normal": 0}[tag]
            _timed(url, {"prompt": f"{tag} " * 50, "max_tokens": n, "ignore_eos": True, "priority": prio}, done, tag)

        done = _contend(send, "blocker", ["normal"], sims.urls[0])
        assert done["blocker"] < done["normal"]
        done = _contend(send, "blocker", ["high"], sims.urls[0])
        assert done["high"] < done["blocker"]
    finally:
        sims.stop()


def test_sim_refuses_priority_when_disabled_and_asked_to():
    sims, _ = start_sims(1, abort_on_priority_when_disabled=True)
    try:
        u = f"{sims.urls[0]}/v1/completions"
        r = httpx.post(u, json={"prompt": "x", "max_tokens": 1, "priority": 0}, timeout=30)
        assert r.status_code == 503 and "priority is disabled" in r.json()["message"]
        assert httpx.post(u, json={"prompt": "x", "max_tokens": 1}, timeout=30).status_code == 200
    finally:
        sims.stop()


@pytest.mark.parametrize(("default", "low_first"), [(None, False), (0, False), (100, False), (None, True)],
                         ids=["no-default", "default-0", "default-100", "low-values-first"])
def test_gateway_high_before_normal_before_low_whatever_the_server_default(default, low_first):
    """Three tenants, one per class, contend for one running slot: they are served high, normal, low — even though
    they arrive low, normal, high, and whatever --default-priority-value the server runs (100 would put a request
    without priority above high), and on a server with --schedule-low-priority-values-first (the gateway negates)."""
    sims, _ = _sim(default_priority_value=default, schedule_low_priority_values_first=low_first)
    tenants = [{"name": f"t-{c}", "api_key_hashes": [hash_key(KEYS[c])], "models": ["glm-5.2"], "priority": c}
               for c in CLASSES]
    gw = start_gateway(config([sglang_pool("p", sims.urls)], tenants=tenants, routing={"load_poll_s": 0.1},
                              timeouts={"first_byte": 60.0, "total": 60.0}))
    try:
        wait_until(lambda: gw.call(lambda: gw.app.state.gateway.registry.by_pool["p"][0].priority_scheduling) is True,
                   timeout=10, what="the preflight read enable_priority_scheduling")
        url = f"{gw.urls[0]}/v1/chat/completions"

        def send(tag, n, done):
            klass = "high" if tag == "blocker" else tag
            body = {"model": "glm-5.2", "messages": [{"role": "user", "content": f"{tag} " * 50}], "max_tokens": n,
                    "ignore_eos": True}
            _timed(url, body, done, tag, {"authorization": f"Bearer {KEYS[klass]}"})

        done = _contend(send, "blocker", ["low", "normal", "high"], sims.urls[0])
        # the order the queued requests were served in; the blocker, alone in the only running slot, ends before any
        # of them starts, but its 1,500-token answer reaches its client thread when it does: once, on a busy machine,
        # 11 ms after the next request's whole answer had reached its own
        assert set(done) == {"blocker", "high", "normal", "low"}
        assert done["high"] < done["normal"] < done["low"]
    finally:
        gw.stop()
        sims.stop()


@pytest.mark.parametrize("shortest_first", [True, False])
def test_a_short_prefill_goes_before_a_long_one_queued_first(shortest_first):
    """routing.shortest_prefill_first (the default): within one class the priority sent rises as the uncached prefill
    shrinks, so on a server that schedules by priority a short turn queued behind a cold 8k-token prompt is served
    first. Switched off, the class value alone is sent and the server keeps arrival order."""
    sims, _ = _sim()
    tenants = [{"name": "t-normal", "api_key_hashes": [hash_key(KEYS["normal"])], "models": ["glm-5.2"]}]
    gw = start_gateway(config([sglang_pool("p", sims.urls)], tenants=tenants,
                              routing={"load_poll_s": 0.1, "shortest_prefill_first": shortest_first},
                              timeouts={"first_byte": 60.0, "total": 60.0}))
    try:
        wait_until(lambda: gw.call(lambda: gw.app.state.gateway.registry.by_pool["p"][0].priority_scheduling) is True,
                   timeout=10, what="the preflight read enable_priority_scheduling")
        url = f"{gw.urls[0]}/v1/chat/completions"
        words = {"blocker": 50, "long": 8000, "short": 50}  # ~4 characters a token: "long" is ~8k tokens

        def send(tag, n, done):
            body = {"model": "glm-5.2", "messages": [{"role": "user", "content": f"{tag} " * words[tag]}],
                    "max_tokens": n, "ignore_eos": True}
            _timed(url, body, done, tag, {"authorization": f"Bearer {KEYS['normal']}"})

        done = _contend(send, "blocker", ["long", "short"], sims.urls[0])
        assert (done["short"] < done["long"]) is shortest_first
    finally:
        gw.stop()
        sims.stop()
