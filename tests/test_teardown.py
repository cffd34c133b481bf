"""The app's shutdown steps are each bounded: a step that never returns is abandoned and named, one that raises is
named, and the steps after either still run, in order."""

from __future__ import annotations

import asyncio

from gateway.teardown import run_steps


def test_a_hung_step_and_a_failing_one_do_not_stop_the_rest(caplog):
    ran: list[str] = []

    async def hangs() -> None:
        await asyncio.Event().wait()  # never set

    def fails() -> None:
        raise RuntimeError("peer gone")

    async def flushes() -> None:
        ran.append("flush")

    steps = [("hung", hangs), ("failing", fails), ("flush", flushes), ("close", lambda: ran.append("close"))]
    bad = asyncio.run(run_steps(steps, each_s=0.05))
    assert bad == ["hung", "failing"]
    assert ran == ["flush", "close"]
    events = [getattr(r, "event", None) or r.getMessage() for r in caplog.records]
    assert any("shutdown_step_timeout" in str(e) for e in events), events
    assert any("shutdown_step_failed" in str(e) for e in events), events
