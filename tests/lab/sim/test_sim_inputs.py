"""The simulator never hangs on any input: bad bodies get SGLang's flat 400 at once, work per request is bounded,
completions batches answer one choice per prompt, usage is never negative, and `gateway sim` stops on SIGTERM
whatever it is doing. Over real loopback HTTP (and a real `gateway sim` process for the signal)."""

import json
import signal
import subprocess
import sys

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import env_without_proxies, free_port, start_sims, wait_http, wait_until

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
NORMAL_CHAT = {"model": "glm-5.2", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

POISON = [
    (COMP, {"model": "glm-5.2", "prompt": "x", "max_tokens": 4, "n": 1000000}, "n must be in"),
    (COMP, {"model": "glm-5.2", "prompt": "x", "max_tokens": 1e308}, "max_tokens"),
    (COMP, {"model": "glm-5.2", "prompt": "x", "max_tokens": 4, "logprobs": 1e308}, "logprobs"),
    (COMP, {"model": "glm-5.2", "prompt": "x", "max_tokens": 4, "logprobs": 1000}, "logprobs"),
    (COMP, {"model": "glm-5.2", "prompt": [1099511627776], "max_tokens": 3}, "out of vocabulary"),
    (COMP, {"model": "glm-5.2", "prompt": [-1, 5], "max_tokens": 3}, "out of vocabulary"),
    (COMP, {"model": "glm-5.2", "prompt": [""]}, "Prompt cannot be empty"),
    (COMP, {"model": "glm-5.2", "prompt": [[], []]}, "Prompt cannot be empty"),
    (COMP, {"model": "glm-5.2", "prompt": ["a", ""]}, "Prompt cannot be empty"),
    (COMP, {"model": "glm-5.2", "prompt": ["a"] * 100, "n": 100}, "choices"),
    (COMP, {"model": "glm-5.2", "prompt": "x", "max_tokens": 100000, "n": 128, "ignore_eos": True}, "KV pool"),
    (COMP, {"model": "glm-5.2", "prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    (CHAT, {**NORMAL_CHAT, "tools": [1], "tool_choice": "required"}, "tools.0"),
    (CHAT, {**NORMAL_CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}]},
     "invalid 'parameters' schema"),
    (CHAT, {**NORMAL_CHAT, "top_logprobs": 1e308, "logprobs": True}, "top_logprobs"),
    (CHAT, {**NORMAL_CHAT, "max_completion_tokens": 10**12}, "max_completion_tokens is too large"),
    (CHAT, {**NORMAL_CHAT, "temperature": -1}, "temperature"),
    (CHAT, {**NORMAL_CHAT, "top_p": 0}, "top_p"),
    (CHAT, {**NORMAL_CHAT, "top_k": 0}, "top_k"),
    (CHAT, {**NORMAL_CHAT, "presence_penalty": 1e308}, "presence_penalty"),
    (CHAT, {**NORMAL_CHAT, "logit_bias": {"999999999": 1}}, "logit_bias"),
    (CHAT, {**NORMAL_CHAT, "logit_bias": {"abc": 1}}, "int()"),
    (CHAT, {**NORMAL_CHAT, "seed": 2**70}, "seed"),
    (CHAT, {**NORMAL_CHAT, "n": 0}, "n must be in"),
    (CHAT, {**NORMAL_CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "minItems": 10**9}}}}, "json_schema"),
    (CHAT, {**NORMAL_CHAT, "messages": [{"role": "user", "content": {"deep": 1}}]}, "content"),
]


def _deep(depth: int) -> dict:
    node: dict = {}
    for _ in range(depth):
        node = {"type": "object", "properties": {"x": node}}
    return node


@pytest.fixture(scope="module")
def sim():
    st_, reps = start_sims(1, enable_cache_report=True, time_scale=1000.0)  # fast: the fuzz below makes real requests
    yield st_.urls[0], reps[0]
    st_.stop()


_client = httpx.Client(timeout=10)  # one client: building one per call costs ~50 ms (its TLS context)


def _post(url, path, body):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return _client.post(url + path, content=data, headers={"content-type": "application/json"})


def _normal_is_served(url):
    """A normal request is still answered (within the client's timeout): the bad input before it left nothing
    hung or wedged."""
    return _post(url, CHAT, NORMAL_CHAT).status_code == 200


@pytest.mark.parametrize("path,body,fragment", POISON, ids=[f"{i}" for i in range(len(POISON))])
def test_poison_bodies_get_sglang_400(sim, path, body, fragment):
    """Each gets the flat SGLang envelope (code 400) naming the problem; the simulator still serves at once."""
    url, _ = sim
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    b = r.json()
    assert b["object"] == "error" and b["code"] == 400 and fragment in b["message"], b
    assert _normal_is_served(url)


def test_deep_json_is_400_not_500(sim):
    url, _ = sim
    deep_tools = [{"type": "function", "function": {"name": "f", "parameters": _deep(300)}}]
    assert _post(url, CHAT, {**NORMAL_CHAT, "tools": deep_tools}).status_code == 400
    ignored = '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "x", "extra": %s}]}'
    assert _post(url, CHAT, ignored % ("[" * 500 + "]" * 500)).status_code == 200  # unknown fields: ignored
    calls = '{"model": "m", "messages": [{"role": "assistant", "content": null, "tool_calls": %s}, {"role": "user", "content": "x"}]}'
    assert _post(url, CHAT, calls % ("[" * 400 + "]" * 400)).status_code == 400  # rendered into the prompt: too deep
    assert _post(url, CHAT, "[" * 5000 + "]" * 5000).status_code == 400  # past the JSON parser's depth
    assert _normal_is_served(url)


def test_completions_prompt_list_gives_one_choice_per_prompt_times_n(sim):
    """SGLang indexes a batch prompt-major: choice = prompt * n + j; usage counts each prompt once."""
    url, _ = sim
    r = _post(url, COMP, {"prompt": ["abcd", "efghijkl"], "n": 2, "max_tokens": 3, "ignore_eos": True})
    b = r.json()
    assert [c["index"] for c in b["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" and len(c["text"].split()) == 3 for c in b["choices"])
    assert b["usage"]["prompt_tokens"] == 1 + 2 and b["usage"]["completion_tokens"] == 12
    ids = _post(url, COMP, {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "ignore_eos": True}).json()
    assert len(ids["choices"]) == 2 and ids["usage"]["prompt_tokens"] == 5
    chunks = [json.loads(line[6:]) for line in _post(url, COMP, {"prompt": ["a", "b", "c"], "max_tokens": 2,
              "stream": True, "stream_options": {"include_usage": True}}).text.split("\n\n")
              if line.startswith("data: {")]
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1, 2}
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]) == 3


def test_usage_never_negative_and_cached_counts_each_prompt_once(sim):
    """The old bug: `prompt: [""]` reached the cache as a 0-token sequence and reported cached_tokens -64."""
    url, _ = sim
    prompt = list(range(1, 200))
    _post(url, COMP, {"prompt": prompt, "max_tokens": 1})
    r = _post(url, COMP, {"prompt": [prompt, prompt], "n": 2, "max_tokens": 1}).json()
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached <= r["usage"]["prompt_tokens"] == 2 * len(prompt)
    for body in ({"prompt": "x"}, {"prompt": [7]}, {"prompt": ["y", "z"]}):
        u = _post(url, COMP, {**body, "max_tokens": 1}).json()["usage"]
        assert min(u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]) >= 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "n", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "temperature", "top_p",
          "top_k", "seed", "stop", "stream", "stream_options", "tools", "tool_choice", "response_format", "logit_bias",
          "ignore_eos", "data_parallel_rank", "rid", "min_tokens", "presence_penalty"]
messages = st.one_of(json_values, st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool", 3]),
                                                                  "content": json_values}), max_size=3))
prompts = st.one_of(json_values, st.lists(st.integers(min_value=-5, max_value=2**41), max_size=5),
                    st.lists(st.text(max_size=5), max_size=3))
bodies = st.fixed_dictionaries({}, optional={**{f: json_values for f in FIELDS}, "messages": messages,
                                             "prompt": prompts, "max_tokens": st.integers(-3, 40)})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])
@given(path=st.sampled_from([CHAT, COMP]), body=bodies)
def test_fuzz_never_5xx_and_stays_responsive(sim, path, body):
    """Random JSON at both endpoints: every answer is 2xx or 4xx (an answered 200 stream ends with [DONE])."""
    url, _ = sim
    if body.get("stream") is True:
        body["max_tokens"] = 4  # keep a valid stream short
    r = _post(url, path, body)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["object"] == "error"


def test_after_fuzz_normal_requests_are_served(sim):
    url, _ = sim
    assert all(_normal_is_served(url) for _ in range(3))


def test_gateway_sim_exits_on_sigterm_with_work_in_flight():
    """A poison body, a hung request and a long stream in flight, then SIGTERM: the process is gone within seconds."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "sim", "--replicas", "1", "--port", str(port),
                             "--time-scale", "50"], env=env_without_proxies(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ping", proc=proc)
        assert _post(url, COMP, POISON[0][1]).status_code == 400
        c1 = httpx.Client(timeout=30)
        c2 = httpx.Client(timeout=30)
        import threading

        def hold(client, headers, body):
            try:
                with client.stream("POST", url + COMP, json=body, headers=headers) as r:
                    for _ in r.iter_bytes():
                        pass
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=hold, args=(c1, {"x-sim-fault": "hang"}, {"prompt": "x"}), daemon=True),
                   threading.Thread(target=hold, args=(c2, {}, {"prompt": "x", "max_tokens": 900000,
                                                              "ignore_eos": True, "stream": True}), daemon=True)]
        for t in threads:
            t.start()
        wait_until(lambda: httpx.get(url + "/_sim/state").json()["inflight"] >= 2, timeout=10,
                   what="both requests in flight")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=8)  # raises if it is still running
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_completions_structured_output(sim):
    """SGLang's completions take `json_schema` (a JSON string) or `response_format`: the text is JSON for it, and
    completion_tokens follow the text (4 characters a token)."""
    import jsonschema

    url, _ = sim
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}, "required": ["n"],
              "additionalProperties": False}
    for extra in ({"json_schema": json.dumps(schema)},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}):
        b = _post(url, COMP, {"prompt": "count", "max_tokens": 64, **extra}).json()
        text = b["choices"][0]["text"]
        jsonschema.validate(json.loads(text), schema)
        assert b["choices"][0]["finish_reason"] == "stop" and b["usage"]["completion_tokens"] == -(-len(text) // 4)
    assert _post(url, COMP, {"prompt": "x", "json_schema": "{not json"}).status_code == 400
    cut = _post(url, COMP, {"prompt": "count", "max_tokens": 1, "json_schema": json.dumps(schema)}).json()
    assert cut["choices"][0]["finish_reason"] == "length" and len(cut["choices"][0]["text"]) == 4


@pytest.mark.parametrize("path,body,fragment", [
    (CHAT, '{"messages": [{"role": "user", "content": "%s"}]}' % ("a" * (17 << 20)), "limit"),
    (COMP, json.dumps({"prompt": [[1]] * 400_000}), "JSON arrays and objects"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": ""}] * 100_001}), "messages exceed"),
    (COMP, json.dumps({"prompt": ["a"] * 200_000}), "choices"),
    (CHAT, json.dumps({**NORMAL_CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "array", "minItems": 2000, "items": {"type": "integer"}}}} for i in range(50)]}), "demand more"),
    (CHAT, json.dumps({**NORMAL_CHAT, "n": 128, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "array", "minItems": 5000, "items": {"type": "integer"}}}}}), "demand more"),
], ids=["body-size", "containers", "messages", "batch", "tool-schemas", "n-structured"])
def test_bodies_that_would_buy_unbounded_work_are_refused_cheaply(sim, path, body, fragment):
    """Large or many-part bodies are refused by their size or counts before the per-item work."""
    url, _ = sim
    r = _post(url, path, body)
    assert r.status_code == 400 and fragment in r.json()["message"], r.text[:300]
    assert _normal_is_served(url)


def test_large_valid_body_is_served_off_the_loop(sim):
    """Bodies above 1 MiB are parsed on a worker thread; the answer is the same."""
    url, _ = sim
    ids = list(range(1000, 101000)) * 4  # 400k tokens, ~2.8 MB
    r = _post(url, COMP, {"prompt": ids, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 400_000
    assert _normal_is_served(url)
