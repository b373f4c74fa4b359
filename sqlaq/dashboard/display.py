"""How the dashboard's templates show values: Jinja2 filters, pure functions.

Times are shown in UTC (the clock of the plots, and of schedule slots whatever a
schedule's time zone), durations in the largest unit that keeps them short (``3.2m``),
as ``sqlaq stats`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

__all__ = ["FILTERS", "age", "first_line", "moment", "seconds"]


def moment(value: datetime | None) -> str:
    """``2026-01-05 08:00:03`` (UTC); ``-`` for None."""
    if value is None:
        return "-"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def age(value: timedelta | None) -> str:
    """``45.0s``, ``3.2m``, ``1.5h``, ``2.0d``; ``-`` for None."""
    if value is None:
        return "-"
    return seconds(value.total_seconds())


def seconds(value: float | None) -> str:
    """A number of seconds as :func:`age` shows it."""
    if value is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if abs(value) >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.1f}s"


def first_line(text: str | None, width: int = 120) -> str:
    """The first line of *text*, cut to *width* characters."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 1] + "…"


#: The filters, by the name templates use.
FILTERS: dict[str, Callable[..., Any]] = {
    "moment": moment,
    "age": age,
    "seconds": seconds,
    "first_line": first_line,
}
