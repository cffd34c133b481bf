"""The budget's period names (`tenancy.budget.periods`): kept between calls, yet exactly what the clock says."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gateway.tenancy.budget import periods


def _direct(now: float) -> dict[str, str]:
    d = datetime.fromtimestamp(now, tz=UTC)
    return {"day": d.strftime("%Y-%m-%d"), "month": d.strftime("%Y-%m")}


MONTH_END = datetime(2026, 12, 1, tzinfo=UTC).timestamp()
YEAR_END = datetime(2027, 1, 1, tzinfo=UTC).timestamp()


@pytest.mark.parametrize("now", [0.0, 86399.999, 86400.0, -0.5, MONTH_END - 0.001, MONTH_END, MONTH_END + 0.001,
                                 YEAR_END - 1e-6, YEAR_END, 1_790_000_000.25])
def test_the_names_kept_from_the_last_call_are_the_clock_s(now):
    """A reservation and its settlement are keyed by these names: a name kept past its day would put a request's
    spend into the wrong day or month. Asked after the instant before and again, the answer is the direct one."""
    assert periods(now - 1.0) == _direct(now - 1.0)
    assert periods(now) == _direct(now)
    assert periods(now) == _direct(now)


def test_a_caller_changing_its_answer_changes_no_later_answer():
    """Reservations keep the dict they were given; each call returns its own."""
    a = periods(MONTH_END)
    a["day"] = "elsewhere"
    assert periods(MONTH_END)["day"] == "2026-12-01"
