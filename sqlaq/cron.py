"""Standard 5-field cron schedules, in UTC. Pure: no clock, no SQL.

``minute hour day-of-month month day-of-week``, each field ``*``, a number, a range
``a-b``, a step ``*/n`` or ``a-b/n``, or a comma-separated list of those; months and
weekdays also by name (``jan``..``dec``, ``sun``..``sat``; 0 and 7 are both Sunday).
The shorthands ``@yearly`` (``@annually``), ``@monthly``, ``@weekly``, ``@daily``
(``@midnight``) and ``@hourly`` are accepted.

As in Vixie cron, when both day-of-month and day-of-week are restricted (neither is
``*``), a day matches if *either* matches.

The caller supplies the time (the database's ``now()``, for periodic jobs); this module
only does calendar arithmetic on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlaq.errors import ConfigError

__all__ = ["CronSchedule"]

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


@dataclass(frozen=True, slots=True)
class CronSchedule:
    """A parsed cron expression. Build it with :meth:`parse`.

    Attributes:
        expression: The expression as given.
    """

    expression: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    any_day: bool  # day of month is "*"
    any_weekday: bool  # day of week is "*"

    @classmethod
    def parse(cls, expression: str) -> CronSchedule:
        """Parse *expression*.

        Raises:
            ConfigError: not a 5-field cron expression; the message names the field.
        """
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

    def next_after(self, moment: datetime) -> datetime | None:
        """The first slot strictly after *moment* (aware; compared in UTC), or None."""
        start = _utc(moment).replace(second=0, microsecond=0) + timedelta(minutes=1)
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
                    return datetime(current.year, current.month, current.day, hour, minute,
                                    tzinfo=UTC)  # fmt: skip
        return None

    def latest_at_or_before(self, moment: datetime) -> datetime | None:
        """The last slot at or before *moment* (aware; compared in UTC), or None."""
        end = _utc(moment).replace(second=0, microsecond=0)
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
                    return datetime(current.year, current.month, current.day, hour, minute,
                                    tzinfo=UTC)  # fmt: skip
        return None


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
