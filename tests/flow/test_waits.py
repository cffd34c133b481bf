"""The waits board (gateway/flow/waits.py): who is ahead of whom on a target, across instances."""

from __future__ import annotations

from gateway.flow.shared import RedisFairTags
from gateway.flow.waits import Wait, WaitBoard
from gateway.shared_redis import RedisGuard, build_client


def test_only_another_instances_request_ahead_in_the_fair_order_blocks_a_target():
    b = WaitBoard(ttl_s=0.5)
    b.publish("one", {"r0": (1, 10.0)}, now=100.0)  # band 1, start tag 10, waiting for r0 on instance one
    assert b.ahead("r0", 1, 50.0, "two", 100.1)  # same band, later start tag: behind it
    assert not b.ahead("r0", 1, 10.0, "two", 100.1)  # the same tag (the same tenant): never ahead of itself
    assert not b.ahead("r0", 1, 5.0, "two", 100.1)  # a flow further behind in its share goes first
    assert b.ahead("r0", 2, 0.0, "two", 100.1)  # a lower band waits for any higher band's request
    assert not b.ahead("r0", 0, 99.0, "two", 100.1)  # a higher band is never held by a lower one
    assert not b.ahead("r1", 1, 50.0, "two", 100.1)  # other targets are free
    assert not b.ahead("r0", 1, 50.0, "one", 100.1)  # an instance's own waits are its Pass's business
    assert not b.ahead("r0", 1, 50.0, "two", 100.6)  # not published again within its life: gone
    b.publish("one", {}, now=100.2)
    assert not b.ahead("r0", 1, 50.0, "two", 100.3) and b.others("two") == set()


def test_another_instances_bad_entry_is_skipped_and_a_stopped_instance_forgotten():
    """What another instance wrote is read defensively: an entry that does not parse is skipped (the rest merged), an
    instance no longer on the board is forgotten, and one whose entries are long past is removed at the next write."""
    client = build_client("redis://127.0.0.1:1", password=None, max_connections=1, pool_timeout=0.1, connect_timeout=0.1)
    shared = RedisFairTags(client, "p:", 0.1, RedisGuard("flow", retry_after=60))
    board = WaitBoard()
    board.merge("gone", {"r9": Wait(1, 0.0, 1e9)})
    wall = __import__("time").time()
    raw = {b"good": f'{{"r0": [1, 3.5, {wall + 0.4}]}}'.encode(), b"bad": b"{not json", b"odd": b'{"r1": 7}',
           b"old": f'{{"r2": [1, 1.0, {wall - 600}]}}'.encode(), b"me": b'{"r3": [0, 0.0, 0]}'}
    shared._merge_waits(raw, board, "me", now=50.0)
    assert board.ahead("r0", 1, 9.0, "me", 50.1) and not board.ahead("r0", 1, 9.0, "me", 50.5)  # its life moved over
    assert board.others("me") == {"good", "old"}  # bad and odd skipped; gone forgotten
    assert shared._stale == {"old"}
