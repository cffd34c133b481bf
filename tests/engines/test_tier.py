"""The gateway in front of two real SGLang servers (0.5.23 unless GATEWAY_ENGINE_SGLANG names another) on the CPU
(the engine kit's tiny model, ChatML template): what the simulator-backed suite asserts, checked against an engine
no one here wrote (docs/engines.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import parse_config
from gateway.preflight import check_config
from gateway.tokenizers.real import TOOL_LAYOUTS, TOOLS_PROBE, HfTokenizer
from gateway.upstreams import release
from gateway_lab.engines.envs import EngineEnv
from gateway_lab.engines.servers import Fleet
from gateway_lab.engines.workload import Session, direct_round_robin, order, run_sessions
from tests.gateway_fixtures import KEY_A, config, sglang_pool, start_gateway
from tests.support import ServerThread, wait_until

H = {"Authorization": f"Bearer {KEY_A}"}
VOCAB = 2048  # the kit's tiny model (gateway_lab/engines/model.py)


def gateway_config(urls: list[str], model_dir: Path, mode: str = "approximate", page: int = 64) -> dict[str, Any]:
    """`page`: the servers' page size as they report it (the precise index hashes at that size)."""
    routing: dict[str, Any] = {"mode": mode, "chunk_tokens": 256}
    if mode != "approximate":
        # speculative entries expire at once: a later turn can be a prefix hit only through the engine's events
        routing |= {"speculative_ttl_s": 0.01, "kv_events": {
            "discovery_interval_s": 0.3, "block_size": page, "speculative_s": 0.01,
            "tokenizer": {"kind": "hf", "path": str(model_dir)}}}
    pool = {**sglang_pool("p", urls, model="tiny"), "vocab_size": VOCAB}
    return config([pool], routing=routing,
                  timeouts={"connect": 2.0, "first_byte": 120.0, "idle": 60.0, "total": 300.0})


@pytest.fixture(scope="module")
def gateway(two_sglang: Fleet, model_dir: Path) -> Iterator[ServerThread]:
    gw = start_gateway(gateway_config(two_sglang.urls, model_dir))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def precise_gateway(two_sglang: Fleet, model_dir: Path, page: int) -> Iterator[ServerThread]:
    gw = start_gateway(gateway_config(two_sglang.urls, model_dir, mode="precise", page=page))
    yield gw
    gw.stop()


def chat(url: str, messages: list[dict[str, Any]], **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=H, timeout=120,
                      json={"model": "glm-5.2", "messages": messages, "max_tokens": 4, "temperature": 0, **kw})


def test_chat_and_completions_non_streaming(gateway: ServerThread, model_dir: Path) -> None:
    """Usage is the engine's, and its prompt count equals the gateway's own tokenizer's count of the same request."""
    tok = HfTokenizer.from_dir(str(model_dir))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world, the cache"}]
    r = chat(gateway.urls[0], messages)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["prompt_tokens"] == len(tok.encode_request("chat/completions", {"messages": messages}))
    assert r.headers["x-gateway-pool"] == "p"
    c = httpx.post(f"{gateway.urls[0]}/v1/completions", headers=H, timeout=120,
                   json={"model": "glm-5.2", "prompt": "the prefix cache", "max_tokens": 3, "temperature": 0,
                         "ignore_eos": True})
    assert c.status_code == 200, c.text
    assert c.json()["object"] == "text_completion" and c.json()["usage"]["completion_tokens"] == 3


def test_the_polls_read_real_servers_over_the_lean_client(gateway: ServerThread, sglang_env: EngineEnv) -> None:
    """The engine poller's load and /server_info reads and the health probe go over backends/polls.py's keep-alive
    pools: every target has the engine's load and release, and is reachable and healthy."""
    st = gateway.app.state.gateway
    wait_until(lambda: all(t.state.engine_load is not None for t in st.registry.targets), timeout=30,
               what="the engines' loads")
    for t in st.registry.targets:
        assert t.state.healthy and t.state.version and sglang_env.recipe.version.startswith(t.state.version), t.state
    assert st.poller._reachable and all(st.poller._reachable.values())
    assert st.health.gets is st.poller.gets  # one pool per server, the probes reuse the polls' connections
    assert all(p is not None and p.port for p in st.poller.gets._pools.values())


def test_streaming_chat_ends_with_usage_and_done(gateway: ServerThread) -> None:
    events: list[str] = []
    with httpx.stream("POST", f"{gateway.urls[0]}/v1/chat/completions", headers=H, timeout=120,
                      json={"model": "glm-5.2", "messages": [{"role": "user", "content": "stream please"}],
                            "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True},
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert any(c["choices"] and c["choices"][0].get("finish_reason") == "length" for c in chunks)


def test_streaming_cancellation_frees_the_engine(gateway: ServerThread, two_sglang: Fleet) -> None:
    """A client that goes away mid-stream: the engine's own running count returns to zero (nothing left decoding)."""
    with httpx.stream("POST", f"{gateway.urls[0]}/v1/chat/completions", headers=H, timeout=120,
                      json={"model": "glm-5.2", "messages": [{"role": "user", "content": "a long one"}],
                            "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # first token seen: hang up

    def idle() -> bool:
        for url in two_sglang.urls:
            loads = httpx.get(f"{url}/v1/loads", timeout=10).json()["loads"]
            if sum(x.get("num_running_reqs", 0) + x.get("num_waiting_reqs", 0) for x in loads):
                return False
        return True

    wait_until(idle, timeout=120, what="the engines to drop the cancelled request")


def test_token_ids_past_the_vocabulary_are_refused_before_the_engine(gateway: ServerThread, two_sglang: Fleet
                                                                     ) -> None:
    """Real SGLang 0.5.23 does not bound prompt token ids, and one past the vocabulary kills its scheduler; with the
    pool's `vocab_size` the gateway answers 400 in OpenAI's shape and both servers keep serving."""
    for prompt in ([5, VOCAB], [10_000_000], [[1, 2], [3, 99_999]]):
        r = httpx.post(f"{gateway.urls[0]}/v1/completions", headers=H, timeout=60,
                       json={"model": "glm-5.2", "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and err["code"] == "token_id_out_of_vocabulary", err
    ok = httpx.post(f"{gateway.urls[0]}/v1/completions", headers=H, timeout=120,
                    json={"model": "glm-5.2", "prompt": [5, VOCAB - 1], "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    for url in two_sglang.urls:
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def later_turns_cached(s: Session) -> bool:
    """Every later turn reported at least half the previous turn's prompt cached: a turn on the server that holds
    its conversation (the whole previous prompt, in whole pages), not the few template tokens all conversations share,
    whatever the page size."""
    return all(c >= p // 2 for c, p in zip(s.cached[1:], s.prompt, strict=False))


def test_prefix_affinity_by_the_engines_own_counters(gateway: ServerThread, two_sglang: Fleet) -> None:
    """Multi-turn sessions through the gateway keep each session on one server, so every later turn is reported
    cached by the engine; round-robin straight to the servers moves turns and loses those hits."""
    sessions = [Session(f"affinity-gw-{i}") for i in range(3)]
    gw = run_sessions(gateway.urls[0], sessions, turns=3, headers=H, model="glm-5.2")
    rr = direct_round_robin(two_sglang.urls, [Session(f"affinity-rr-{i}") for i in range(3)], turns=3)
    for s in gw.sessions:
        assert len(set(s.replicas[1:])) == 1, f"{s.name} moved: {s.replicas}"
        assert later_turns_cached(s), f"{s.name}: later turns not cached: {s.cached} of {s.prompt}"
    assert gw.later_hit_rate > rr.later_hit_rate, (gw.summary(), rr.summary())


def test_precise_mode_routes_from_real_kv_events(precise_gateway: ServerThread, model_dir: Path,
                                                 sglang_env: EngineEnv, page: int) -> None:
    """Speculative entries expire at once, so a later turn's prefix hit can only come from SGLang's own events,
    keyed by the real tokenizer (checked against /v1/tokenize at discovery)."""
    manager = precise_gateway.app.app.app.state.gateway.kv_events  # type: ignore[attr-defined]
    wait_until(lambda: manager.health()["healthy"] == 2, timeout=60, what="both subscriptions healthy")
    assert set(manager.health()["tokenizer"].values()) == {"ok"}, manager.health()
    assert set(manager.health()["tools"].values()) <= set(TOOL_LAYOUTS), manager.health()  # learned, one each
    sessions = [Session(f"precise-{i}") for i in range(2)]

    def held() -> int:
        return sum(len(st.blocks) for st in manager.ranks.values())

    seen = [held()]
    sent = iter(order(sessions, 3, by_session=False))

    def settle() -> None:
        """Wait until the turn's pages have reached this instance: at least the pages of its uncached prompt, less
        a partial last one (with 1-token pages, 0.5.13 sends one BlockStored per token)."""
        s = next(sent)
        want = seen[0] + max(1, (s.prompt[-1] - s.cached[-1]) // page - 1)
        wait_until(lambda: held() >= want, timeout=60, what=f"the turn's KV events applied ({want} blocks)")
        seen[0] = held()

    res = run_sessions(precise_gateway.urls[0], sessions, turns=3, headers=H, model="glm-5.2", between=settle)
    for s in res.sessions:
        assert s.routes[1:] == ["prefix_hit"] * (len(s.routes) - 1), (s.name, s.routes, s.replicas, manager.health())
        assert later_turns_cached(s), (s.name, s.cached, s.prompt)
    assert manager.index.answers.get("events", 0) > 0
    health = manager.health()["subscriptions"]
    assert all(h["apply_errors"] == 0 for h in health.values()), health
    # 0.5.23 publishes tagged maps; 0.5.13 tagged arrays (docs/engines.md, "Releases")
    encoding = "maps" if release(sglang_env.recipe.version) >= (0, 5, 23) else "arrays"
    assert all(h["encoding"] == encoding for h in health.values() if h["batches"]), health


def test_gateway_check_reads_real_servers(two_sglang: Fleet, model_dir: Path, sglang_env: EngineEnv) -> None:
    """The facts `gateway check` reads are the flags the kit started the servers with (the page size the release's
    recipe chose among them)."""
    cfg = parse_config(gateway_config(two_sglang.urls, model_dir))
    reports = asyncio.run(check_config(cfg))
    assert [r.ok for r in reports] == [True, True], [(r.server, [(f.check, f.message) for f in r.findings])
                                                     for r in reports]
    f = reports[0].facts
    assert f is not None and f.version == sglang_env.recipe.version and f.cache_report is True
    assert f.page_size == two_sglang.servers[0].flags.page_size
    assert f.priority_scheduling is True and f.default_priority_value == 0


def test_tokenizer_parity_with_the_engine(two_sglang: Fleet, model_dir: Path) -> None:
    """The gateway's tokenizer (tokenizer.json + the chat template through jinja2) gives SGLang's ids exactly."""
    tok = HfTokenizer.from_dir(str(model_dir))
    bodies = [
        {"messages": [{"role": "user", "content": "Héllo, wörld! 1 2 3 {\"ok\": true}"}]},
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again  \n\t spaces"}]},
        {"messages": [{"role": "user", "content": "日本語のテキスト and emoji 🙂"}]},
    ]
    for body in bodies:
        r = httpx.post(f"{two_sglang.urls[0]}/v1/tokenize", json={"model": "tiny", **body}, timeout=30)
        assert r.status_code == 200, r.text
        assert tok.encode_request("chat/completions", body).tolist() == r.json()["tokens"], body
    # with tools: how the engine hands them to its template differs by release, so the tokenizer learns it from the
    # engine's ids for a probe (as the precise gateway's check does); then the engine's prompt count of other tools
    # rendered by the template equals ours
    r = httpx.post(f"{two_sglang.urls[0]}/v1/tokenize", json={"model": "tiny", **TOOLS_PROBE}, timeout=30)
    assert r.status_code == 200, r.text
    assert tok.learn_tool_layout(r.json()["tokens"]) in TOOL_LAYOUTS, tok.tool_layout
    body = {"messages": [{"role": "user", "content": "weather in Paris?"}],
            "tools": [WEATHER, {"type": "function", "function": {"name": "now"}}]}  # (a strict tool ends 0.5.13 on
    # the CPU: it constrains decoding with xgrammar, whose CPU mask raises in the scheduler; docs/engines.md)
    r = httpx.post(f"{two_sglang.urls[0]}/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode_request("chat/completions", body))


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_responses_bridge_with_a_tool_call_through_the_real_template(gateway: ServerThread) -> None:
    """A Responses request whose history holds a function call and its output is bridged onto chat, rendered by
    SGLang's chat template (the call and the result become part of the prompt), and answered in Responses' shape."""
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city",
            "parameters": WEATHER["function"]["parameters"]}
    history = [{"role": "user", "content": "weather in Paris?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21C"}]
    short = httpx.post(f"{gateway.urls[0]}/v1/responses", headers=H, timeout=120,
                       json={"model": "glm-5.2", "input": history[:1], "tools": [tool], "max_output_tokens": 4})
    long = httpx.post(f"{gateway.urls[0]}/v1/responses", headers=H, timeout=120,
                      json={"model": "glm-5.2", "input": history, "tools": [tool], "max_output_tokens": 4})
    assert short.status_code == 200 and long.status_code == 200, (short.text, long.text)
    assert long.json()["object"] == "response" and long.json()["status"] in ("completed", "incomplete")
    assert long.json()["usage"]["input_tokens"] > short.json()["usage"]["input_tokens"]


def test_messages_bridge_with_tool_use_through_the_real_template(gateway: ServerThread) -> None:
    tool = {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER["function"]["parameters"]}
    msgs = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    hdr = {"x-api-key": KEY_A, "anthropic-version": "2023-06-01"}
    short = httpx.post(f"{gateway.urls[0]}/v1/messages", headers=hdr, timeout=120,
                       json={"model": "glm-5.2", "max_tokens": 4, "tools": [tool], "messages": msgs[:1]})
    long = httpx.post(f"{gateway.urls[0]}/v1/messages", headers=hdr, timeout=120,
                      json={"model": "glm-5.2", "max_tokens": 4, "tools": [tool], "messages": msgs})
    assert short.status_code == 200 and long.status_code == 200, (short.text, long.text)
    assert long.json()["type"] == "message" and long.json()["role"] == "assistant"

    def prompt(r: httpx.Response) -> int:  # Messages counts cached input apart from input_tokens
        u = r.json()["usage"]
        return int(u["input_tokens"]) + int(u.get("cache_read_input_tokens") or 0)

    assert prompt(long) > prompt(short)
