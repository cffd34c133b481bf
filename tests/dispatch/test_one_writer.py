"""One writer of routing state: outside the index and load implementations, only dispatch/feedback.py calls their
write methods. The poller's replica facts, on-call flushes and KV-event corrections reach the index as events to
that module, so every change to what the router believes is in one place to read, test and count."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "gateway"

# names only an index uses; `insert` is also a list's, so it counts on a receiver that names an index
INDEX_WRITES = {"invalidate", "drop_replica", "set_capacity", "invalidate_sync", "drop_replica_sync", "invalidate_soon"}
INDEX_INSERTS = {"insert", "insert_sync", "insert_soon"}
LOAD_WRITES = {"add", "prefill_done", "finish", "apply"}  # on a receiver whose name says load
WRITER = "dispatch/feedback.py"
# the implementations themselves (each writes its own parts, or the index it wraps)
IMPLEMENTATIONS = {"prefix/memory.py", "prefix/redis.py", "kvevents/index.py", "routing/load.py"}
# a PD pool's private index of what its prefill ranks hold (in memory, per pool, read only by that pool's pair
# decision): not the shared prefix index or load the router reads; the one line allowed to write it
PRIVATE = {("dispatch/pd.py", "self.pd.index.insert_sync")}


def writes(source: str) -> list[tuple[int, str]]:
    """(line, call) of every index or load write in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        method, receiver = node.func.attr, ast.unparse(node.func.value)
        index_write = method in INDEX_WRITES or (method in INDEX_INSERTS and (
            "index" in receiver.lower() or "inner" in receiver.lower()))
        load_write = method in LOAD_WRITES and "load" in receiver.lower()
        if index_write or load_write:
            out.append((node.lineno, f"{receiver}.{method}"))
    return out


def test_only_the_feedback_module_writes_the_index_and_load() -> None:
    offenders = []
    for path in sorted(GATEWAY.rglob("*.py")):
        rel = path.relative_to(GATEWAY).as_posix()
        if rel == WRITER or rel in IMPLEMENTATIONS:
            continue
        offenders += [f"{rel}:{line}: {call}" for line, call in writes(path.read_text()) if (rel, call) not in PRIVATE]
    assert not offenders, f"routing state written outside {WRITER}: {offenders}"
    assert writes((GATEWAY / WRITER).read_text()), "the writer itself must be seen by the rule"


def test_the_rule_sees_the_writes_it_forbids() -> None:
    """What the poller, the admin API, the app and the KV-event consumer used to do must be caught."""
    src = ("async def f(self, st, index):\n"
           "    await self.index.drop_replica(k)\n"
           "    self.index.set_capacity(k, 1)\n"
           "    await st.index.drop_replica(k)\n"
           "    await index.drop_replica(k)\n"
           "    await self.inner.invalidate(k, [])\n"
           "    await self.inner.drop_replica(k)\n"
           "    await self.loads.add(n, 1, 1)\n"
           "    await self.index.insert(k, [1], 9)\n"
           "    self.index.insert_soon(k, [1], 9)\n"
           "    self.approximate.invalidate_soon(k, [1])\n"
           "    xs.add(1)\n"
           "    xs.insert(0, 1)\n")
    assert sorted(line for line, _ in writes(src)) == [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
