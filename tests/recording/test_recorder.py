"""The trace recorder: the replay format, ids remapped per recording, never text or names, bounded in size."""

from __future__ import annotations

from pathlib import Path

from gateway.config import Recording
from gateway.prefix.hashing import prefix_hashes
from gateway.recording.recorder import TraceRecorder
from gateway.recording.trace import read_trace
from gateway.routing.request import RoutingRequest
from gateway_lab.replay.bounds import ideal_hit_rate


def rreq(text: str, tenant: str = "acme", ns: str = "") -> RoutingRequest:
    body = {"messages": [{"role": "user", "content": text}]}
    hashes = tuple(prefix_hashes("chat/completions", body, "glm-5.2", ns, 256))
    return RoutingRequest("r", tenant, "glm-5.2", "chat/completions", True, len(text) // 4, None, hashes)


def usage(prompt: int, out: int, cached: int) -> dict[str, object]:
    return {"prompt_tokens": prompt, "completion_tokens": out, "prompt_tokens_details": {"cached_tokens": cached}}


def test_shared_prefixes_share_block_ids_and_nothing_identifying_is_written(tmp_path: Path) -> None:
    """Two prompts with a common 1,024-token prefix share exactly their first two 512-token block ids; the file
    holds lengths and small integers only (no text, no tenant name, no raw hash)."""
    rec = TraceRecorder(Recording(path=str(tmp_path / "t.jsonl")), chunk_tokens=256, clock=lambda: 0.0)
    shared = "s" * 4096  # 1,024 tokens
    a, b = rreq(shared + "a" * 3000), rreq(shared + "b" * 3000, tenant="globex")
    rec.record(a, usage(1774, 10, 0), arrived_at=100.0)
    rec.record(b, usage(1774, 20, 1024), arrived_at=100.5)
    rec.close()
    text = (tmp_path / "t.jsonl").read_text()
    assert "acme" not in text and "globex" not in text and "sss" not in text
    assert not any(str(abs(h)) in text for h in a.hashes)
    t = read_trace(tmp_path / "t.jsonl")
    assert [r.timestamp_ms for r in t] == [0.0, 500.0]
    assert len(t[0].hash_ids) == len(t[1].hash_ids) == 4  # ceil(1774 / 512)
    assert t[0].hash_ids[:2] == t[1].hash_ids[:2] and not set(t[0].hash_ids[2:]) & set(t[1].hash_ids[2:])
    assert (t[0].tenant, t[1].tenant) == (1, 2) and t[1].cached_tokens == 1024 and t[1].output_length == 20
    assert ideal_hit_rate(t) == 1024 / (2 * 1774)


def test_isolated_namespaces_never_share_ids(tmp_path: Path) -> None:
    rec = TraceRecorder(Recording(path=str(tmp_path / "t.jsonl")), chunk_tokens=256)
    text = "x" * 8192
    rec.record(rreq(text, ns="tenant-a-salt"), None, 1.0)
    rec.record(rreq(text, ns="tenant-b-salt"), None, 2.0)
    rec.close()
    a, b = read_trace(tmp_path / "t.jsonl")
    assert not set(a.hash_ids) & set(b.hash_ids)
    assert a.input_length == 2048 and a.cached_tokens is None  # no usage: the gateway's own estimate


def test_recording_is_bounded_and_off_without_a_path(tmp_path: Path) -> None:
    off = TraceRecorder(Recording(), chunk_tokens=256)
    off.record(rreq("x" * 4000), None, 0.0)
    assert not off.enabled and off.requests == 0
    rec = TraceRecorder(Recording(path=str(tmp_path / "t.jsonl"), max_requests=3), chunk_tokens=256)
    for i in range(10):
        rec.record(rreq("y" * 4000 + str(i)), usage(1000, 5, 0), float(i))
    rec.close()
    assert rec.full and rec.requests == 3 and len(read_trace(tmp_path / "t.jsonl")) == 3
    small = TraceRecorder(Recording(path=str(tmp_path / "s.jsonl"), max_bytes=1024), chunk_tokens=256)
    for i in range(100):
        small.record(rreq("z" * 40_000 + str(i)), usage(10_000, 5, 0), float(i))
    small.close()
    assert small.full and (tmp_path / "s.jsonl").stat().st_size <= 1024
