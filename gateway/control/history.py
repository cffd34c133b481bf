"""Reading the audit log as a history of changes (pure): which entry an undo means, which entries are already
undone, and what a policy file reload changed."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from gateway.errors import Conflict, NotFound
from gateway.policy_schema import Tenant

ANY: Any = object()  # "no expectation" for a change's current value (None is a real value: no override)


def undone(log: Iterable[dict[str, Any]]) -> dict[int, int]:
    """Entry id -> the id of the entry that undid it."""
    return {int(e["undo_of"]): int(e["id"]) for e in log if e.get("undo_of") is not None and "id" in e}


def annotate(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each entry with `undoable` (it carries an undo and nothing undid it yet) and `undone_by`."""
    by = undone(log)
    out = []
    for e in log:
        eid = e.get("id")
        done = by.get(int(eid)) if eid is not None else None
        out.append({**e, "undoable": bool(e.get("undo")) and done is None, "undone_by": done})
    return out


def pick(log: list[dict[str, Any]], entry_id: int | None) -> dict[str, Any]:
    """The entry to undo: `entry_id`, or the newest undoable change that is not itself an undo. Raises NotFound /
    Conflict naming why not (unknown id, not a change that can be undone, already undone)."""
    by = undone(log)
    if entry_id is None:
        for x in log:  # newest first
            if x.get("undo") and x.get("undo_of") is None and int(x.get("id", 0)) not in by:
                return x
        raise NotFound("Nothing to undo: no change in the audit log that is not already undone.", param="id")
    e: dict[str, Any] | None = next((x for x in log if x.get("id") == entry_id), None)
    if e is None:
        raise NotFound(f"No audit entry {entry_id}.", param="id")
    if not e.get("undo"):
        raise Conflict(f"Audit entry {entry_id} ({e.get('what')}) cannot be undone"
                       + (" (edit the policy files instead)." if e.get("what") == "policy_reload" else "."), param="id")
    if entry_id in by:
        raise Conflict(f"Audit entry {entry_id} was already undone by entry {by[entry_id]}.", param="id")
    return e


def _policy(t: Tenant) -> dict[str, Any]:
    d = t.model_dump(mode="json", exclude={"api_key_hashes"})
    # how many keys and a tag of the set (so a rotation shows), never the digests themselves
    tag = hashlib.sha256("".join(sorted(t.api_key_hashes)).encode()).hexdigest()[:8]
    d["api_keys"] = f"{len(t.api_key_hashes)} (set {tag})"
    return d


def policy_diff(old: Iterable[Tenant], new: Iterable[Tenant]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(before, after): per tenant that changed, the fields that changed (a tenant added or removed: None on the
    side where it is missing)."""
    a, b = {t.name: _policy(t) for t in old}, {t.name: _policy(t) for t in new}
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x is None or y is None:
            before[name], after[name] = x, y
            continue
        keys = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        if keys:
            before[name] = {k: x.get(k) for k in keys}
            after[name] = {k: y.get(k) for k in keys}
    return before, after
