"""Tools reach the chat template as the engine hands them over (its request model's dump): SGLang 0.5.23's the
client's keys, then the left-out fields as null (`client_order`); 0.5.13's every field in declaration order with
`strict: false` (`declared_order`). Which one an engine uses is learned from its /v1/tokenize of a probe. The
expected texts are what real servers' /v1/tokenize rendered for these tools (tests/engines checks the ids live)."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.tokenizers.real import TOOLS_PROBE, HfTokenizer, engine_tools
from tests.tokenizers.test_real_tokenizer import make_tokenizer_dir

# ChatML with the tools as JSON lines in the system turn, as the kit's model's template (Qwen 2.5's) writes them
WITH_TOOLS = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
              "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_left_out_fields_are_rendered_as_null_after_the_clients() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}},
             {"type": "function", "function": {"name": "g"}}]
    got = [json.dumps(t, ensure_ascii=False) for t in engine_tools(tools) or []]
    assert got == [
        '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": true, '
        '"description": null}, "defer_loading": null}',
        '{"type": "function", "function": {"name": "g", "description": null, "parameters": null}, '
        '"defer_loading": null}']
    assert tools[1] == {"type": "function", "function": {"name": "g"}}  # the request body is left as sent


def test_no_tools_and_odd_entries() -> None:
    assert engine_tools(None) is None and engine_tools([]) is None
    assert engine_tools([{"type": "web_search"}]) == [{"type": "web_search"}]


def test_0513_dumps_every_field_in_declaration_order() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x-extra": 1}},
             {"type": "function", "function": {"name": "g", "strict": True}, "defer_loading": True}]
    got = [json.dumps(t, ensure_ascii=False) for t in engine_tools(tools, "declared_order") or []]
    assert got == [
        '{"type": "function", "function": {"description": null, "name": "f", "parameters": {"type": "object"}, '
        '"strict": false}, "defer_loading": null}',
        '{"type": "function", "function": {"description": null, "name": "g", "parameters": null, "strict": true, '
        '"defer_loading": true}, "defer_loading": true}']
    assert engine_tools(tools, "as_sent") is tools


def test_the_layout_is_learned_from_the_engines_ids(tmp_path: Path) -> None:
    """An engine's ids for the probe decide the layout, which then keys every request with tools; ids no layout
    renders leave it as it was."""
    tok = HfTokenizer.from_dir(str(make_tokenizer_dir(tmp_path, WITH_TOOLS)))
    assert tok.tool_layout == "client_order"
    msgs = TOOLS_PROBE["messages"]
    engine = tok.encode_text(tok.render(msgs, engine_tools(TOOLS_PROBE["tools"], "declared_order"))).tolist()
    assert tok.learn_tool_layout(engine) == "declared_order" and tok.tool_layout == "declared_order"
    body = {"messages": [{"role": "user", "content": "hello"}],
            "tools": [{"type": "function", "function": {"name": "g", "description": "d"}}]}
    want = tok.encode_text(tok.render(body["messages"], engine_tools(body["tools"], "declared_order")))
    assert tok.encode_request("chat/completions", body).tolist() == want.tolist()
    assert tok.learn_tool_layout([1, 2, 3]) is None and tok.tool_layout == "declared_order"
