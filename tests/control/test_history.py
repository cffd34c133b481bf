"""The audit log read as history (pure): which entry an undo means, what is already undone, what a reload changed."""

import pytest

from gateway.config import hash_key
from gateway.control.history import annotate, pick, policy_diff
from gateway.errors import Conflict, NotFound
from gateway.policy_schema import Tenant

LOG = [  # newest first
    {"id": 5, "what": "policy_reload"},
    {"id": 4, "what": "undrain", "undo": {"kind": "drain"}, "undo_of": 2},
    {"id": 3, "what": "pool", "undo": {"kind": "pool"}},
    {"id": 2, "what": "drain", "undo": {"kind": "drain"}},
    {"id": 1, "what": "flush_prefix"},
]


def test_default_undo_is_the_newest_change_not_undone_and_not_an_undo():
    assert pick(LOG, None)["id"] == 3
    assert pick(LOG, 4)["id"] == 4  # an undo can be undone when named (a redo)


@pytest.mark.parametrize("entry, error, text", [
    (2, Conflict, "already undone by entry 4"),
    (5, Conflict, "edit the policy files"),
    (1, Conflict, "cannot be undone"),
    (99, NotFound, "No audit entry 99"),
])
def test_undo_refusals_say_why(entry, error, text):
    with pytest.raises(error) as e:
        pick(LOG, entry)
    assert text in e.value.message and e.value.param == "id"


def test_nothing_left_to_undo():
    with pytest.raises(NotFound):
        pick([LOG[0], LOG[4]], None)


def test_annotate_marks_undoable_and_undone_by():
    rows = {e["id"]: e for e in annotate(LOG)}
    assert rows[2]["undone_by"] == 4 and not rows[2]["undoable"]
    assert rows[3]["undoable"] and rows[4]["undoable"] and not rows[5]["undoable"]


def test_policy_diff_names_changed_fields_per_tenant_and_never_key_digests():
    a = Tenant(name="a", api_key_hashes=[hash_key("1")], models=["m"], priority="low")
    a2 = a.model_copy(update={"priority": "high", "api_key_hashes": [hash_key("2")]})
    b = Tenant(name="b", api_key_hashes=[hash_key("3")], models=["m"])
    before, after = policy_diff([a, b], [a2])
    assert set(before["a"]) == set(after["a"]) == {"priority", "api_keys"}  # a key rotation shows as a change
    assert before["a"]["priority"] == "low" and after["a"]["priority"] == "high" and after["b"] is None
    assert before["b"]["api_keys"].startswith("1 (set ")
    assert not any(hash_key(k) in str(before) + str(after) for k in "123")  # never a digest
