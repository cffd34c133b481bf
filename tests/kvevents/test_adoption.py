"""Blocks stored under a parent the gateway never saw (gateway/kvevents/blocks.py, "adopt"): the engine cached the
parent before the gateway subscribed and no replay reached back to it. Seen against real SGLang 0.5.13 with 1-token
pages (its descriptor names no replay port): the chat template's first tokens, shared by every conversation, were
pages cached by earlier traffic, so each new conversation's pages came under an unseen parent and precise routing
never matched (tests/engines/test_tier.py). The run of pages is placed by the request that was sent with it."""

from __future__ import annotations

import numpy as np

from gateway.kvevents import keys
from gateway.kvevents.blocks import RankBlocks
from gateway.kvevents.request_keys import TokenPrefixHasher
from gateway.kvevents.wire import Removed, Stored
from gateway.tokenizers.sim import SimRuleTokenizer

SHARED = [1, 5, 9]  # the template's first tokens: cached by the engine before the gateway subscribed


def _hasher(page: int = 1) -> TokenPrefixHasher:
    return TokenPrefixHasher(SimRuleTokenizer(), block_size=page)


def _per_page(ids: list[int], first_hash: int, parent: int) -> list[Stored]:
    """0.5.13's events for 1-token pages: one BlockStored per page, each under the page before it."""
    out, prev = [], parent
    for i, t in enumerate(ids):
        out.append(Stored([first_hash + i], prev, [t], 1))
        prev = first_hash + i
    return out


def test_a_conversation_under_an_unseen_shared_prefix_is_keyed_from_the_root() -> None:
    h = _hasher()
    prompt = SHARED + list(range(100, 140))
    h("completions", {"prompt": prompt}, "m", "tenant-a", chunk_tokens=8)  # the request the gateway sent
    blocks = RankBlocks(page=1, adopt=h.keys_before)
    blocks.apply(_per_page(prompt[len(SHARED):], 1000, parent=777))  # 777: the engine's hash of the shared page
    assert blocks.orphans == 0 and blocks.adoptions == 1
    # events carry no namespace (<= 0.5.13): held are the plain chain's keys, the whole prompt's from the root
    assert all(k in blocks.held for k in keys.chain(keys.seed(""), np.asarray(prompt), 1))
    # the parent's removal takes the pages held on its account (the engine's own ancestors go after it)
    blocks.apply([Removed([1000 + i for i in range(40)]), Removed([777])])
    assert len(blocks) == 0


def test_without_a_request_that_holds_the_run_it_stays_an_orphan() -> None:
    h = _hasher()
    h("completions", {"prompt": SHARED + list(range(100, 140))}, "m", "", chunk_tokens=8)
    blocks = RankBlocks(page=1, adopt=h.keys_before)
    blocks.apply(_per_page(list(range(500, 540)), 1000, parent=777))  # tokens no request sent
    assert blocks.orphans == 1 and blocks.adoptions == 0
    blocks.apply(_per_page(list(range(100, 105)), 2000, parent=778))  # too short a run to place
    assert blocks.orphans == 2 and blocks.adoptions == 0


def test_two_requests_placing_the_run_after_different_tokens_place_it_nowhere() -> None:
    h = _hasher()
    run = list(range(100, 140))
    h("completions", {"prompt": [1, 5, 9, *run]}, "m", "", chunk_tokens=8)
    h("completions", {"prompt": [2, 6, 9, *run]}, "m", "", chunk_tokens=8)
    assert h.keys_before("", run, 1) is None
    assert h.keys_before("", run, 64) is None  # another page size than the hasher's


def test_whole_pages_and_a_salted_namespace() -> None:
    """64-token pages (0.5.23 publishes a chain in one event with its salt): the run starts on a page boundary of
    the request and is looked up among that namespace's requests only."""
    h = _hasher(page=16)
    prompt = list(range(1000, 1000 + 96))
    h("completions", {"prompt": prompt}, "m", "t", chunk_tokens=32)
    blocks = RankBlocks(page=16, adopt=h.keys_before)
    blocks.apply([Stored([31, 32, 33, 34], 555, prompt[32:], 16, "t")])
    assert blocks.adoptions == 1
    assert all(k in blocks.held for k in keys.chain(keys.seed("t"), np.asarray(prompt), 16))
    other = RankBlocks(page=16, adopt=h.keys_before)
    other.apply([Stored([31, 32, 33, 34], 555, prompt[32:], 16, "u")])  # another tenant's salt: not placed
    assert other.orphans == 1 and other.adoptions == 0


def test_ancestors_seen_in_their_own_events_stay_when_the_adopted_parent_goes() -> None:
    h = _hasher()
    prompt = SHARED + list(range(100, 140))
    h("completions", {"prompt": prompt}, "m", "", chunk_tokens=8)
    blocks = RankBlocks(page=1, adopt=h.keys_before)
    blocks.apply([Stored([50], None, [SHARED[0]], 1)])  # the first page was seen; the next two were not
    blocks.apply(_per_page(prompt[len(SHARED):], 1000, parent=777))
    first = keys.chain(keys.seed(""), np.asarray(prompt[:1]), 1)[0]
    blocks.apply([Removed([777])])
    assert first in blocks.held and blocks.by_engine[50] == first
