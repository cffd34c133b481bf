import numpy as np

from gateway_lab.sim.radix_cache import PrefixCache


def toks(n, start=0):
    return np.arange(start, start + n, dtype=np.uint32)


def test_match_returns_longest_inserted_prefix():
    c = PrefixCache(page_size=4)
    keys = c.page_keys(toks(20))
    assert len(keys) == 5
    c.insert(keys[:3], now=1.0)
    assert len(c.match(keys, now=2.0)) == 3
    other = c.page_keys(np.concatenate([toks(8), toks(12, 100)]))
    assert len(c.match(other, now=2.0)) == 2  # shares the first two pages only


def test_partial_trailing_page_has_no_key():
    c = PrefixCache(page_size=64)
    assert len(c.page_keys(toks(127))) == 1
    assert len(c.page_keys(toks(128))) == 2


def test_namespace_isolates_identical_tokens():
    """Another cache_salt must never match: tenants' prompts stay apart."""
    c = PrefixCache(page_size=4)
    c.insert(c.page_keys(toks(16), "tenant-a"), now=0)
    assert c.match(c.page_keys(toks(16), "tenant-b"), now=1) == []
    assert len(c.match(c.page_keys(toks(16), "tenant-a"), now=1)) == 4


def test_lru_evicts_least_recent_leaves_first():
    c = PrefixCache(page_size=4)
    a = c.page_keys(toks(8, 0))
    b = c.page_keys(toks(8, 1000))
    c.insert(a, now=1)
    c.insert(b, now=2)
    c.match(a, now=3)  # a is now the most recent
    freed = c.evict(8)
    assert freed == 8
    assert len(c.match(a, now=4)) == 2
    assert c.match(b, now=4) == []


def test_locked_paths_survive_eviction():
    c = PrefixCache(page_size=4)
    a = c.insert(c.page_keys(toks(8)), now=1, lock=True)
    c.insert(c.page_keys(toks(8, 500)), now=2)
    assert c.evictable_tokens == 8
    assert c.evict(100) == 8
    assert c.total_tokens == 8
    c.unlock(a, now=3)
    assert c.evict(100) == 8
    assert c.total_tokens == 0


def test_eviction_removes_leaves_before_parents():
    c = PrefixCache(page_size=4)
    long = c.page_keys(toks(16))
    c.insert(long, now=1)
    assert c.evict(4) == 4
    assert len(c.match(long, now=2)) == 3  # the deepest page went first, the prefix stays usable
