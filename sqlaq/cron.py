"""Standard 5-field cron schedules, in UTC or in an IANA time zone. Pure: no clock, no SQL.

``minute hour day-of-month month day-of-week``, each field ``*``, a number, a range
``a-b``, a step ``*/n`` or ``a-b/n``, or a comma-separated list of those; months and
weekdays also by name (``jan``..``dec``, ``sun``..``sat``; 0 and 7 are both Sunday).
The shorthands ``@yearly`` (``@annually``), ``@monthly``, ``@weekly``, ``@daily``
(``@midnight``) and ``@hourly`` are accepted.

As in Vixie cron, when both day-of-month and day-of-week are restricted (neither is
``*``), a day matches if *either* matches.

The caller supplies the time (the database's ``now()``, for periodic jobs); this module
only does calendar arithmetic on it.

With a time zone, the fields are read on that zone's wall clock and each slot is the UTC
instant that wall-clock time names. Where daylight saving time moves the clock:

* **Skipped times** (the clock springs forward, e.g. 02:00-03:00 in Europe/Paris on the
  last Sunday of March): a slot that falls in the gap is moved to the first instant
  after it (03:00 local), as cronie and Vixie cron do. Several slots in the gap, and a
  slot at that instant, are one slot: each instant is a slot at most once.
* **Repeated times** (the clock falls back, e.g. 02:00-03:00 in Europe/Paris on the
  last Sunday of October): a slot names its first occurrence only (02:30 summer time,
  not 02:30 winter time an hour later).

Either way slots stay distinct, increasing UTC instants.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sqlaq.errors import ConfigError

__all__ = ["CronSchedule", "time_zone"]

_SHORTHANDS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_MONTH_NAMES = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_MONTHS = {name: number for number, name in enumerate(_MONTH_NAMES, 1)}
_DAYS = {
    name: number for number, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))
}
_FIELDS: tuple[tuple[str, int, int, dict[str, int]], ...] = (  # name, low, high, names
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
)
# Every schedule that can match at all matches within this many days (a 29 February
# that is also a given weekday recurs within 28 years).
_SEARCH_DAYS = 366 * 28
_MINUTE = timedelta(minutes=1)


def time_zone(zone: ZoneInfo | str | None) -> ZoneInfo | None:
    """*zone* as a :class:`~zoneinfo.ZoneInfo` (an IANA name such as ``"Europe/Paris"``
    is looked up), or None for UTC.

    Raises:
        ConfigError: not a known IANA time zone, or neither a str nor a ZoneInfo.
    """
    if zone is None or isinstance(zone, ZoneInfo):
        return zone
    if not isinstance(zone, str):
        raise ConfigError(
            f"a time zone must be an IANA name (str) or a zoneinfo.ZoneInfo, "
            f"got {type(zone).__name__}"
        )
    try:
        return ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: "Europe", a folder
        raise ConfigError(
            f"unknown time zone {zone!r}: give an IANA name such as 'Europe/Paris'"
        ) from None


@dataclass(frozen=True, slots=True)
class CronSchedule:
    """A parsed cron expression. Build it with :meth:`parse`.

    Attributes:
        expression: The expression as given.
        tz: The time zone its fields are read in; None for UTC.
    """

    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool  # day of month is "*"
    any_weekday: bool  # day of week is "*"
    tz: ZoneInfo | None = None

    @classmethod
    def parse(cls, expression: str, tz: ZoneInfo | str | None = None) -> CronSchedule:
        """Parse *expression*, read on the wall clock of *tz* (UTC by default).

        Raises:
            ConfigError: not a 5-field cron expression (the message names the field),
                or *tz* is not a known IANA time zone.
        """
        zone = time_zone(tz)
        if not isinstance(expression, str):
            raise ConfigError(f"a cron schedule must be a str, got {type(expression).__name__}")
        text = _SHORTHANDS.get(expression.strip().lower(), expression)
        parts = text.split()
        if len(parts) != 5:
            raise ConfigError(
                f"cron schedule {expression!r} has {len(parts)} fields; it needs 5: "
                "minute hour day-of-month month day-of-week (e.g. '0 * * * *')"
            )
        values = [
            _parse_field(part, *spec, expression) for part, spec in zip(parts, _FIELDS, strict=True)
        ]
        minutes, hours, days, months, weekdays = values
        schedule = cls(
            expression,
            minutes,
            hours,
            days,
            months,
            frozenset(d % 7 for d in weekdays),
            any_day=parts[2] == "*",
            any_weekday=parts[4] == "*",
            tz=zone,
        )
        if schedule.next_after(datetime(2000, 1, 1, tzinfo=UTC)) is None:
            raise ConfigError(f"cron schedule {expression!r} never matches a real date")
        return schedule

    def _day_matches(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        in_month = day.day in self.days
        in_week = (day.isoweekday() % 7) in self.weekdays
        if self.any_day or self.any_weekday:
            return in_month and in_week
        return in_month or in_week

    @property
    def zone(self) -> str:
        """The time zone's IANA name, ``"UTC"`` without one."""
        return "UTC" if self.tz is None else str(self.tz.key)

    def next_after(self, moment: datetime) -> datetime | None:
        """The first slot strictly after *moment* (aware; compared in UTC), or None.

        Slots are UTC instants (``tzinfo=UTC``), whatever the schedule's time zone."""
        utc = _utc(moment)
        for wall in self._walls_from(self._wall(utc) + _MINUTE):
            slot = self._instant(wall)
            if slot > utc:  # not so only for first occurrences of a repeated hour
                return slot
        return None

    def latest_at_or_before(self, moment: datetime) -> datetime | None:
        """The last slot at or before *moment* (aware; compared in UTC), or None."""
        utc = _utc(moment)
        end = self._wall(utc)
        if self.tz is not None:
            # Wall-clock order is slot order, so the latest slot is the wall-clock time
            # just before the first one after *moment*: in a repeated hour, wall-clock
            # times after *moment*'s may name first occurrences before it.
            for wall in self._walls_from(end + _MINUTE):
                if self._instant(wall) > utc:
                    end = wall - _MINUTE
                    break
        for wall in self._walls_back(end):
            return self._instant(wall)
        return None

    def _wall(self, utc: datetime) -> datetime:
        """The naive wall-clock minute of *utc* in the schedule's zone."""
        local = utc if self.tz is None else utc.astimezone(self.tz)
        return local.replace(second=0, microsecond=0, tzinfo=None, fold=0)

    def _instant(self, wall: datetime) -> datetime:
        """The slot (UTC) of the wall-clock time *wall*: its first occurrence, or, when
        the clock skips it, the first instant after the gap."""
        if self.tz is None:
            return wall.replace(tzinfo=UTC)
        before = wall.replace(tzinfo=self.tz, fold=0).astimezone(UTC)
        if before.astimezone(self.tz).replace(tzinfo=None) == wall:
            return before  # exists (fold=0 is the first occurrence of a repeated time)
        # In a gap: fold=0 reads it with the offset before the change, fold=1 with the
        # one after; the change lies between the two readings. Find it to the second.
        after = wall.replace(tzinfo=self.tz, fold=1).astimezone(UTC)
        low, high = min(before, after), max(before, after)
        offset = high.astimezone(self.tz).utcoffset()
        while high - low > timedelta(seconds=1):
            middle = low + (high - low) / 2
            middle = middle.replace(microsecond=0)
            if middle.astimezone(self.tz).utcoffset() == offset:
                high = middle
            else:
                low = middle
        return high

    def _walls_from(self, start: datetime) -> Iterator[datetime]:
        """The matching wall-clock minutes at or after *start* (naive), ascending."""
        day = start.date()
        for offset in range(_SEARCH_DAYS):
            current = day + timedelta(days=offset)
            if not self._day_matches(current):
                continue
            first = start if offset == 0 else None
            for hour in sorted(self.hours):
                if first is not None and hour < first.hour:
                    continue
                for minute in sorted(self.minutes):
                    if first is not None and hour == first.hour and minute < first.minute:
                        continue
                    yield datetime(current.year, current.month, current.day, hour, minute)

    def _walls_back(self, end: datetime) -> Iterator[datetime]:
        """The matching wall-clock minutes at or before *end* (naive), descending."""
        day = end.date()
        for offset in range(_SEARCH_DAYS):
            current = day - timedelta(days=offset)
            if not self._day_matches(current):
                continue
            last = end if offset == 0 else None
            for hour in sorted(self.hours, reverse=True):
                if last is not None and hour > last.hour:
                    continue
                for minute in sorted(self.minutes, reverse=True):
                    if last is not None and hour == last.hour and minute > last.minute:
                        continue
                    yield datetime(current.year, current.month, current.day, hour, minute)


def _utc(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        raise ConfigError("cron times must be timezone-aware (the database's now())")
    return moment.astimezone(UTC)


def _parse_field(
    text: str, name: str, low: int, high: int, names: dict[str, int], expression: str
) -> frozenset[int]:
    values: set[int] = set()
    for item in text.lower().split(","):
        base, _, step_text = item.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if base == "*":
                first, last = low, high
            elif "-" in base:
                a, b = base.split("-", 1)
                first, last = _value(a, names), _value(b, names)
            else:
                first = _value(base, names)
                last = high if step_text else first
        except ValueError:
            raise ConfigError(f"cron schedule {expression!r}: bad {name} field {text!r}") from None
        if step < 1 or not low <= first <= last <= high:
            raise ConfigError(
                f"cron schedule {expression!r}: {name} field {text!r} is outside {low}-{high}"
            )
        values.update(range(first, last + 1, step))
    return frozenset(values)


def _value(text: str, names: dict[str, int]) -> int:
    return names[text] if text in names else int(text)
