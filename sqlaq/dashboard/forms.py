"""Request input, read into values: each function takes a query string or a form and
returns what the page needs, or raises :class:`BadInput` with a message naming the field
(the page answers 400 with it).

Values are parsed with the domains of :mod:`sqlaq.option`, so the dashboard takes what
``sqlaq list`` and ``sqlaq prune`` take, within the same bounds: durations up to 100
years, ids within bigint, text PostgreSQL can store. No web framework here: the mappings
come from Starlette's ``QueryParams`` and ``FormData``, or any ``Mapping`` of lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, TypeVar
from urllib.parse import urlencode

from sqlaq.config import DEFAULT_RETENTION
from sqlaq.dashboard.reads import WINDOWS
from sqlaq.errors import ConfigError
from sqlaq.option import JOB_ID, Domain, Duration, Integer, Text
from sqlaq.schema import JobStatus

__all__ = [
    "DEFAULT_FAILURES_SINCE",
    "DEFAULT_HOURS",
    "BadInput",
    "FailureGroup",
    "JobFilter",
    "confirmed",
    "failure_group",
    "failures_since",
    "hours",
    "job_filter",
    "job_id",
    "prune_ages",
    "queue_name",
]

T = TypeVar("T")

#: The window of the throughput chart when the page names none: the last 3 hours.
DEFAULT_HOURS = 3
#: The failures page's default range: failed jobs are kept 30 days by default.
DEFAULT_FAILURES_SINCE = timedelta(days=7)
_LIMIT = Integer(1, 500)


class BadInput(ValueError):
    """A query-string or form value the dashboard cannot take; the message says which
    and what it accepts."""


class Params(Protocol):
    """What Starlette's ``QueryParams`` and ``FormData`` both offer."""

    def get(self, key: str, /) -> Any: ...

    def getlist(self, key: str, /) -> list[Any]: ...


def _optional(params: Params, name: str, domain: Domain[T]) -> T | None:
    """Field *name* parsed with *domain*; None when absent or blank (an empty field of a
    GET form is no filter)."""
    text = params.get(name)
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if not isinstance(text, str):
        raise BadInput(f"{name}: expected text, got a file")
    try:
        return domain.parse(text, name)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def _value(params: Params, name: str, domain: Domain[T], default: T) -> T:
    found = _optional(params, name, domain)
    return default if found is None else found


def hours(params: Params) -> int:
    """``hours``, the overview's range: one of :data:`~sqlaq.dashboard.reads.WINDOWS`."""
    value = _value(params, "hours", Integer(1, 24), DEFAULT_HOURS)
    if value not in WINDOWS:
        shown = ", ".join(str(h) for h in WINDOWS)
        raise BadInput(f"hours: must be one of {shown}, got {value}")
    return value


def job_id(text: str) -> int:
    """A job id from a path, within bigint."""
    try:
        return JOB_ID.parse(text, "job id")
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


@dataclass(frozen=True)
class JobFilter:
    """The jobs list's filters (those of ``sqlaq list``) and page position."""

    statuses: tuple[JobStatus, ...] = ()
    kind: str | None = None
    queue: str | None = None
    since: timedelta | None = None
    limit: int = 50
    before: int | None = None
    after: int | None = None
    since_text: str = field(default="", compare=False)

    def query(self, **page: int) -> str:
        """The query string of these filters, with *page* (``before=`` or ``after=``)."""
        pairs: list[tuple[str, Any]] = [("status", s.value) for s in self.statuses]
        for name in ("kind", "queue"):
            if getattr(self, name) is not None:
                pairs.append((name, getattr(self, name)))
        if self.since_text:
            pairs.append(("since", self.since_text))
        if self.limit != 50:
            pairs.append(("limit", self.limit))
        pairs.extend(page.items())
        return urlencode(pairs)


def _statuses(values: Sequence[Any]) -> tuple[JobStatus, ...]:
    found: list[JobStatus] = []
    for value in values:
        if not isinstance(value, str) or not value.strip():
            continue
        try:
            status = JobStatus(value.strip())
        except ValueError:
            choices = ", ".join(s.value for s in JobStatus)
            shown = value if len(value) <= 40 else value[:40] + "..."
            raise BadInput(f"status: invalid status {shown!r}: use {choices}") from None
        if status not in found:
            found.append(status)
    return tuple(found)


def job_filter(params: Params) -> JobFilter:
    """The jobs list's filters: ``status`` (repeatable), ``kind``, ``queue``, ``since``
    (a duration), ``limit`` (1 to 500) and ``before`` or ``after`` (ids)."""
    before = _optional(params, "before", JOB_ID)
    after = _optional(params, "after", JOB_ID)
    if before is not None and after is not None:
        raise BadInput("before and after: give one of them, not both")
    since = _optional(params, "since", Duration())
    return JobFilter(
        statuses=_statuses(params.getlist("status")),
        kind=_optional(params, "kind", Text()),
        queue=_optional(params, "queue", Text()),
        since=since,
        limit=_value(params, "limit", _LIMIT, 50),
        before=before,
        after=after,
        since_text=str(params.get("since") or "").strip() if since is not None else "",
    )


def failures_since(params: Params) -> timedelta | None:
    """``since``: a duration, or ``all`` (None: every failed job); default 7 days."""
    text = params.get("since")
    if isinstance(text, str) and text.strip().lower() == "all":
        return None
    return _value(params, "since", Duration(minimum=timedelta(seconds=1)), DEFAULT_FAILURES_SINCE)


@dataclass(frozen=True)
class FailureGroup:
    """One failure group: the kind, the first line of the error, the failures' range."""

    kind: str
    error: str
    since: timedelta | None

    def fields(self) -> dict[str, str]:
        """The group as form fields (and a query string's pairs)."""
        since = "all" if self.since is None else f"{self.since.total_seconds():g}s"
        return {"kind": self.kind, "error": self.error, "since": since}


def failure_group(params: Params) -> FailureGroup:
    """``kind`` and ``error`` (both required; the error may be empty) and ``since``."""
    kind = _optional(params, "kind", Text())
    if kind is None:
        raise BadInput("kind: required")
    error = params.get("error")
    if not isinstance(error, str):
        raise BadInput("error: required (the first line of the group's last_error)")
    try:
        Text().parse(error, "error")
    except ConfigError as exc:
        raise BadInput(str(exc)) from None
    return FailureGroup(kind, error, failures_since(params))


def prune_ages(params: Params) -> dict[JobStatus, timedelta]:
    """``done``, ``cancelled`` and ``failed``: how old a finished job of each status
    must be to be deleted (defaults of ``sqlaq prune``); ``keep`` for a status skips it."""
    ages = {}
    for status, default in DEFAULT_RETENTION.items():
        text = params.get(status.value)
        if isinstance(text, str) and text.strip().lower() == "keep":
            continue
        age = _value(params, status.value, Duration(), default)
        if age is not None:
            ages[status] = age
    return ages


def queue_name(params: Params) -> str:
    """``queue``: a queue's name (required)."""
    queue = _optional(params, "queue", Text())
    if queue is None:
        raise BadInput("queue: required")
    return queue


def confirmed(form: Params) -> bool:
    """Whether the form carries ``confirm=yes`` (what every bulk action's confirmation
    page sends)."""
    return bool(form.get("confirm") == "yes")
