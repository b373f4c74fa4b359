"""Cron schedules: parsing, next and latest slots (pure; no database)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

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


# -- time zones ----------------------------------------------------------------------


def local(text: str, zone: str) -> datetime:
    """The first occurrence of the wall-clock time *text* in *zone*, as UTC."""
    return datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(zone)).astimezone(UTC)


def slots(expression: str, zone: str, start: str, end: str) -> list[str]:
    """Every slot from *start* to *end* (UTC, both included), as ``UTC instant=local
    wall time``."""
    schedule = CronSchedule.parse(expression, tz=zone)
    found: list[str] = []
    moment = at(start) - timedelta(seconds=1)
    while (following := schedule.next_after(moment)) is not None and following <= at(end):
        assert following.tzinfo is UTC
        found.append(f"{following:%m-%d %H:%M}Z={following.astimezone(schedule.tz):%H:%M%z}")
        moment = following
    return found


def test_a_zone_reads_the_fields_on_its_wall_clock() -> None:
    paris = CronSchedule.parse("0 9 * * mon-fri", tz="Europe/Paris")
    assert paris.next_after(at("2026-12-04 07:00")) == at("2026-12-04 08:00")  # winter, +1
    assert paris.next_after(at("2026-07-01 00:00")) == at("2026-07-01 07:00")  # summer, +2
    assert paris.latest_at_or_before(at("2026-12-07 07:59")) == at("2026-12-04 08:00")
    kolkata = CronSchedule.parse("0 9 * * *", tz=ZoneInfo("Asia/Kolkata"))  # +05:30, no DST
    assert kolkata.next_after(at("2026-03-29 00:00")) == at("2026-03-29 03:30")
    assert kolkata.zone == "Asia/Kolkata"
    assert CronSchedule.parse("0 9 * * *").zone == "UTC"


@pytest.mark.parametrize(
    ("zone", "day", "expected"),
    [
        # Spring forward: 02:00-03:00 does not exist; 02:30 runs at 03:00, once.
        ("Europe/Paris", "2027-03-28", "03-28 01:00Z=03:00+0200"),
        ("America/New_York", "2027-03-14", "03-14 07:00Z=03:00-0400"),
        ("Australia/Adelaide", "2026-10-04", "10-03 16:30Z=03:00+1030"),
        # A half-hour change: 02:00-02:30 does not exist.
        ("Australia/Lord_Howe", "2026-10-04", "10-03 15:30Z=02:30+1100"),
        # Fall back: 02:00-03:00 (01:00-02:00 in New York) comes twice; the first runs.
        ("Europe/Paris", "2026-10-25", "10-25 00:30Z=02:30+0200"),
        ("America/New_York", "2026-11-01", "11-01 07:30Z=02:30-0500"),
        ("Australia/Adelaide", "2027-04-04", "04-03 16:00Z=02:30+1030"),
    ],
)
def test_a_daily_slot_runs_once_on_a_dst_change(zone: str, day: str, expected: str) -> None:
    schedule = CronSchedule.parse("30 2 * * *", tz=zone)
    moment = datetime.fromisoformat(day).replace(tzinfo=schedule.tz) - timedelta(days=2)
    by_day: dict[str, list[str]] = {}
    for _ in range(5):
        following = schedule.next_after(moment)
        assert following is not None
        moment = following
        wall = moment.astimezone(schedule.tz)
        by_day.setdefault(f"{wall:%Y-%m-%d}", []).append(f"{moment:%m-%d %H:%M}Z={wall:%H:%M%z}")
    assert len(by_day) == 5  # one a day, the day of the change too
    assert by_day[day] == [expected]


def test_slots_in_a_skipped_hour_run_once_at_the_end_of_the_gap() -> None:
    # Paris, 2027-03-28: 02:00 CET is followed by 03:00 CEST (01:00 UTC).
    assert slots("*/20 1-3 * * *", "Europe/Paris", "2027-03-27 23:00", "2027-03-28 02:00") == [
        "03-28 00:00Z=01:00+0100",
        "03-28 00:20Z=01:20+0100",
        "03-28 00:40Z=01:40+0100",
        "03-28 01:00Z=03:00+0200",  # 02:00, 02:20, 02:40 and 03:00: one slot
        "03-28 01:20Z=03:20+0200",
        "03-28 01:40Z=03:40+0200",
    ]
    hourly = slots("0 * * * *", "America/New_York", "2027-03-14 05:00", "2027-03-14 09:00")
    assert hourly == [
        "03-14 05:00Z=00:00-0500",
        "03-14 06:00Z=01:00-0500",
        "03-14 07:00Z=03:00-0400",  # one job for the hour that was skipped and 03:00
        "03-14 08:00Z=04:00-0400",
        "03-14 09:00Z=05:00-0400",
    ]


def test_slots_in_a_repeated_hour_run_once_at_the_first_occurrence() -> None:
    # New York, 2026-11-01: 01:00-02:00 EDT, then 01:00-02:00 EST again.
    hourly = slots("*/30 * * * *", "America/New_York", "2026-11-01 04:30", "2026-11-01 08:00")
    assert hourly == [
        "11-01 04:30Z=00:30-0400",
        "11-01 05:00Z=01:00-0400",
        "11-01 05:30Z=01:30-0400",
        # 01:00 and 01:30 EST (06:00, 06:30 UTC) are the same wall-clock times again
        "11-01 07:00Z=02:00-0500",
        "11-01 07:30Z=02:30-0500",
        "11-01 08:00Z=03:00-0500",
    ]
    schedule = CronSchedule.parse("*/30 * * * *", tz="America/New_York")
    # During the repeat, the latest slot is still the first occurrence's last one.
    assert schedule.latest_at_or_before(at("2026-11-01 06:45")) == at("2026-11-01 05:30")
    assert schedule.next_after(at("2026-11-01 06:00")) == at("2026-11-01 07:00")


@pytest.mark.parametrize("zone", ["Europe/Paris", "America/New_York", "Australia/Adelaide"])
@pytest.mark.parametrize("expression", ["* * * * *", "*/7 * * * *", "30 2 * * *", "0 1-3 * * *"])
def test_slots_are_distinct_increasing_and_latest_agrees_with_next(
    expression: str, zone: str
) -> None:
    """Across a whole year (both changes), minute by minute around each slot."""
    schedule = CronSchedule.parse(expression, tz=zone)
    transitions = {"Europe/Paris": ["2026-03-29", "2026-10-25"],
                   "America/New_York": ["2026-03-08", "2026-11-01"],
                   "Australia/Adelaide": ["2026-04-05", "2026-10-04"]}[zone]  # fmt: skip
    for day in transitions:
        start = datetime.fromisoformat(day).replace(tzinfo=UTC) - timedelta(days=1)
        previous, moment = None, start
        while moment < start + timedelta(days=2):
            following = schedule.next_after(moment)
            assert following is not None
            assert following > moment
            latest = schedule.latest_at_or_before(moment)
            assert latest is not None
            assert latest <= moment
            assert schedule.next_after(latest) == following
            if previous is not None:
                assert latest >= previous
            previous = latest
            moment += timedelta(minutes=1)


@pytest.mark.parametrize(
    ("zone", "message"),
    [
        ("Europe/Pariss", "unknown time zone 'Europe/Pariss'"),
        ("", "unknown time zone ''"),
        ("Europe", "unknown time zone 'Europe'"),  # a folder of the zone database
        ("x" * 300, "unknown time zone 'x+'"),
        ("../etc/passwd", "unknown time zone '../etc/passwd'"),
        (UTC, "a time zone must be an IANA name \\(str\\) or a zoneinfo.ZoneInfo"),
    ],
)
def test_bad_time_zones_are_rejected_by_name(zone: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        CronSchedule.parse("* * * * *", tz=zone)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)
