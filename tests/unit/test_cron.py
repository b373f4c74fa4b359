"""Cron schedules: parsing, next and latest slots (pure; no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from sqlaq.cron import CronSchedule
from sqlaq.errors import ConfigError


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize(
    ("expression", "moment", "expected"),
    [
        ("0 * * * *", "2026-12-02 15:38:10", "2026-12-02 16:00"),
        ("0 * * * *", "2026-12-02 16:00:00", "2026-12-02 17:00"),  # strictly after
        ("*/15 * * * *", "2026-12-02 15:38", "2026-12-02 15:45"),
        ("30 9 * * mon-fri", "2026-12-04 10:00", "2026-12-07 09:30"),  # Fri -> Mon
        ("0 0 1 * *", "2026-12-15 00:00", "2027-01-01 00:00"),
        ("0 0 29 2 *", "2026-03-01 00:00", "2028-02-29 00:00"),
        ("@daily", "2026-12-31 23:59:59", "2027-01-01 00:00"),
        ("@hourly", "2026-12-02 15:59", "2026-12-02 16:00"),
        ("0 12 * * 7", "2026-12-02 00:00", "2026-12-06 12:00"),  # 7 is Sunday too
        ("5,10 1-2 * jan-feb *", "2026-12-02 00:00", "2027-01-01 01:05"),
        # Both day fields restricted: either matches (Vixie cron).
        ("0 0 13 * fri", "2026-12-02 00:00", "2026-12-04 00:00"),
    ],
)
def test_next_after(expression: str, moment: str, expected: str) -> None:
    assert CronSchedule.parse(expression).next_after(at(moment)) == at(expected)


@pytest.mark.parametrize(
    ("expression", "moment", "expected"),
    [
        ("0 * * * *", "2026-12-02 15:38", "2026-12-02 15:00"),
        ("0 * * * *", "2026-12-02 15:00", "2026-12-02 15:00"),  # at or before
        ("30 9 * * mon-fri", "2026-12-07 08:00", "2026-12-04 09:30"),
        ("0 0 1 1 *", "2026-12-02 00:00", "2026-01-01 00:00"),
    ],
)
def test_latest_at_or_before(expression: str, moment: str, expected: str) -> None:
    assert CronSchedule.parse(expression).latest_at_or_before(at(moment)) == at(expected)


def test_other_time_zones_are_compared_in_utc() -> None:
    plus_two = timezone(timedelta(hours=2))
    moment = datetime(2026, 12, 2, 17, 30, tzinfo=plus_two)  # 15:30 UTC
    assert CronSchedule.parse("0 * * * *").next_after(moment) == at("2026-12-02 16:00")


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("* * * *", "has 4 fields; it needs 5"),
        ("60 * * * *", "minute field '60' is outside 0-59"),
        ("* 24 * * *", "hour field '24' is outside 0-23"),
        ("* * 0 * *", "day of month field '0' is outside 1-31"),
        ("* * * 13 *", "month field '13' is outside 1-12"),
        ("* * * * 8", "day of week field '8' is outside 0-7"),
        ("*/0 * * * *", "minute field '\\*/0' is outside"),
        ("a * * * *", "bad minute field 'a'"),
        ("0 0 30 2 *", "never matches a real date"),
    ],
)
def test_bad_schedules_are_rejected_with_the_field(expression: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CronSchedule.parse(expression)


def test_naive_times_are_refused() -> None:
    with pytest.raises(ConfigError, match="timezone-aware"):
        CronSchedule.parse("* * * * *").next_after(datetime(2026, 1, 1))
