from gateway.tokenizer import GENERATION_PROMPT, count_tokens, render_chat, render_head, render_message, token_ids


def test_count_is_ceil_of_quarter_length():
    """The documented rule the gateway relies on to estimate tokens: ceil(chars / 4)."""
    assert count_tokens("") == 0
    assert count_tokens("abcd") == 1
    assert count_tokens("abcde") == 2
    assert len(token_ids("x" * 4001)) == 1001


def test_ids_are_prefix_stable():
    """A prefix's ids never depend on what follows: the basis of prefix caching."""
    a = token_ids("shared prefix text " * 50 + "tail one")
    b = token_ids("shared prefix text " * 50 + "another tail")
    n = len("shared prefix text " * 50) // 4
    assert a[:n] == b[:n]
    assert a != b


def test_longer_conversation_extends_shorter_rendering():
    """Multi-turn reuse needs turn k+1's rendering to start with turn k's (minus the generation prompt)."""
    turn1 = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    r1, r2 = render_chat(turn1), render_chat(turn2)
    assert r2.startswith(r1[: -len("<|assistant|>\n")])
    assert "more" in r2


def test_tools_render_canonically():
    tools1 = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    tools2 = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat(msgs, tools1) == render_chat(msgs, tools2)


def test_render_chat_is_the_head_each_message_and_the_generation_prompt():
    """What `truncation: auto` relies on (a message's part does not depend on the others), for every kind of message:
    roles (tool is rendered as observation, a missing one as user), list contents, tool calls."""
    msgs = [{"role": "system", "content": "be brief"}, {"content": "no role"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}, "b"]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "42"}, {"role": "assistant", "content": 7}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    for t in (None, tools):
        assert render_chat(msgs, t) == render_head(t) + "".join(map(render_message, msgs)) + GENERATION_PROMPT
    assert render_chat([], None) == "[gMASK]<sop><|assistant|>\n"
