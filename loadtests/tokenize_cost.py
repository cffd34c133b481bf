"""CPU per request of the request side of precise routing (routing.mode precise/hybrid) on a 20,000-token chat:
tokenizing it as the engine will see it and chaining its page keys, next to the approximate mode's text-chunk hashes.

    .venv/bin/python -m loadtests.tokenize_cost            # ~30 s (most of it training the benchmark's tokenizer)
    .venv/bin/python -m loadtests.tokenize_cost --turns 20 # a 20-turn conversation to 20k tokens, turn by turn

No model files are downloaded: the real-tokenizer rows use a byte-level BPE tokenizer.json (32k vocabulary) trained
here on generated text, with a ChatML template, through the gateway's HfTokenizer (HF `tokenizers` + jinja2). A real
model's tokenizer (GLM's 150k vocabulary) is the same algorithm; its cost grows with the text, not the vocabulary.
Rows: the first turn of a conversation (nothing cached), the next turn (the previous turn's ids reused, only the new
messages encoded), the simulator's token rule (the default), and what every gateway instance spends consuming the
engine's events for such a request (its store and, later, its eviction). Process CPU time, median of `--reps`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.kvevents.blocks import RankBlocks
from gateway.kvevents.request_keys import TokenPrefixHasher
from gateway.kvevents.wire import decode_batch
from gateway.prefix.hashing import prefix_hashes
from gateway.tokenizers.real import HfTokenizer
from gateway.tokenizers.sim import SimRuleTokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def words(rng: np.random.Generator, n: int) -> str:
    syll = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "an", "er", "in", "on", "st", "qu", "ve", "za"]
    out = []
    for _ in range(n):
        w = "".join(syll[i] for i in rng.integers(0, len(syll), int(rng.integers(1, 4))))
        out.append(w + ("," if rng.random() < 0.08 else ""))
    return " ".join(out)


def build_tokenizer(d: Path, vocab: int) -> HfTokenizer:
    rng = np.random.default_rng(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((words(rng, 200) for _ in range(5000)), trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return HfTokenizer.from_dir(str(d))


def conversation(t: HfTokenizer, target: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """A chat of about `target` tokens under `t` (system prompt + turns), and its next turn."""
    rng = np.random.default_rng(1)
    msgs = [{"role": "system", "content": words(rng, 3000)}]
    while len(t.encode_text(t.render(msgs, None))) < target:
        msgs += [{"role": "user", "content": words(rng, 600)}, {"role": "assistant", "content": words(rng, 400)}]
    msgs.append({"role": "user", "content": words(rng, 300)})
    nxt = [*msgs, {"role": "assistant", "content": words(rng, 200)}, {"role": "user", "content": words(rng, 300)}]
    return msgs, nxt


def events_for(tokens: list[int], block_size: int) -> tuple[bytes, bytes]:
    """The engine's events for this prompt (0.5.23 encoding): one coalesced BlockStored, later one BlockRemoved."""
    n = len(tokens) // block_size
    hashes = list(range(1, n + 1))
    store = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens[: n * block_size],
             "block_size": block_size, "lora_id": None, "medium": "GPU", "cache_salt": "tenant:a"}
    return (msgspec.msgpack.encode([time.time(), [store], 0]),
            msgspec.msgpack.encode([time.time(), [{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}], 0]))


def consume(store: bytes, remove: bytes) -> None:
    blocks = RankBlocks()
    blocks.apply(decode_batch(store).events)
    blocks.apply(decode_batch(remove).events)


def cpu_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1000


def measure(tokens: int = 20_000, vocab: int = 32_000, reps: int = 30, block_size: int = 64) -> tuple[str, list[tuple[str, float]]]:
    """(a line describing the request, [(step, CPU ms per request)]): the rows this script prints, also printed
    under loadtests/overhead.py's table (`--tokenizer-cost`)."""
    with tempfile.TemporaryDirectory() as d:
        hf = build_tokenizer(Path(d), vocab)
        msgs, nxt = conversation(hf, tokens)
        body, next_body = {"messages": msgs}, {"messages": nxt}
        n_tokens = len(hf.encode_request("chat/completions", body))
        sim = SimRuleTokenizer()
        hf_hasher = TokenPrefixHasher(hf, block_size)
        sim_hasher = TokenPrefixHasher(sim, block_size)
        sim_text_tokens = len(sim.encode_request("chat/completions", body))
        store, remove = events_for(sim.encode_request("chat/completions", body).tolist(), block_size)

        def cold() -> None:
            hf.clear()
            hf_hasher("chat/completions", body, "m", "tenant:a", 256)

        def warm() -> None:
            hf.clear()
            hf.encode_request("chat/completions", body, "tenant:a")  # the previous turn, cached (not timed below)

        def next_turn() -> None:
            hf_hasher("chat/completions", next_body, "m", "tenant:a", 256)

        next_times = []
        for _ in range(reps):
            warm()
            next_times.append(cpu_ms(next_turn, 1))
        rows = [
            ("HF tokenizer, first turn: template + encode + page keys", cpu_ms(cold, reps)),
            ("HF tokenizer, next turn (previous turn's ids cached)", statistics.median(next_times)),
            ("HF tokenizer, encode only (first turn)", cpu_ms(lambda: hf.encode_text(hf.render(msgs, None)), reps)),
            ("simulator token rule: render + ids + page keys", cpu_ms(lambda: sim_hasher("chat/completions", body, "m",
                                                                                        "tenant:a", 256), reps)),
            ("approximate mode: text-chunk hashes (today's default)", cpu_ms(lambda: prefix_hashes(
                "chat/completions", body, "m", "tenant:a", 256), reps)),
            ("event consumer: decode + index this request's BlockStored, then its BlockRemoved",
             cpu_ms(lambda: consume(store, remove), reps)),
        ]
        about = (f"request: {n_tokens} tokens under the benchmark tokenizer ({vocab} vocab), {sim_text_tokens} under "
                 f"the simulator's rule; {len(json.dumps(body)) // 1024} KiB body; block size {block_size}; median of {reps}")
    return about, rows


def turns(n_turns: int = 20, tokens: int = 20_000, vocab: int = 32_000, block_size: int = 64
          ) -> list[tuple[int, int, float, float, bool]]:
    """A conversation of `n_turns` turns growing to about `tokens` tokens, sent turn after turn through precise
    mode's hasher (the previous turn's ids cached, in the tenant's namespace): per turn (turn, prompt tokens, CPU ms
    of this turn, CPU ms of the same turn tokenized whole with nothing cached, ids equal to a fresh encode)."""
    with tempfile.TemporaryDirectory() as d:
        hf = build_tokenizer(Path(d), vocab)
        fresh = HfTokenizer.from_dir(d)
        hasher = TokenPrefixHasher(hf, block_size)
        rng = np.random.default_rng(2)
        # words a turn, from this tokenizer's tokens per word, so the last turn reaches about `tokens`
        per_word = len(hf.encode_text(words(np.random.default_rng(3), 2000))) / 2000
        w = max(4, int(tokens / per_word / n_turns))
        msgs = [{"role": "system", "content": words(rng, w * 4 // 5)}, {"role": "user", "content": words(rng, w // 5)}]
        out = []
        for turn in range(1, n_turns + 1):
            body = {"messages": msgs}
            t0 = time.process_time()
            hasher("chat/completions", body, "m", "tenant:a", 256)
            inc = (time.process_time() - t0) * 1000
            fresh.clear()
            t0 = time.process_time()
            want = fresh.encode_request("chat/completions", body, "tenant:b")
            full = (time.process_time() - t0) * 1000
            got = hf.encode_request("chat/completions", body, "tenant:a")
            out.append((turn, len(want), inc, full, got.tolist() == want.tolist()))
            # the model's answer and the next user message: ~tokens/n_turns more tokens a turn
            msgs = [*msgs, {"role": "assistant", "content": words(rng, w * 3 // 4)},
                    {"role": "user", "content": words(rng, w // 4)}]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--turns", type=int, default=0, help="instead: a conversation of this many turns growing to "
                   "--tokens, per turn the CPU of precise mode's tokenizer and of a whole tokenization, and parity")
    a = p.parse_args()
    if a.turns:
        rows = turns(a.turns, a.tokens, a.vocab, a.block_size)
        print(f"{a.turns}-turn conversation to ~{a.tokens} tokens ({a.vocab} vocab), process CPU time per turn")
        print("| turn | prompt tokens | precise mode (previous turn cached) ms | whole tokenization ms | ids equal |")
        print("|---|---|---|---|---|")
        for turn, n, inc, full, same in rows:
            print(f"| {turn} | {n} | {inc:.2f} | {full:.2f} | {'yes' if same else 'NO'} |")
        later = sorted(r[2] for r in rows[1:])
        print(f"turns 2-{a.turns}: median {later[len(later) // 2]:.2f} ms, max {later[-1]:.2f} ms")
        return
    about, rows = measure(a.tokens, a.vocab, a.reps, a.block_size)
    print(about)
    print("| step | CPU ms per request |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
