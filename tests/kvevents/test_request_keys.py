"""The request hasher's chain memo: a next turn reuses the chain of its longest common prefix with a recent request
of the same namespace, and the keys must be exactly those of a whole chain (a wrong key would route a conversation
away from the replica holding its pages); other namespaces never share a chain, and the memo stays bounded."""

from __future__ import annotations

import numpy as np

from gateway.kvevents import keys, request_keys
from gateway.kvevents.request_keys import TokenPrefixHasher
from gateway.tokenizers.sim import SimRuleTokenizer


def whole(ids: list[int], ns: str, bs: int = 16, every: int = 1) -> list[int]:
    return keys.chain(keys.seed(ns), np.asarray(ids, dtype=np.uint32), bs)[every - 1::every]


def test_memo_keys_equal_a_whole_chain_turn_after_turn() -> None:
    h = TokenPrefixHasher(SimRuleTokenizer(), block_size=16)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 50_000, 100).tolist()
    other = rng.integers(0, 50_000, 300).tolist()
    for _ in range(8):
        prompt = prompt + rng.integers(0, 50_000, 37).tolist()  # grows mid-page: the last page changes
        assert h("completions", {"prompt": prompt}, "m", "a", 16) == whole(prompt, "a")
        # another conversation of the same namespace in between, and another namespace with the same ids
        assert h("completions", {"prompt": other}, "m", "a", 16) == whole(other, "a")
        assert h("completions", {"prompt": prompt}, "m", "b", 16) == whole(prompt, "b")
    edited = [prompt[0] + 1] + prompt[1:]  # an edited first message: nothing to reuse
    assert h("completions", {"prompt": edited}, "m", "a", 64) == whole(edited, "a", every=4)
    shorter = prompt[:70]  # a retried shorter prompt: a prefix of a memoized one
    assert h("completions", {"prompt": shorter}, "m", "a", 16) == whole(shorter, "a")


def test_memo_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(request_keys, "MEMO_TOKENS", 1000)
    h = TokenPrefixHasher(SimRuleTokenizer(), block_size=16)
    for i in range(20):
        prompt = list(range(i, i + 300))
        assert h("completions", {"prompt": prompt}, "m", f"tenant-{i}", 16) == whole(prompt, f"tenant-{i}")
        assert h._memo_tokens <= 1000
        assert all(len(v) <= request_keys.MEMO_PER_NAMESPACE for v in h._memo.values())
    assert h._memo_tokens == sum(len(i) for v in h._memo.values() for i, _ in v)
