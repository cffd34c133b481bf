"""The real request tokenizer (gateway/tokenizers/real.py) on a tiny tokenizer.json built here with the `tokenizers`
library (no downloads): ChatML template rendering, ids as a fresh encode gives them, the per-conversation prefix
cache (same ids, fewer tokens encoded), and clear errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from gateway.config import TokenizerSettings
from gateway.errors import InvalidRequest
from gateway.tokenizer import count_tokens, render_chat
from gateway.tokenizers import build_tokenizer, prompt_tokens, real
from gateway.tokenizers.real import HfTokenizer, TokenizerFilesError

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# ChatML that refuses a message reading "refuse me", as real templates refuse e.g. a misplaced system message
REFUSING = ("{% for m in messages %}{% if m['content'] == 'refuse me' %}{{ raise_exception('no refusals here') }}"
            "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
          "count one two three and return a json object", "you are a helpful assistant"] * 50


def make_tokenizer_dir(tmp: Path, template: str | None = CHATML) -> Path:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(tmp / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "bos_token": None}
    if template is not None:
        cfg["chat_template"] = template
    (tmp / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp


def test_renders_chatml_and_encodes_like_a_fresh_encode(tmp_path: Path) -> None:
    t = HfTokenizer.from_dir(str(make_tokenizer_dir(tmp_path)))
    msgs = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "hello world"}]
    text = t.render(msgs, None)
    assert text == ("<|im_start|>system\nyou are a helpful assistant<|im_end|>\n<|im_start|>user\nhello world"
                    "<|im_end|>\n<|im_start|>assistant\n")
    ids = t.encode_request("chat/completions", {"messages": msgs})
    assert ids.tolist() == t.tok.encode(text, add_special_tokens=False).ids
    assert ids[0] == t.tok.token_to_id("<|im_start|>")
    # content parts are flattened to their text, as the engine does
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]
    assert t.render(parts, None) == t.render([{"role": "user", "content": "hello world"}], None)


def test_conversation_turns_reuse_the_cached_prefix(tmp_path: Path) -> None:
    t = HfTokenizer.from_dir(str(make_tokenizer_dir(tmp_path)))
    fresh = HfTokenizer.from_dir(str(tmp_path))
    msgs = [{"role": "system", "content": "you are a helpful assistant " * 20}, {"role": "user", "content": "hello"}]
    t.encode_request("chat/completions", {"messages": msgs})
    assert (t.hits, t.misses) == (0, 1)
    for turn in range(4):
        msgs = [*msgs, {"role": "assistant", "content": f"the quick brown fox {turn}"},
                {"role": "user", "content": f"count one two three {turn}"}]
        got = t.encode_request("chat/completions", {"messages": msgs})
        want = fresh.tok.encode(fresh.render(msgs, None), add_special_tokens=False).ids
        assert got.tolist() == want
    assert t.hits == 4


def test_a_turn_of_one_more_message_reuses_the_cached_prefix(tmp_path: Path) -> None:
    """A request that adds a single message to the previous one (a second user message, a lone tool result) finds
    the previous turn one message back, after looking two back: same ids as a fresh encode."""
    t = HfTokenizer.from_dir(str(make_tokenizer_dir(tmp_path)))
    msgs = [{"role": "user", "content": "hello"}]
    t.encode_request("chat/completions", {"messages": msgs})
    for i in range(3):
        msgs = [*msgs, {"role": "user", "content": f"count one two {i}"}]
        got = t.encode_request("chat/completions", {"messages": msgs})
        assert got.tolist() == t.tok.encode(t.render(msgs, None), add_special_tokens=False).ids
    assert (t.hits, t.misses) == (3, 1)


# a template whose generation prompt is not only appended: it also marks the start (the rendering without it is no
# prefix of the rendering with it)
MARKED = ("{% if add_generation_prompt %}<|im_start|>{% endif %}" + CHATML)


@pytest.mark.parametrize("template", [CHATML, MARKED], ids=["appended", "not-a-suffix"])
def test_long_conversations_keep_hitting_and_match_a_fresh_encode(tmp_path: Path, template: str) -> None:
    """Past the checked requests the rendering without the generation prompt is taken as the rendering less the
    prompt (one render fewer a turn) where the template only appends it; a template that does otherwise is rendered
    every turn. Either way every turn's ids equal a fresh encode."""
    t = HfTokenizer.from_dir(str(make_tokenizer_dir(tmp_path, template=template)))
    msgs = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "hello"}]
    t.encode_request("chat/completions", {"messages": msgs})
    for turn in range(real.CHECKED_RENDERS + 6):
        msgs = [*msgs, {"role": "assistant", "content": f"the quick brown fox {turn}"},
                {"role": "user", "content": f"count one two three {turn}"}]
        got = t.encode_request("chat/completions", {"messages": msgs})
        assert got.tolist() == t.tok.encode(t.render(msgs, None), add_special_tokens=False).ids
    if template == CHATML:
        assert t.hits == real.CHECKED_RENDERS + 6 and t._suffix == "<|im_start|>assistant\n"
    else:
        assert t._suffix is None


def test_the_prefix_cache_is_kept_per_namespace(tmp_path: Path) -> None:
    """A tenant's cached turns serve only that tenant's next turns (the same conversation in another namespace is
    encoded afresh, with the same ids), and one namespace filling its share never evicts another's entries."""
    t = HfTokenizer.from_dir(str(make_tokenizer_dir(tmp_path)))
    first = [{"role": "system", "content": "you are a helpful assistant " * 5}, {"role": "user", "content": "hello"}]
    nxt = [*first, {"role": "assistant", "content": "the quick brown fox"}, {"role": "user", "content": "count one"}]
    t.encode_request("chat/completions", {"messages": first}, "tenant-a")
    other = t.encode_request("chat/completions", {"messages": nxt}, "tenant-b")
    assert (t.hits, t.misses) == (0, 2)
    mine = t.encode_request("chat/completions", {"messages": nxt}, "tenant-a")
    assert t.hits == 1 and mine.tolist() == other.tolist()
    for i in range(real.NAMESPACE_ENTRIES + 10):  # tenant-b's many conversations
        t.encode_request("chat/completions", {"messages": [{"role": "user", "content": f"hello world {i}"}]}, "tenant-b")
    assert t.entries["tenant-b"] == real.NAMESPACE_ENTRIES
    assert t.entries["tenant-a"] == 2  # both of tenant-a's turns are still there
    t.encode_request("chat/completions", {"messages": [*nxt, {"role": "assistant", "content": "two"},
                                                       {"role": "user", "content": "three"}]}, "tenant-a")
    assert t.hits == 2


def test_a_turn_finds_the_longest_cached_prefix_it_extends(tmp_path: Path) -> None:
    """The lookup takes the longest prefix of the rendering that this namespace has cached, however many messages
    were added after it (an agent's turn: a reply, several tool results, a user message) and whichever request left
    it (a regenerated reply branches from the same history); every one's ids equal a fresh encode."""
    t = HfTokenizer.from_dir(str(make_tokenizer_dir(tmp_path)))
    fresh = HfTokenizer.from_dir(str(tmp_path))
    first = [{"role": "system", "content": "you are a helpful assistant " * 10}, {"role": "user", "content": "hello"}]
    second = [*first, {"role": "assistant", "content": "hello world"}, {"role": "tool", "content": "one"},
              {"role": "tool", "content": "two"}, {"role": "user", "content": "count one two three"}]
    regenerated = [*first, {"role": "assistant", "content": "the quick brown fox"}, {"role": "user", "content": "three"}]
    t.encode_request("chat/completions", {"messages": first})
    for msgs in (second, regenerated):
        got = t.encode_request("chat/completions", {"messages": msgs})
        assert got.tolist() == fresh.tok.encode(fresh.render(msgs, None), add_special_tokens=False).ids
    assert (t.hits, t.misses) == (2, 1)


def test_completions_and_token_prompts(tmp_path: Path) -> None:
    t = HfTokenizer.from_dir(str(make_tokenizer_dir(tmp_path)))
    assert t.encode_request("completions", {"prompt": "hello world"}).tolist() == t.tok.encode("hello world").ids
    assert t.encode_request("completions", {"prompt": [5, 6, 7]}).tolist() == [5, 6, 7]
    assert t.encode_request("completions", {"prompt": [[1, 2], [3]]}).tolist() == [1, 2]


def test_bad_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match=r"tokenizer\.json"):
        HfTokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerFilesError):
        HfTokenizer.from_dir(str(tmp_path))
    d = make_tokenizer_dir(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path, template=None)
    t = HfTokenizer.from_dir(str(d))
    with pytest.raises(TokenizerFilesError, match="no chat_template"):
        t.encode_request("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})


def test_build_tokenizer_by_kind(tmp_path: Path) -> None:
    assert build_tokenizer(TokenizerSettings()).name == "sim"
    make_tokenizer_dir(tmp_path)
    assert build_tokenizer(TokenizerSettings(kind="hf", path=str(tmp_path))).name == "hf"


def test_prompt_tokens_counts_with_the_loaded_tokenizer_else_the_rule(tmp_path: Path) -> None:
    """The token-count endpoints' count: the real tokenizer's ids of the templated prompt, or with none loaded the
    4-characters rule (the sim tokenizer agrees with it); a template's refusal is a 400."""
    t = HfTokenizer.from_dir(str(make_tokenizer_dir(tmp_path, template=REFUSING)))
    chat = {"messages": [{"role": "system", "content": "you are a helpful assistant"},
                         {"role": "user", "content": "hello world, how are you today?"}]}
    real = len(t.tok.encode(t.render(chat["messages"], None), add_special_tokens=False).ids)
    rule = count_tokens(render_chat(chat["messages"]))
    assert prompt_tokens(t, chat) == real != rule
    assert prompt_tokens(None, chat) == rule == prompt_tokens(build_tokenizer(TokenizerSettings()), chat)
    with pytest.raises(InvalidRequest, match="no refusals here") as e:
        prompt_tokens(t, {"messages": [{"role": "user", "content": "refuse me"}]})
    assert e.value.status == 400 and e.value.param == "messages"
