"""/v1/responses through the official openai SDK and the OpenAI Agents SDK, over loopback, in front of simulated
SGLang replicas (cache report on, as `--enable-cache-report`), with stored responses in memory and in Redis."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from gateway.config import hash_key
from tests.gateway_fixtures import KEY_A, KEY_B, config, sglang_pool, start_gateway
from tests.support import RedisServer, start_sims, wait_until

FULL = {"ignore_eos": True}  # the simulator then generates exactly max_output_tokens
TOOL = {"type": "function", "name": "lookup", "description": "Look a topic up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}


def _cfg(urls: list[str], **extra):
    return config([sglang_pool("mi355x", urls)],
                  tenants=[{"name": "tenant-a", "api_key_hashes": [hash_key(KEY_A)], "models": ["glm-5.2"]},
                           {"name": "tenant-b", "api_key_hashes": [hash_key(KEY_B)], "models": ["glm-5.2"]}], **extra)


@pytest.fixture(scope="module")
def stack():
    sims, _ = start_sims(2, enable_cache_report=True)
    gw = start_gateway(_cfg(sims.urls))
    yield {"gw": gw, "sims": sims, "base": gw.urls[0] + "/v1"}
    gw.stop()
    sims.stop()


@pytest.fixture
def client(stack):
    return OpenAI(base_url=stack["base"], api_key=KEY_A, max_retries=0)


def test_create_non_stream_then_retrieve_and_delete(client):
    r = client.responses.with_raw_response.create(model="glm-5.2", input="Tell me about prefix caches.",
                                                  instructions="Be brief.", max_output_tokens=12,
                                                  metadata={"case": "a"}, extra_body=FULL)
    resp = r.parse()
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == "glm-5.2"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert len(resp.output_text.split()) == 12 and resp.usage.output_tokens == 12
    assert resp.usage.input_tokens > 0 and resp.instructions == "Be brief." and resp.metadata == {"case": "a"}
    assert r.headers["x-gateway-replica"].startswith("mi355x-")  # served by the chat path: its headers come along
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    items = client.responses.input_items.list(resp.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Tell me about prefix caches."
    assert client.responses.delete(resp.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_stream_event_sequence(client):
    events = list(client.responses.create(model="glm-5.2", input="Stream please.", max_output_tokens=8, stream=True,
                                          extra_body=FULL))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and len(text.split()) == 8 and final.usage.output_tokens == 8
    assert client.responses.retrieve(final.id).output_text == text  # streamed responses are stored too


def test_sdk_stream_completes_with_stop(client):
    """The SDK's `responses.stream` accumulator (stricter than plain iteration) reaches a completed response."""
    with client.responses.stream(model="glm-5.2", input="Short answer please.", max_output_tokens=400) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text


def test_five_turn_chain_stays_on_one_replica_with_growing_cached_tokens(client):
    """Each turn extends the previous one's prompt; the bridge expands previous_response_id into the same messages
    the client would have sent, so the prefix hash sends every turn to the replica holding the conversation."""
    prev, replicas, cached = None, [], []
    for turn in range(5):
        r = client.responses.with_raw_response.create(
            model="glm-5.2", input=f"Turn {turn}: " + "tell me more about routing and caches. " * 40,
            previous_response_id=prev, max_output_tokens=32, extra_body=FULL)
        resp = r.parse()
        prev = resp.id
        replicas.append(r.headers["x-gateway-replica"])
        cached.append(resp.usage.input_tokens_details.cached_tokens)
    assert len(set(replicas)) == 1, replicas
    assert cached[1] > 0 and all(b > a for a, b in itertools.pairwise(cached[1:])), cached
    items = client.responses.input_items.list(prev, order="asc", limit=100).data
    assert [i.type for i in items] == ["message"] * 9  # 5 user turns and 4 assistant answers, in order


def test_function_call_round_trip(client):
    r1 = client.responses.create(model="glm-5.2", input="Look up prefix caches.", tools=[TOOL], tool_choice="required",
                                 max_output_tokens=16)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert r1.status == "completed" and len(calls) == 1 and calls[0].name == "lookup"
    assert "query" in __import__("json").loads(calls[0].arguments)
    r2 = client.responses.create(model="glm-5.2", previous_response_id=r1.id, tools=[TOOL], max_output_tokens=16,
                                 input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                         "output": "Prefix caches keep KV of shared prompt prefixes."}], extra_body=FULL)
    assert r2.output_text and not [o for o in r2.output if o.type == "function_call"]
    items = client.responses.input_items.list(r2.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]


def test_stream_function_call_arguments_events(client):
    events = list(client.responses.create(model="glm-5.2", input="Look it up.", tools=[TOOL],
                                          tool_choice={"type": "function", "name": "lookup"}, stream=True))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments and events[-1].response.output[-1].arguments == done.arguments
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[-1].type == "function_call"


def test_bad_input_gets_openai_error_shape(stack, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="glm-5.2", input="x", tools=[{"type": 7}])
    assert e.value.body["param"] == "tools[0].type" and e.value.body["type"] == "invalid_request_error"
    # a hosted tool the pool cannot run is left out (the tenant's default `hosted_tools: drop`) and named
    r = client.responses.with_raw_response.create(model="glm-5.2", input="x", max_output_tokens=4,
                                                  tools=[{"type": "web_search"}])
    assert r.headers["x-gateway-dropped"] == "tools[0]=hosted_tool" and r.parse().status in ("completed", "incomplete")
    r = httpx.post(stack["base"] + "/responses", headers={"authorization": f"Bearer {KEY_A}"}, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(stack["base"] + "/responses", headers={"authorization": "Bearer nope"},
                   json={"model": "glm-5.2", "input": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")


def test_another_tenants_response_is_404(stack, client):
    mine = client.responses.create(model="glm-5.2", input="secret", max_output_tokens=4)
    other = OpenAI(base_url=stack["base"], api_key=KEY_B, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError) as e:
        other.responses.create(model="glm-5.2", input="continue", previous_response_id=mine.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id


def test_store_false_is_not_retrievable(client):
    r = client.responses.create(model="glm-5.2", input="ephemeral", store=False, max_output_tokens=4)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_mid_stream_failure_ends_with_error_and_failed_events(stack, client):
    for u in stack["sims"].urls:
        httpx.post(u + "/_sim/fault", json={"kind": "reset_after_chunks", "n": 3, "count": 1})
    try:
        events = list(client.responses.create(model="glm-5.2", input="fail me", max_output_tokens=200, stream=True,
                                              extra_body=FULL))
    finally:
        for u in stack["sims"].urls:
            httpx.post(u + "/_sim/fault", json={"kind": "clear"})
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-2:] == ["error", "response.failed"], types
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    assert "response.completed" not in types


def _research_agent(base: str, seen: list[str], max_tokens: int):
    """An openai-agents Agent on the gateway's Responses API that must call its one tool (calls land in `seen`)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def lookup(query: str) -> str:
        """Look a topic up."""
        seen.append(query)
        return "Prefix caches keep the KV of shared prompt prefixes."

    client = AsyncOpenAI(base_url=base, api_key=KEY_A, max_retries=0)
    return Agent(name="researcher", instructions="Use the lookup tool, then answer.", tools=[lookup],
                 model=OpenAIResponsesModel(model="glm-5.2", openai_client=client),
                 model_settings=ModelSettings(tool_choice="required", max_tokens=max_tokens))


def test_agents_sdk_runs_a_tool_using_agent_to_completion(stack):
    from agents import Runner

    seen: list[str] = []
    result = asyncio.run(Runner.run(_research_agent(stack["base"], seen, 24), "What is a prefix cache?", max_turns=4))
    assert seen, "the agent never called its tool"
    assert isinstance(result.final_output, str) and result.final_output
    kinds = [type(i).__name__ for i in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"


def test_agents_sdk_streamed_run_completes(stack):
    """`Runner.run_streamed` consumes the typed event stream itself (and fails a run whose stream ends otherwise
    than `response.completed`), so this checks the event sequence against the SDK's own accumulator."""
    from agents import Runner

    seen: list[str] = []

    async def run() -> tuple[object, list[str]]:
        result = Runner.run_streamed(_research_agent(stack["base"], seen, 4000), "What is a prefix cache?", max_turns=4)
        kinds = [ev.type async for ev in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert seen and isinstance(result.final_output, str) and result.final_output
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


def test_agents_sdk_with_max_tokens_completes_every_run(stack):
    """Nine streamed runs with `ModelSettings(max_tokens=512)`, each a different question: every run calls its tool
    and completes. A streamed run whose answer is cut by the cap ends `response.incomplete`, which the SDK raises;
    the simulator's answers end where a model's would (its EOS draw for an agent turn), not at the cap."""
    from agents import Runner

    async def run(i: int) -> object:
        seen: list[str] = []
        result = Runner.run_streamed(_research_agent(stack["base"], seen, 512), f"Question {i}: what is a prefix "
                                     f"cache, in {i + 2} sentences?", max_turns=4)
        async for _ in result.stream_events():
            pass
        assert seen
        return result.final_output

    async def all_runs() -> list[object]:
        return [await run(i) for i in range(9)]

    outputs = asyncio.run(all_runs())
    assert len(outputs) == 9 and all(isinstance(o, str) and o for o in outputs)


def test_stored_responses_are_shared_through_redis(redis_server):
    """Two gateway instances on one Redis: a turn stored by one is retrieved and continued on the other."""
    sims, _ = start_sims(1, enable_cache_report=True)
    cfg = _cfg(sims.urls, routing={"redis_url": redis_server.url, "redis_prefix": "h7resp:"},
               responses={"ttl_s": 60, "max_per_tenant": 2})
    gws = [start_gateway(cfg), start_gateway(cfg)]
    try:
        a, b = (OpenAI(base_url=g.urls[0] + "/v1", api_key=KEY_A, max_retries=0) for g in gws)
        r1 = a.responses.create(model="glm-5.2", input="first turn", max_output_tokens=4)
        assert b.responses.retrieve(r1.id).output_text == r1.output_text
        r2 = b.responses.create(model="glm-5.2", input="second turn", previous_response_id=r1.id, max_output_tokens=4)
        assert len(a.responses.input_items.list(r2.id).data) == 3
        other = OpenAI(base_url=gws[1].urls[0] + "/v1", api_key=KEY_B, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(r1.id)
        # over max_per_tenant=2: the least recently used conversation loses its newest turn (a turn without its
        # earlier ones could not be continued; the earlier ones still can)
        a.responses.create(model="glm-5.2", input="third", max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(r2.id)
        assert a.responses.retrieve(r1.id).id == r1.id
    finally:
        for g in gws:
            g.stop()
        sims.stop()


def test_memory_store_past_max_memory_bytes_evicts_the_oldest_across_tenants():
    """The in-memory store holds at most `responses.max_memory_bytes` of records, all tenants together: each ~320 KB
    turn (its input item is stored whole) past the 1 MiB bound evicts the oldest stored turn, whoever's it is, and a
    chain continued from an evicted turn is the documented 404 with `param: previous_response_id`."""
    sims, _ = start_sims(1)
    gw = start_gateway(_cfg(sims.urls, responses={"max_memory_bytes": 1024 * 1024}))
    try:
        a, b = (OpenAI(base_url=gw.urls[0] + "/v1", api_key=k, max_retries=0) for k in (KEY_A, KEY_B))

        def turn(c: OpenAI, i: int) -> str:
            return c.responses.create(model="glm-5.2", input=f"turn {i} " + "x" * 320_000, max_output_tokens=2).id

        def stored(c: OpenAI, rid: str) -> bool:
            try:
                return c.responses.retrieve(rid).id == rid
            except openai.NotFoundError:
                return False

        ids = [(a, turn(a, 1)), (b, turn(b, 2)), (a, turn(a, 3))]  # ~970 KB: under the bound, all kept
        assert all(stored(c, rid) for c, rid in ids)
        ids.append((a, turn(a, 4)))  # past the bound: the oldest (tenant A's first) goes
        assert [stored(c, rid) for c, rid in ids] == [False, True, True, True]
        ids.append((a, turn(a, 5)))  # and then the next oldest, tenant B's, though only A is storing
        assert [stored(c, rid) for c, rid in ids] == [False, False, True, True, True]
        evicted = ids[0][1]
        r = httpx.post(gw.urls[0] + "/v1/responses", headers={"authorization": f"Bearer {KEY_A}"},
                       json={"model": "glm-5.2", "input": "continue", "previous_response_id": evicted})
        assert r.status_code == 404
        assert r.json()["error"] == {"message": f"No response found with id '{evicted}'.",
                                     "type": "invalid_request_error", "param": "previous_response_id",
                                     "code": "not_found"}
        with pytest.raises(openai.NotFoundError):
            a.responses.input_items.list(evicted)
        # a kept turn still continues its chain
        assert a.responses.create(model="glm-5.2", input="continue", previous_response_id=ids[-1][1],
                                  max_output_tokens=2).id
    finally:
        gw.stop()
        sims.stop()


def test_store_down_reads_are_503_writes_are_skipped_answers_still_served():
    """Redis gone: a chain cannot be continued from a guess (503 with Retry-After, OpenAI shape), but a new turn is
    still answered (its store write skipped); with Redis back, storing resumes."""
    redis = RedisServer()
    sims, _ = start_sims(1)
    gw = start_gateway(_cfg(sims.urls, routing={"redis_url": redis.url}))
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        r1 = c.responses.create(model="glm-5.2", input="before the outage", max_output_tokens=4)
        redis.kill()
        with pytest.raises(openai.InternalServerError) as e:
            c.responses.create(model="glm-5.2", input="next", previous_response_id=r1.id, max_output_tokens=4)
        assert e.value.status_code == 503 and e.value.response.headers.get("retry-after")
        assert e.value.body["type"] == "service_unavailable_error"
        with pytest.raises(openai.InternalServerError):
            c.responses.retrieve(r1.id)
        r2 = c.responses.create(model="glm-5.2", input="during the outage", max_output_tokens=4)
        assert r2.output_text
        redis.start()
        wait_until(lambda: _stored(c, c.responses.create(model="glm-5.2", input="after", max_output_tokens=4)),
                   timeout=10, what="storing to resume")
    finally:
        gw.stop()
        sims.stop()
        redis.stop()


def _stored(c: OpenAI, r) -> bool:
    try:
        return c.responses.retrieve(r.id).id == r.id
    except (openai.NotFoundError, openai.InternalServerError):
        return False


def test_malformed_ids_are_404_without_touching_the_store(stack):
    h = {"authorization": f"Bearer {KEY_A}"}
    for rid in ("not-an-id", "resp_abc:def", "resp_" + "a" * 200):
        r = httpx.get(f"{stack['base']}/responses/{rid}", headers=h)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", rid
    r = httpx.post(stack["base"] + "/responses", headers=h, json={"model": "glm-5.2", "input": "x",
                                                                  "previous_response_id": "../../etc"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


def test_input_tokens_counts_what_a_create_would_send(client):
    """Counted with the history expanded, the same prompt the engine then reports."""
    r1 = client.responses.create(model="glm-5.2", input="count me " * 50, max_output_tokens=4)
    counted = client.responses.input_tokens.count(model="glm-5.2", input="and this", previous_response_id=r1.id,
                                                  instructions="Be brief.", tools=[TOOL])
    r2 = client.responses.create(model="glm-5.2", input="and this", previous_response_id=r1.id,
                                 instructions="Be brief.", tools=[TOOL], max_output_tokens=4)
    assert counted.input_tokens == r2.usage.input_tokens > r1.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(model="no-such-model", input="x")


def test_input_tokens_uses_the_models_tokenizer_where_the_gateway_loaded_one(tmp_path):
    """Precise routing with a real tokenizer (routing.kv_events.tokenizer kind hf): input_tokens counts the templated
    prompt, stored history included, with it; without one (the stack above) the 4-characters rule (the test before)."""
    from gateway.tokenizer import count_tokens, render_chat
    from gateway.tokenizers.real import HfTokenizer
    from tests.tokenizers.test_real_tokenizer import make_tokenizer_dir

    make_tokenizer_dir(tmp_path)
    sims, _ = start_sims(1)
    gw = start_gateway(_cfg(sims.urls, routing={"mode": "precise", "kv_events": {
        "tokenizer": {"kind": "hf", "path": str(tmp_path), "check_engine": False}}}))
    try:
        c = OpenAI(base_url=gw.urls[0] + "/v1", api_key=KEY_A, max_retries=0)
        r1 = c.responses.create(model="glm-5.2", input="hello world", max_output_tokens=4)
        counted = c.responses.input_tokens.count(model="glm-5.2", input="how are you today?",
                                                 instructions="you are a helpful assistant", previous_response_id=r1.id)
        msgs = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "how are you today?"}]
        t = HfTokenizer.from_dir(str(tmp_path))
        want = len(t.tok.encode(t.render(msgs, None), add_special_tokens=False).ids)
        assert counted.input_tokens == want != count_tokens(render_chat(msgs))
    finally:
        gw.stop()
        sims.stop()
