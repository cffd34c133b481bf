"""CPU per request of the request side of precise routing (routing.mode precise/hybrid) on a 20,000-token chat:
tokenizing it as the engine will see it and chaining its page keys, next to the approximate mode's text-chunk hashes.

    .venv/bin/python -m loadtests.tokenize_cost            # ~30 s (most of it training the benchmark's tokenizer)
    .venv/bin/python -m loadtests.tokenize_cost --turns 20 # a 20-turn conversation to 20k tokens, turn by turn
    .venv/bin/python -m loadtests.tokenize_cost --turns 20 --baseline DIR  # and another checkout's, turn by turn

No model files are downloaded: the real-tokenizer rows use a byte-level BPE tokenizer.json (32k vocabulary) trained
here on generated text, with a ChatML template, through the gateway's HfTokenizer (HF `tokenizers` + jinja2). A real
model's tokenizer (GLM's 150k vocabulary) is the same algorithm; its cost grows with the text, not the vocabulary.
Rows: the first turn of a conversation (nothing cached), the next turn (the previous turn's ids reused, only the new
messages encoded), the simulator's token rule (the default), and what every gateway instance spends consuming the
engine's events for such a request (its store and, later, its eviction). Process CPU time, median of `--reps`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import sys
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


def baseline_modules(checkout: str) -> tuple[Any, Any]:
    """HfTokenizer and TokenPrefixHasher as another checkout has them (e.g. `git archive main | tar -x -C DIR`),
    loaded beside this checkout's under their own names; what they import comes from this checkout."""
    loaded = []
    for name, rel in (("baseline_real", "gateway/tokenizers/real.py"), ("baseline_keys", "gateway/kvevents/request_keys.py")):
        spec = importlib.util.spec_from_file_location(name, Path(checkout) / rel)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        loaded.append(mod)
    return loaded[0].HfTokenizer, loaded[1].TokenPrefixHasher


def turns(n_turns: int = 20, tokens: int = 20_000, vocab: int = 32_000, block_size: int = 64, reps: int = 1,
          baseline: str | None = None) -> list[tuple[int, int, float, float, bool, float]]:
    """A conversation of `n_turns` turns growing to about `tokens` tokens, sent turn after turn through precise
    mode's hasher (the previous turn's ids cached, in the tenant's namespace), `reps` times over (fresh caches each
    time): per turn (turn, prompt tokens, median CPU ms of this turn, median CPU ms of the same turn tokenized whole
    with nothing cached, ids equal to a fresh encode every time, median CPU ms of the `baseline` checkout's hasher
    on the same turn or NaN). This checkout and the baseline take each turn in alternating order."""
    with tempfile.TemporaryDirectory() as d:
        hf = build_tokenizer(Path(d), vocab)
        fresh = HfTokenizer.from_dir(d)
        base = None
        if baseline:
            base_tok, base_hasher = baseline_modules(baseline)
            base = (base_tok.from_dir(d), base_hasher)
        rng = np.random.default_rng(2)
        # words a turn, from this tokenizer's tokens per word, so the last turn reaches about `tokens`
        per_word = len(hf.encode_text(words(np.random.default_rng(3), 2000))) / 2000
        w = max(4, int(tokens / per_word / n_turns))
        msgs = [{"role": "system", "content": words(rng, w * 4 // 5)}, {"role": "user", "content": words(rng, w // 5)}]
        bodies = []
        for _ in range(n_turns):
            bodies.append({"messages": msgs})
            # the model's answer and the next user message: ~tokens/n_turns more tokens a turn
            msgs = [*msgs, {"role": "assistant", "content": words(rng, w * 3 // 4)},
                    {"role": "user", "content": words(rng, w // 4)}]
        inc: list[list[float]] = [[] for _ in bodies]
        full: list[list[float]] = [[] for _ in bodies]
        old: list[list[float]] = [[] for _ in bodies]
        same = [True for _ in bodies]
        sizes = [0 for _ in bodies]

        def timed(fn: Callable[[], Any]) -> float:
            t0 = time.process_time()
            fn()
            return (time.process_time() - t0) * 1000

        for r in range(reps):
            hf.clear()
            hasher = TokenPrefixHasher(hf, block_size)
            base_hasher = None
            if base is not None:
                base[0].clear()
                base_hasher = base[1](base[0], block_size)
            for k, body in enumerate(bodies):
                mine = functools.partial(hasher, "chat/completions", body, "m", "tenant:a", 256)
                if base_hasher is not None and (r + k) % 2:
                    old[k].append(timed(functools.partial(base_hasher, "chat/completions", body, "m", "tenant:a", 256)))
                    inc[k].append(timed(mine))
                else:
                    inc[k].append(timed(mine))
                    if base_hasher is not None:
                        old[k].append(timed(functools.partial(base_hasher, "chat/completions", body, "m", "tenant:a",
                                                              256)))
                fresh.clear()
                t0 = time.process_time()
                want = fresh.encode_request("chat/completions", body, "tenant:b")
                full[k].append((time.process_time() - t0) * 1000)
                got = hf.encode_request("chat/completions", body, "tenant:a")
                same[k] = same[k] and got.tolist() == want.tolist()
                sizes[k] = len(want)
        med = statistics.median
        return [(k + 1, sizes[k], med(inc[k]), med(full[k]), same[k], med(old[k]) if old[k] else float("nan"))
                for k in range(len(bodies))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--turn-reps", type=int, default=5, help="--turns: conversations run, the median per turn")
    p.add_argument("--baseline", default=None, help="--turns: another checkout (`git archive REV | tar -x -C DIR`), "
                   "whose tokenizer and hasher take every turn too, alternating with this one's")
    p.add_argument("--baseline-label", default="baseline")
    p.add_argument("--turns", type=int, default=0, help="instead: a conversation of this many turns growing to "
                   "--tokens, per turn the CPU of precise mode's tokenizer and of a whole tokenization, and parity")
    a = p.parse_args()
    if a.turns:
        rows = turns(a.turns, a.tokens, a.vocab, a.block_size, a.turn_reps, a.baseline)
        print(f"{a.turns}-turn conversation to ~{a.tokens} tokens ({a.vocab} vocab), process CPU time per turn, median "
              f"of {a.turn_reps} conversations")
        extra = [f"baseline ({a.baseline_label}) ms"] if a.baseline else []
        print("| " + " | ".join(["turn", "prompt tokens", "precise mode (previous turn cached) ms", *extra,
                                 "whole tokenization ms", "ids equal"]) + " |")
        print("|---" * (5 + len(extra)) + "|")
        for turn, n, inc, full, same, old in rows:
            cells = [str(turn), str(n), f"{inc:.2f}", *([f"{old:.2f}"] if a.baseline else []), f"{full:.2f}",
                     "yes" if same else "NO"]
            print("| " + " | ".join(cells) + " |")
        later = sorted(r[2] for r in rows[1:])
        print(f"turns 2-{a.turns}: median {later[len(later) // 2]:.2f} ms, max {later[-1]:.2f} ms")
        if a.baseline:
            was = sorted(r[5] for r in rows[1:])
            print(f"baseline ({a.baseline_label}), turns 2-{a.turns}: median {was[len(was) // 2]:.2f} ms, max {was[-1]:.2f} ms")
        return
    about, rows = measure(a.tokens, a.vocab, a.reps, a.block_size)
    print(about)
    print("| step | CPU ms per request |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
