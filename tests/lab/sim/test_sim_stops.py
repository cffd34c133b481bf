"""Where the simulator's answers end, as a real engine's do: at EOS drawn per workload (short agent turns, longer
chat answers; a generous max_tokens is almost never reached), at the cap, or at a `stop` string (SGLang: finish_reason
"stop", matched_stop the string, the string trimmed from the text). Over real HTTP, streamed and not."""

from __future__ import annotations

import httpx
import orjson
import pytest

from gateway_lab.sim.protocol import WORDS, output_text, stop_at
from tests.support import start_sims

TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def sim():
    st, _ = start_sims(1)
    yield st.urls[0]
    st.stop()


def chat(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(url: str, **body) -> tuple[str, str, object]:
    text, finish, matched = "", None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json={"model": "m", "stream": True, **body}, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in orjson.loads(line[6:]).get("choices") or []:
                text += (c.get("delta") or {}).get("content") or ""
                if c.get("finish_reason"):
                    finish, matched = c["finish_reason"], c.get("matched_stop")
    return text, finish, matched


def test_a_stop_string_in_the_text_ends_it_there_trimmed(sim):
    msgs = [{"role": "user", "content": "say many words"}]
    full = chat(sim, messages=msgs, max_tokens=64, ignore_eos=True, seed=1)["choices"][0]["message"]["content"]
    word = next(w for w in WORDS[1:] if w in full[20:])  # a word that occurs after the start
    cut = full.index(word)
    r = chat(sim, messages=msgs, max_tokens=64, ignore_eos=True, seed=1, stop=[word, "never-there"])
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == word
    assert c["message"]["content"] == full[:cut]  # the text before the stop string, the string trimmed
    assert r["usage"]["completion_tokens"] < 64
    text, finish, matched = streamed(sim, messages=msgs, max_tokens=64, ignore_eos=True, seed=1, stop=word)
    assert (text, finish, matched) == (full[:cut], "stop", word)


def test_an_answer_that_ends_by_itself_ends_on_the_stop_string_it_was_given(sim):
    """A model told to end with a marker writes it where it would have stopped: matched_stop is that string."""
    msgs = [{"role": "user", "content": "answer, then </answer>"}]
    c = chat(sim, messages=msgs, max_tokens=4000, seed=2, stop=["</answer>"])["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == "</answer>" and "</answer>" not in c["message"]["content"]
    plain = chat(sim, messages=msgs, max_tokens=4000, seed=2)["choices"][0]
    assert plain["finish_reason"] == "stop" and isinstance(plain["matched_stop"], int)  # EOS
    assert plain["message"]["content"] == c["message"]["content"]


def test_the_cap_still_wins_when_the_draw_runs_past_it(sim):
    c = chat(sim, messages=[{"role": "user", "content": "x"}], max_tokens=3, seed=3, stop=["</answer>"])["choices"][0]
    assert c["finish_reason"] == "length" and c["matched_stop"] is None


def test_natural_lengths_rarely_reach_a_generous_cap_and_agent_turns_are_shorter(sim):
    """Sixty prompts each: chat answers end on EOS before max_tokens=4000, agent turns (tools offered, answering a
    tool result) before max_tokens=600 (an exponential length with the old mean of 256 put 10% of them at that cap:
    the agent loop then sees an incomplete answer), and an agent's text turn is typically shorter."""
    chat_lens, agent_lens = [], []
    for i in range(60):
        u = {"role": "user", "content": f"question {i}"}
        c = chat(sim, messages=[u], max_tokens=4000)
        assert c["choices"][0]["finish_reason"] == "stop"
        chat_lens.append(c["usage"]["completion_tokens"])
        turn = [u, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "found it"}]
        a = chat(sim, messages=turn, tools=[TOOL], max_tokens=600)
        assert a["choices"][0]["finish_reason"] == "stop"
        agent_lens.append(a["usage"]["completion_tokens"])
    assert sorted(agent_lens)[30] < sorted(chat_lens)[30]
    assert len(set(chat_lens)) > 20  # a distribution, not a constant


def test_stop_at_is_pure():
    base = 77
    text = output_text(base, 0, 40)
    word = text.split(" ")[5]
    hit = stop_at(base, 40, [" " + word], natural_end=False)
    assert hit is not None and hit.keep == text.index(" " + word) and hit.matched == " " + word
    assert output_text(base, 0, hit.tokens).endswith(" " + word)
    assert stop_at(base, 40, ["zzz"], natural_end=False) is None
    assert stop_at(base, 40, ["zzz"], natural_end=True).matched == "zzz"
    assert stop_at(base, 40, [], natural_end=True) is None
